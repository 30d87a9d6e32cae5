from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Verdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERDICT_UNSPECIFIED: _ClassVar[Verdict]
    PASSED: _ClassVar[Verdict]
    FAILED: _ClassVar[Verdict]
    COMPILE_ERROR: _ClassVar[Verdict]
    RUNTIME_ERROR: _ClassVar[Verdict]
    TIMEOUT: _ClassVar[Verdict]
    MEMORY_LIMIT: _ClassVar[Verdict]
    OUTPUT_LIMIT: _ClassVar[Verdict]
    SANDBOX_ERROR: _ClassVar[Verdict]
VERDICT_UNSPECIFIED: Verdict
PASSED: Verdict
FAILED: Verdict
COMPILE_ERROR: Verdict
RUNTIME_ERROR: Verdict
TIMEOUT: Verdict
MEMORY_LIMIT: Verdict
OUTPUT_LIMIT: Verdict
SANDBOX_ERROR: Verdict

class Limits(_message.Message):
    __slots__ = ("timeout_seconds", "memory_bytes", "output_bytes")
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    memory_bytes: int
    output_bytes: int
    def __init__(self, timeout_seconds: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., output_bytes: _Optional[int] = ...) -> None: ...

class StdioTest(_message.Message):
    __slots__ = ("stdin", "expected_stdout")
    STDIN_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_STDOUT_FIELD_NUMBER: _ClassVar[int]
    stdin: str
    expected_stdout: str
    def __init__(self, stdin: _Optional[str] = ..., expected_stdout: _Optional[str] = ...) -> None: ...

class FunctionCallTest(_message.Message):
    __slots__ = ("fn_name", "args_json", "expected_json")
    FN_NAME_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_JSON_FIELD_NUMBER: _ClassVar[int]
    fn_name: str
    args_json: str
    expected_json: str
    def __init__(self, fn_name: _Optional[str] = ..., args_json: _Optional[str] = ..., expected_json: _Optional[str] = ...) -> None: ...

class AssertProgramTest(_message.Message):
    __slots__ = ("assert_program", "entry_point")
    ASSERT_PROGRAM_FIELD_NUMBER: _ClassVar[int]
    ENTRY_POINT_FIELD_NUMBER: _ClassVar[int]
    assert_program: str
    entry_point: str
    def __init__(self, assert_program: _Optional[str] = ..., entry_point: _Optional[str] = ...) -> None: ...

class Test(_message.Message):
    __slots__ = ("stdio", "function_call", "assert_program")
    STDIO_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_CALL_FIELD_NUMBER: _ClassVar[int]
    ASSERT_PROGRAM_FIELD_NUMBER: _ClassVar[int]
    stdio: StdioTest
    function_call: FunctionCallTest
    assert_program: AssertProgramTest
    def __init__(self, stdio: _Optional[_Union[StdioTest, _Mapping]] = ..., function_call: _Optional[_Union[FunctionCallTest, _Mapping]] = ..., assert_program: _Optional[_Union[AssertProgramTest, _Mapping]] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("code", "tests", "limits")
    CODE_FIELD_NUMBER: _ClassVar[int]
    TESTS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    code: str
    tests: _containers.RepeatedCompositeFieldContainer[Test]
    limits: Limits
    def __init__(self, code: _Optional[str] = ..., tests: _Optional[_Iterable[_Union[Test, _Mapping]]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class TestResult(_message.Message):
    __slots__ = ("verdict", "stdout", "stderr", "seconds", "error")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    verdict: Verdict
    stdout: str
    stderr: str
    seconds: float
    error: str
    def __init__(self, verdict: _Optional[_Union[Verdict, str]] = ..., stdout: _Optional[str] = ..., stderr: _Optional[str] = ..., seconds: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("results", "pass_rate", "isolation_tier")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_TIER_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TestResult]
    pass_rate: float
    isolation_tier: str
    def __init__(self, results: _Optional[_Iterable[_Union[TestResult, _Mapping]]] = ..., pass_rate: _Optional[float] = ..., isolation_tier: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsolationLayer(_message.Message):
    __slots__ = ("name", "protects")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PROTECTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    protects: str
    def __init__(self, name: _Optional[str] = ..., protects: _Optional[str] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("isolation_tier", "layers", "not_protected", "probes", "default_limits", "max_limits", "max_concurrency", "max_queue")
    class ProbesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ISOLATION_TIER_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    NOT_PROTECTED_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_LIMITS_FIELD_NUMBER: _ClassVar[int]
    MAX_LIMITS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    isolation_tier: str
    layers: _containers.RepeatedCompositeFieldContainer[IsolationLayer]
    not_protected: _containers.RepeatedScalarFieldContainer[str]
    probes: _containers.ScalarMap[str, str]
    default_limits: Limits
    max_limits: Limits
    max_concurrency: int
    max_queue: int
    def __init__(self, isolation_tier: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[IsolationLayer, _Mapping]]] = ..., not_protected: _Optional[_Iterable[str]] = ..., probes: _Optional[_Mapping[str, str]] = ..., default_limits: _Optional[_Union[Limits, _Mapping]] = ..., max_limits: _Optional[_Union[Limits, _Mapping]] = ..., max_concurrency: _Optional[int] = ..., max_queue: _Optional[int] = ...) -> None: ...
