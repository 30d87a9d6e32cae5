"""Hypothesis fuzzes every public RPC's request messages and the RunSpec, as a hostile client.

The whole cluster runs as real processes (inference, workflow, sandbox, learner and a
private Redis). For every public RPC, at least 500 requests are generated from the
message's descriptor (every field: wrong-sized, negative, NaN/inf or huge numbers,
huge/NUL/non-ASCII strings, unknown enum values, long repeated fields, nested messages,
plus unknown fields on the wire) and, where a field carries a document, from that
document's own domain (SubmitRun's RunSpec: a valid spec with fields set to wrong
types, out-of-range values, unknown keys, deep nesting, or YAML that is not a spec;
RunEpisode's task JSON likewise; PushAdapter: chunk streams out of order, short, with
wrong checksums). Every answer must be OK or a clear error (INVALID_ARGUMENT,
NOT_FOUND, FAILED_PRECONDITION): never UNKNOWN, INTERNAL, a timeout or a dropped
stream; no server process may die; and each server's RSS after the calls is within
max(10 %, 32 MiB) of its RSS after the first 100 (memory stays flat).

Slow (a few minutes): `make test-fuzz`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import marl
from marl.local.demo import DEMO_SPEC
from marl.local.launcher import Cluster
from marl.protocol import adapter_io
from marl.protocol.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    learner_pb2,
    learner_pb2_grpc,
    sandbox_pb2,
    workflow_pb2,
)

pytestmark = [
    pytest.mark.slow, pytest.mark.fuzz, pytest.mark.timeout(1800),
    pytest.mark.cluster(max_lora_rank=8),  # the shipped demo model, MODEL
]
EXAMPLES = int(os.environ.get("MARL_FUZZ_EXAMPLES", "500"))
WARMUP = min(100, EXAMPLES // 5)
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.FAILED_PRECONDITION}
ALLOWED_BY_RPC = {
    "Inference/PushAdapter": ALLOWED | {
        grpc.StatusCode.PERMISSION_DENIED,  # a push naming another run's adapter
        grpc.StatusCode.ABORTED,  # a fencing token the run never issued, or superseded
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # more pushes at once than the replica takes
    },
}
"""Answers an RPC may also give: adapters belong to runs, pushes carry fencing tokens."""
MODEL = str(Path(marl.__file__).parent / "assets" / "demo-model")
ADAPTER = common_pb2.AdapterRef(name="fuzz/p", version=0)
TARGETS = ["q_proj", "v_proj"]
RESULTS: dict[str, dict[str, Any]] = {}

# ------------------------------------------------------------------ generic strategies

F = FieldDescriptor
TEXT_CHARS = st.characters(exclude_categories=("Cs",))  # protobuf strings are UTF-8
NASTY_STRINGS = st.sampled_from([
    "", " ", "\x00", "a\x00b", "../../../../etc/passwd", "/etc/passwd", "/dev/zero",
    "x" * 100_000, "é" * 5000, "\U0001f600" * 1000, "[" * 5000, "{" * 5000, "%s%n%x",
    "${jndi:ldap://x}", "\n" * 1000, "Qwen/Qwen3-0.6B", "-1", "NaN", "1e309", "null",
    "fuzz/p", "fuzz/p@0", "<script>", "a" * 256,
])
TEXT = st.one_of(st.text(TEXT_CHARS, max_size=40), NASTY_STRINGS,
                 st.text(TEXT_CHARS, min_size=500, max_size=3000))
INTS = {
    F.TYPE_INT32: st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, -1, 1, 2**31 - 1])),
    F.TYPE_SINT32: st.integers(-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: st.integers(-(2**31), 2**31 - 1),
    F.TYPE_INT64: st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, -1, 2**63 - 1])),
    F.TYPE_SINT64: st.integers(-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: st.integers(-(2**63), 2**63 - 1),
    F.TYPE_UINT32: st.integers(0, 2**32 - 1),
    F.TYPE_FIXED32: st.integers(0, 2**32 - 1),
    F.TYPE_UINT64: st.integers(0, 2**64 - 1),
    F.TYPE_FIXED64: st.integers(0, 2**64 - 1),
}
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -1e-308]))


def scalar(field: FieldDescriptor, depth: int,
           overrides: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    if field.full_name in overrides:
        return overrides[field.full_name]
    t = field.type
    if t == F.TYPE_MESSAGE:
        return message_dict(field.message_type, depth + 1, overrides)
    if t in INTS:
        return INTS[t]
    if t == F.TYPE_DOUBLE:
        return FLOATS
    if t == F.TYPE_FLOAT:
        return st.floats(width=32, allow_nan=True, allow_infinity=True)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return TEXT
    if t == F.TYPE_BYTES:
        return st.binary(max_size=2000)
    if t == F.TYPE_ENUM:  # proto3 enums are open: unknown numbers reach the server
        return st.integers(-3, 40)
    raise AssertionError(f"unhandled field type {t}")


def message_dict(desc: Descriptor, depth: int = 0,
                 overrides: dict[str, st.SearchStrategy[Any]] | None = None
                 ) -> st.SearchStrategy[dict[str, Any]]:
    overrides = overrides or {}
    if depth > 3:
        return st.just({})
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in desc.fields:
        one = scalar(f, depth, overrides)
        if f.full_name in overrides:  # the override is the whole field's value
            fields[f.name] = st.one_of(st.none(), one)
        elif f.is_repeated:
            many = st.one_of(st.lists(one, max_size=4), st.lists(one, min_size=200, max_size=2000)
                             if f.type not in (F.TYPE_MESSAGE, F.TYPE_STRING) else
                             st.lists(one, max_size=30))
            fields[f.name] = st.one_of(st.none(), many)
        else:
            fields[f.name] = st.one_of(st.none(), one)
    return st.fixed_dictionaries(fields)


def build(cls: Any, values: dict[str, Any]) -> Any:
    msg = cls()
    _fill(msg, values)
    return msg


def _fill(msg: Any, values: dict[str, Any]) -> None:
    for name, value in values.items():
        if value is None:
            continue
        f = msg.DESCRIPTOR.fields_by_name[name]
        if f.is_repeated:
            target = getattr(msg, name)
            for v in value:
                if f.type == F.TYPE_MESSAGE:
                    _fill(target.add(), v)
                else:
                    target.append(v)
        elif f.type == F.TYPE_MESSAGE:
            _fill(getattr(msg, name), value)
            getattr(msg, name).SetInParent()
        else:
            setattr(msg, name, value)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


UNKNOWN_FIELDS = st.lists(st.tuples(st.integers(50, 10_000), st.integers(0, 2**64 - 1)),
                          max_size=3).map(
    lambda pairs: b"".join(_varint(num << 3) + _varint(v) for num, v in pairs))


def wire(cls: Any, overrides: dict[str, st.SearchStrategy[Any]] | None = None
         ) -> st.SearchStrategy[bytes]:
    """Serialized requests: generated fields plus unknown fields a newer client might send."""
    return st.tuples(message_dict(cls.DESCRIPTOR, 0, overrides), UNKNOWN_FIELDS).map(
        lambda t: build(cls, t[0]).SerializeToString() + t[1])


# ------------------------------------------------------------------ domain strategies

SPEC_KEYS = ["name", "workflow", "policy", "seed", "engine", "model.path", "model.dtype",
             "lora.rank", "lora.alpha", "lora.target_modules", "optim.lr", "optim.schedule",
             "grpo.group_size", "grpo.clip_low", "train.steps", "train.problems_per_step",
             "train.step_timeout_s", "sampling.temperature", "sampling.top_p",
             "sampling.max_tokens", "data.train", "data.val", "data.train_path", "out_dir",
             "reward", "caps", "unknown_field", "train.unknown", "lora", "model"]
def nest(depth: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(depth - 1):
        out = [out]
    return out


DEEP = st.integers(70, 150).map(nest)  # deeper still: the raw YAML/JSON texts below
WEIRD = st.one_of(st.none(), st.booleans(), INTS[F.TYPE_INT64], st.integers(), FLOATS, TEXT,
                  st.lists(st.one_of(st.integers(), TEXT), max_size=3),
                  st.dictionaries(st.text(max_size=5), st.integers(), max_size=3), DEEP)


def base_spec() -> dict[str, Any]:
    spec = copy.deepcopy(DEMO_SPEC)
    spec["model"] = {"path": MODEL}
    spec["train"]["steps"] = 1
    return spec


def mutate(doc: dict[str, Any], changes: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    for key, value in changes:
        node = doc
        parts = key.split(".")
        for p in parts[:-1]:
            child = node.get(p)
            if not isinstance(child, dict):
                child = node[p] = {}
            node = child
        node[parts[-1]] = value
    return doc


SPEC_YAML = st.one_of(
    st.lists(st.tuples(st.sampled_from(SPEC_KEYS), WEIRD), min_size=1, max_size=4).map(
        lambda ch: yaml.safe_dump(mutate(base_spec(), ch), allow_unicode=True)),
    TEXT,
    st.sampled_from(["- 1\n- 2", "a: [", "\t: x", "!!python/object:os.system {}", "42",
                     "a: &x [*x]", "name: " + "[" * 20_000, "? [a]\n: b", "a: !!int x",
                     "train:\n  checkpoint_interval: !!int x", "seed: !!float y",
                     "train:\n  checkpoint_interval: true", "train:\n  step_timeout_s: .nan"]),
)


def base_task() -> dict[str, Any]:
    return {
        "run_id": "fuzz-run", "step": 0, "kind": "train",
        "problem": {"id": "p1", "prompt": "What is 1 + 1?", "answer": "2", "task": "math",
                    "tests": []},
        "sample": 0, "workflow": "single", "adapters": {"generator": {"name": "fuzz/p",
                                                                      "version": 0}},
        "model_path": MODEL, "temperature": 1.0, "top_p": 1.0, "max_tokens": 4,
        "caps": {}, "seed": 0,
    }


TASK_KEYS = [*base_task().keys(), "problem.id", "problem.task", "problem.tests",
             "adapters.generator", "adapters.generator.version", "unknown"]
TASK_JSON = st.one_of(
    st.lists(st.tuples(st.sampled_from(TASK_KEYS), WEIRD), min_size=1, max_size=3).map(
        lambda ch: json.dumps(mutate(base_task(), ch), allow_nan=True)),
    TEXT,
    st.sampled_from(["[]", "null", "1", '{"a": 1}', "[" * 100_000, '{"model_path": "/etc"}']),
)


DEEP_JSON_TEXTS = st.sampled_from(["[" * 100_000 + "]" * 100_000, "[" * 100_000,
                                   '{"a":' * 100_000 + "1" + "}" * 100_000])


def push_streams(manifest: common_pb2.AdapterManifest, payload: bytes
                 ) -> st.SearchStrategy[list[bytes]]:
    """Chunk streams: manifest mutations, data out of order, short, long, checksum wrong."""
    def chunks(data_parts: list[bytes], man: Any | None, manifest_last: bool) -> list[bytes]:
        out = [inference_pb2.AdapterChunk(data=d).SerializeToString() for d in data_parts]
        if man is not None:
            m = inference_pb2.AdapterChunk(manifest=man).SerializeToString()
            out = [*out, m] if manifest_last else [m, *out]
        return out

    def mutated_manifest(values: dict[str, Any]) -> common_pb2.AdapterManifest:
        m = common_pb2.AdapterManifest()
        m.CopyFrom(manifest)
        m.ref.name = f"fuzz/push{abs(hash(json.dumps(values, default=str))) % 10**9}"
        extra = build(common_pb2.AdapterManifest, values)
        m.MergeFrom(extra)
        return m

    half = len(payload) // 2
    data = st.one_of(
        st.just([payload[half:], payload[:half]]),  # out of order
        st.just([payload[:half]]),  # short
        st.just([payload, b"x"]),  # long
        st.just([payload[:-1] + bytes([payload[-1] ^ 1])]),  # checksum mismatch
        st.lists(st.binary(max_size=4096), max_size=4),
    )
    man = st.one_of(st.none(), message_dict(common_pb2.AdapterManifest.DESCRIPTOR).map(
        mutated_manifest))
    return st.builds(chunks, data, man, st.booleans())


# ------------------------------------------------------------------ cluster and calls


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture(scope="module")
def primed(cluster: Cluster) -> Iterator[dict[str, Any]]:
    """The module's cluster once each service took one valid call, with its adapter."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    c = cluster
    endpoints = c.endpoints()
    try:
        (inference,) = endpoints["inference"]
        stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(inference))
        base = stub.GetInfo(inference_pb2.GetInfoRequest(), timeout=10).base_model
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(MODEL),
                              LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
        payload = adapter_io.serialize(dict(get_peft_model_state_dict(peft)))
        manifest = adapter_io.make_manifest(ADAPTER.name, 0, base, 4, 8.0, TARGETS, payload)
        assert stub.PushAdapter(adapter_io.chunks(manifest, payload), timeout=60).loaded
        # one valid call of each kind first: what a service loads once (the tokenizer,
        # transformers, a jail) is not memory growth
        wf = grpc.insecure_channel(address({"endpoints": endpoints}, "workflow"))
        wf.unary_unary("/marl.v1.Workflow/RunEpisode")(
            workflow_pb2.RunEpisodeRequest(task_json=json.dumps(base_task())).SerializeToString(),
            timeout=120)
        learner = learner_pb2_grpc.LearnerStub(grpc.insecure_channel(endpoints["learner"]))
        learner.SubmitRun(learner_pb2.SubmitRunRequest(spec_yaml=yaml.safe_dump(base_spec())),
                          timeout=60)
        cancel_all(learner)
        pids = {p.kind: p.proc.pid for p in c.processes}
        yield {"endpoints": endpoints, "pids": pids, "manifest": manifest, "payload": payload,
               "procs": {p.kind: p.proc for p in c.processes}}
    finally:
        for name, r in sorted(RESULTS.items()):
            print(f"fuzz {name}: {r}")


def address(primed: dict[str, Any], kind: str) -> str:
    found = primed["endpoints"][kind]
    return str(found if isinstance(found, str) else found[0])


def raw_call(channel: grpc.Channel, path: str, client_streaming: bool, server_streaming: bool,
             timeout: float) -> Callable[[Any], tuple[grpc.StatusCode, str]]:
    if client_streaming:
        fn: Any = channel.stream_unary(path)
    elif server_streaming:
        fn = channel.unary_stream(path)
    else:
        fn = channel.unary_unary(path)

    def call(request: Any) -> tuple[grpc.StatusCode, str]:
        try:
            if client_streaming:
                fn(iter(request), timeout=timeout)
            elif server_streaming:
                for _ in fn(request, timeout=timeout):
                    pass
            else:
                fn(request, timeout=timeout)
        except grpc.RpcError as err:
            return err.code(), err.details() or ""
        return grpc.StatusCode.OK, ""

    return call


def cancel_all(learner: learner_pb2_grpc.LearnerStub) -> None:
    for run in learner.ListRuns(learner_pb2.ListRunsRequest(), timeout=30).runs:
        if run.state in ("QUEUED", "RUNNING"):
            learner.CancelRun(learner_pb2.CancelRunRequest(run_id=run.run_id), timeout=30)


GENERATE_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "marl.v1.GenerateRequest.adapter": st.one_of(
        st.just({"name": ADAPTER.name, "version": 0}),
        message_dict(common_pb2.AdapterRef.DESCRIPTOR)),
    "marl.v1.GenerateRequest.sampling": st.one_of(
        st.fixed_dictionaries({  # in range: these must be served (OK)
            "max_tokens": st.integers(1, 8), "temperature": st.floats(0, 2),
            "top_p": st.floats(0, 1), "seed": st.integers(0, 1000),
            "stop_token_ids": st.lists(st.integers(0, 218), max_size=3)}),
        message_dict(inference_pb2.SamplingParams.DESCRIPTOR)),
    "marl.v1.GenerateRequest.prompt_token_ids": st.one_of(
        st.lists(st.integers(0, 218), max_size=20),
        st.lists(INTS[F.TYPE_INT32], max_size=20),
        st.lists(st.integers(0, 218), min_size=1000, max_size=1100)),
}

RPCS: dict[str, tuple[str, Any, float]] = {
    # name: (service kind, request strategy factory, client deadline)
    "Inference/Generate": ("inference", lambda c: wire(inference_pb2.GenerateRequest,
                                                       GENERATE_FIELDS), 120.0),
    "Inference/GenerateMany": ("inference", lambda c: wire(inference_pb2.GenerateManyRequest, {
        "marl.v1.GenerateManyRequest.requests": st.lists(
            message_dict(inference_pb2.GenerateRequest.DESCRIPTOR, 0, GENERATE_FIELDS),
            max_size=6)}), 120.0),
    "Inference/PushAdapter": ("inference", lambda c: push_streams(c["manifest"], c["payload"]),
                              60.0),
    "Inference/ListAdapters": ("inference", lambda c: wire(inference_pb2.ListAdaptersRequest),
                               30.0),
    "Inference/UnloadAdapter": ("inference", lambda c: wire(inference_pb2.UnloadAdapterRequest, {
        "marl.v1.UnloadAdapterRequest.ref": message_dict(common_pb2.AdapterRef.DESCRIPTOR).filter(
            lambda d: d.get("name") != ADAPTER.name)}), 30.0),
    "Inference/GetInfo": ("inference", lambda c: wire(inference_pb2.GetInfoRequest), 30.0),
    "Learner/SubmitRun": ("learner", lambda c: wire(learner_pb2.SubmitRunRequest, {
        "marl.v1.SubmitRunRequest.spec_yaml": SPEC_YAML}), 60.0),
    "Learner/GetRun": ("learner", lambda c: wire(learner_pb2.GetRunRequest), 30.0),
    "Learner/ListRuns": ("learner", lambda c: wire(learner_pb2.ListRunsRequest), 30.0),
    "Learner/CancelRun": ("learner", lambda c: wire(learner_pb2.CancelRunRequest), 30.0),
    "Learner/WatchRun": ("learner", lambda c: wire(learner_pb2.WatchRunRequest), 30.0),
    "Sandbox/Execute": ("sandbox", lambda c: wire(sandbox_pb2.ExecuteRequest, {
        "marl.v1.ExecuteRequest.code": st.one_of(
            TEXT, st.sampled_from(["print(input())", "def f(x):\n    return x", "1/0",
                                   "import sys; sys.exit(3)", "x = 1"])),
        "marl.v1.FunctionCallTest.args_json": st.one_of(TEXT, DEEP_JSON_TEXTS),
        "marl.v1.FunctionCallTest.expected_json": st.one_of(TEXT, DEEP_JSON_TEXTS)}), 180.0),
    "Sandbox/Info": ("sandbox", lambda c: wire(sandbox_pb2.InfoRequest), 30.0),
    "Workflow/RunEpisode": ("workflow", lambda c: wire(workflow_pb2.RunEpisodeRequest, {
        "marl.v1.RunEpisodeRequest.task_json": TASK_JSON}), 120.0),
    "Workflow/GetStats": ("workflow", lambda c: wire(workflow_pb2.GetStatsRequest), 30.0),
}


def test_every_public_rpc_is_fuzzed() -> None:
    from marl.protocol.v1 import learner_pb2 as lp

    names = {f"{s}/{m.name}" for mod, s in [(inference_pb2, "Inference"), (lp, "Learner"),
                                            (sandbox_pb2, "Sandbox"), (workflow_pb2, "Workflow")]
             for m in mod.DESCRIPTOR.services_by_name[s].methods}
    assert names == set(RPCS)


@pytest.mark.parametrize("rpc", list(RPCS))
def test_fuzz_rpc(primed: dict[str, Any], rpc: str) -> None:
    kind, strategy, timeout = RPCS[rpc]
    service, method = rpc.split("/")
    desc = {"Inference": inference_pb2, "Learner": learner_pb2, "Sandbox": sandbox_pb2,
            "Workflow": workflow_pb2}[service].DESCRIPTOR.services_by_name[service]
    m = desc.methods_by_name[method]
    pid = primed["pids"][kind]
    bad: list[str] = []
    codes: dict[str, int] = {}
    state = {"n": 0, "baseline": 0, "slowest": 0.0}
    channel = grpc.insecure_channel(address(primed, kind), options=[
        ("grpc.max_send_message_length", 256 << 20),
        ("grpc.max_receive_message_length", 256 << 20)])
    call = raw_call(channel, f"/{desc.full_name}/{method}", m.client_streaming,
                    m.server_streaming, timeout)
    learner = learner_pb2_grpc.LearnerStub(channel) if kind == "learner" else None

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=["generate"])
    @given(strategy(primed))
    def one(request: Any) -> None:
        started = time.monotonic()
        code, details = call(request)
        state["slowest"] = max(state["slowest"], time.monotonic() - started)
        state["n"] += 1
        codes[code.name] = codes.get(code.name, 0) + 1
        if code not in ALLOWED_BY_RPC.get(rpc, ALLOWED):
            shown = request if isinstance(request, bytes) else b"".join(request)
            bad.append(f"{code.name}: {details[:300]!r} for {shown[:200]!r}")
        if rpc == "Learner/SubmitRun" and code == grpc.StatusCode.OK and learner is not None:
            cancel_all(learner)  # a spec that happens to be valid must not train for long
        if state["n"] == WARMUP:
            state["baseline"] = rss_kib(pid)

    one()
    end = rss_kib(pid)
    RESULTS[rpc] = {"calls": state["n"], "codes": codes, "rss_kib_after_warmup":
                    state["baseline"], "rss_kib_end": end,
                    "slowest_s": round(state["slowest"], 2)}
    channel.close()
    assert state["n"] >= EXAMPLES, f"only {state['n']} inputs"
    assert not bad, f"{len(bad)} unclear answers, e.g.:\n" + "\n".join(bad[:8])
    for k, proc in primed["procs"].items():
        assert proc.poll() is None, f"{k} died during {rpc}"
    with grpc.insecure_channel(address(primed, kind)) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    growth = end - state["baseline"]
    assert growth <= max(state["baseline"] // 10, 32 * 1024), (
        f"{kind} RSS grew {growth} KiB during {rpc} (from {state['baseline']} KiB)")


def _deep_call(args_json: str) -> sandbox_pb2.ExecuteRequest:
    return sandbox_pb2.ExecuteRequest(code="def f(x):\n    return x", tests=[sandbox_pb2.Test(
        function_call=sandbox_pb2.FunctionCallTest(fn_name="f", args_json=args_json,
                                                   expected_json="1"))])


STRICT_INPUTS: list[tuple[str, str, Any, str]] = [
    # (rpc, what, request, what the error must name)
    ("Learner/SubmitRun", "YAML tag with a bad value", learner_pb2.SubmitRunRequest(
        spec_yaml="a: !!int x"), "field `a`: 'x' is not a valid !!int value"),
    ("Learner/SubmitRun", "bad tagged value in a real field", learner_pb2.SubmitRunRequest(
        spec_yaml="train:\n  checkpoint_interval: !!int x"),
     "field `train.checkpoint_interval`"),
    ("Learner/SubmitRun", "boolean for an integer", learner_pb2.SubmitRunRequest(
        spec_yaml=yaml.safe_dump(mutate(base_spec(), [("train.checkpoint_interval", True)]))),
     "field `train.checkpoint_interval`: Value error, must be a number, not a boolean"),
    ("Learner/SubmitRun", "NaN for a bound", learner_pb2.SubmitRunRequest(
        spec_yaml=yaml.safe_dump(mutate(base_spec(), [("train.step_timeout_s", math.nan)]))),
     "field `train.step_timeout_s`: Input should be a finite number"),
    ("Sandbox/Execute", "100,000-deep JSON array", _deep_call("[" * 100_000 + "]" * 100_000),
     "tests[0].function_call.args_json: nested more than 100 lists/objects deep"),
    ("Sandbox/Execute", "100,000-deep JSON object",
     _deep_call('{"a":' * 100_000 + "1" + "}" * 100_000),
     "tests[0].function_call.args_json: nested more than 100 lists/objects deep"),
    ("Sandbox/Execute", "NaN timeout", sandbox_pb2.ExecuteRequest(
        code="x = 1", tests=[sandbox_pb2.Test(stdio=sandbox_pb2.StdioTest())],
        limits=sandbox_pb2.Limits(timeout_seconds=math.nan)),
     "limits.timeout_seconds: must be a finite number"),
]


@pytest.mark.parametrize(("rpc", "what", "request_msg", "named"), STRICT_INPUTS,
                         ids=[s[1] for s in STRICT_INPUTS])
def test_strict_inputs_are_invalid_argument(primed: dict[str, Any], rpc: str, what: str,
                                            request_msg: Any, named: str) -> None:
    """The inputs that once got UNKNOWN or were accepted: each is INVALID_ARGUMENT naming
    the field (and the limit)."""
    kind = {"Learner": "learner", "Sandbox": "sandbox"}[rpc.split("/")[0]]
    service = {"Learner": "marl.v1.Learner", "Sandbox": "marl.v1.Sandbox"}[rpc.split("/")[0]]
    with grpc.insecure_channel(address(primed, kind)) as channel:
        call = raw_call(channel, f"/{service}/{rpc.split('/')[1]}", False, False, 60.0)
        code, details = call(request_msg.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, details)
    assert named in details, (what, details)
