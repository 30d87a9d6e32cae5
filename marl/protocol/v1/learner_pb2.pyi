from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRunRequest(_message.Message):
    __slots__ = ("spec_yaml",)
    SPEC_YAML_FIELD_NUMBER: _ClassVar[int]
    spec_yaml: str
    def __init__(self, spec_yaml: _Optional[str] = ...) -> None: ...

class SubmitRunResponse(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("run_id", "state", "step", "total_steps", "out_dir", "error", "last_metrics_json", "created_at", "spec_yaml", "dead_lettered", "duplicate_rollouts", "alarms", "episodes", "failed_episodes", "failed_steps", "steps_done", "owner")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    OUT_DIR_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_JSON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SPEC_YAML_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    ALARMS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    FAILED_EPISODES_FIELD_NUMBER: _ClassVar[int]
    FAILED_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: str
    step: int
    total_steps: int
    out_dir: str
    error: str
    last_metrics_json: str
    created_at: float
    spec_yaml: str
    dead_lettered: int
    duplicate_rollouts: int
    alarms: _containers.RepeatedScalarFieldContainer[str]
    episodes: int
    failed_episodes: int
    failed_steps: int
    steps_done: int
    owner: str
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[str] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., out_dir: _Optional[str] = ..., error: _Optional[str] = ..., last_metrics_json: _Optional[str] = ..., created_at: _Optional[float] = ..., spec_yaml: _Optional[str] = ..., dead_lettered: _Optional[int] = ..., duplicate_rollouts: _Optional[int] = ..., alarms: _Optional[_Iterable[str]] = ..., episodes: _Optional[int] = ..., failed_episodes: _Optional[int] = ..., failed_steps: _Optional[int] = ..., steps_done: _Optional[int] = ..., owner: _Optional[str] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs", "next_page_token")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[Run]
    next_page_token: str
    def __init__(self, runs: _Optional[_Iterable[_Union[Run, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class WatchRunRequest(_message.Message):
    __slots__ = ("run_id", "from_start")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_START_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    from_start: bool
    def __init__(self, run_id: _Optional[str] = ..., from_start: _Optional[bool] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("metrics_json", "run")
    METRICS_JSON_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    metrics_json: str
    run: Run
    def __init__(self, metrics_json: _Optional[str] = ..., run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...
