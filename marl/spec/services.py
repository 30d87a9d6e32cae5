"""Each service's settings: one pydantic model per service, from YAML and `MARL_*` variables.

`marl serve X --config FILE` and the Helm chart both go through here, so a
chart's `<service>.config` values are these fields one to one (the chart's
`values.schema.json` carries the same names and bounds, and a test holds the
two together). Precedence, lowest first: the field's default, the YAML file,
the environment (`MARL_<SERVICE>_<FIELD>`, e.g. `MARL_SANDBOX_MAX_CONCURRENCY`),
then command-line flags (`add_flags`: one `--field-name` per field, made from the
model, so a field's default, bounds and help are written here only). The environment layer exists so a Kubernetes Secret
can supply a Redis URL that carries a password without it ever landing in a
ConfigMap. Only variables that name a field are read: `MARL_SANDBOX_SABOTAGE`
and other switches stay theirs.

A bad value is a `ValueError` that names the field and where it came from.
Nothing here imports torch or grpc: validating a config must stay cheap.
"""

from __future__ import annotations

import argparse
import os
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic.fields import FieldInfo

from marl.spec.run import EngineName
from marl.spec.users import USERS_FILE_ENV, Identity, read_token_file, valid_token

MiB = 1 << 20

ServiceName = Literal["inference", "workflow", "learner", "sandbox"]
SERVICES: tuple[ServiceName, ...] = get_args(ServiceName)

LEARNER_PORT = 50051
"""The Runs API's port where nothing else names one: the chart's, and a client's default."""
LOCAL_LEARNER = f"127.0.0.1:{LEARNER_PORT}"
"""Where a client looks for the learner when nothing names it."""
SANDBOX_TEST_TIMEOUT_S = 5.0
"""A sandbox's per-test wall-clock limit when a request sets none."""


class _ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """Interface the gRPC server binds; 0.0.0.0 inside a container."""
    port: int = Field(default=0, ge=0, le=65535)
    """gRPC port; 0 picks a free one (the address is printed)."""
    trace_dir: str | None = None
    """Directory this process appends its trace spans to, as `<service>-<pid>.jsonl`
    (steps, episodes, decode steps; `marl trace DIR` splits each step's time and merges the
    files for Perfetto); none when unset. In the chart, a path under /tmp."""


class _RedisConfig(_ServiceConfig):
    redis: str = ""
    """Redis URL (redis://[:password@]host:port/db); required by this service."""


def _comma_list(value: Any) -> Any:
    """A list setting given as one string (a flag, a `MARL_*` variable): split at commas."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


ModulePrefix = Annotated[str, Field(pattern=r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$", max_length=200)]
PathList = Annotated[list[Annotated[str, Field(min_length=1, max_length=4096)]],
                     BeforeValidator(_comma_list), Field(max_length=64)]
URLList = Annotated[
    list[Annotated[str, Field(pattern=r"^https?://[^\s/]+(/\S*)?$", max_length=2048)]],
    BeforeValidator(_comma_list), Field(max_length=64)]


class _RunsCodeConfig(_RedisConfig):
    """What the learner and the workers let a run spec name: the same two settings, so a
    name the learner accepts is one the workers run (each checks with its own)."""

    allowed_modules: Annotated[list[ModulePrefix], BeforeValidator(_comma_list),
                               Field(max_length=1024)] = Field(default_factory=list)
    """Module prefixes (`mylab`, `mylab.rewards`) whose `module:NAME` a run spec may name as
    its `workflow` or `reward.function`, beside marl's built-ins and the entry points of
    installed packages (groups `marl.workflows`, `marl.rewards`, `marl.tools`); a prefix
    allows its submodules. Empty: installed code only. Comma-separated in a flag or a
    variable. `marl demo` and `marl up` allow the modules of the directory they start in."""
    judge_endpoints: URLList = Field(default_factory=list)
    """OpenAI-compatible base URLs (`http://host:port/v1`) a run's `reward.judge.endpoint`
    may name; the workers send the judge's API key (`MARL_JUDGE_KEY_*`) there. Empty: a
    judge is the run's own inference only. Comma-separated in a flag or a variable."""


class InferenceConfig(_RedisConfig):
    """`marl serve inference`: one replica of the multi-LoRA generation server."""

    model: str | None = None
    """Local directory of the base model (weights + tokenizer); nothing is downloaded."""
    engine: EngineName = "auto"
    """Generation engine; `auto` takes vLLM when it is installed."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Dtype the engine loads the base model in (`auto`: as `model.dtype` says)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """transformers engine: where the model runs (`auto`: the first GPU when torch sees
    one). vLLM places itself."""
    retention: int = Field(default=2, ge=1, le=64)
    """Versions of each adapter kept loaded; older ones are unloaded once no request uses them.
    A run's pushes may ask for more (`train.max_staleness` + 1)."""
    max_lora_rank: int = Field(default=64, ge=1, le=1024)
    """Largest adapter rank this replica accepts (vLLM sizes its LoRA buffers by it)."""
    max_concurrent_pushes: int = Field(default=16, ge=1, le=4096)
    """Adapter pushes this replica buffers at once; one more is refused RESOURCE_EXHAUSTED
    (a learner pushes it again shortly). Learners push each adapter of each run at once."""
    max_push_bytes: int = Field(default=4096 * MiB, ge=MiB, le=1 << 40)
    """Bytes the pushes this replica buffers at once may declare together (each is held
    whole before it loads); one past it is refused RESOURCE_EXHAUSTED, and a single push
    larger than it FAILED_PRECONDITION."""
    http_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the HTTP front end (OpenAI-compatible /v1, Prometheus /metrics); 0 picks a free
    one; none when unset."""
    max_loras: int = Field(default=4, ge=1, le=256)
    """vLLM: adapter versions that can share one batch. A run may have its adapter count
    (one under Shared-Policy, one per role type under Isolated-Policy) times
    `train.max_staleness` + 1 in flight (`marl.workflows.routing.adapter_versions_in_flight`);
    size this for the runs served at once. Clusters `marl demo` and `marl matrix` start are
    sized so; a learner logs a warning naming a replica with fewer."""
    max_model_len: int | None = Field(default=None, ge=16)
    """vLLM: longest prompt plus response a request may have (default: the model's)."""
    max_num_seqs: int = Field(default=256, ge=1, le=65_536)
    """vLLM: sequences decoded together in one batch."""
    gpu_memory_utilization: float = Field(default=0.8, gt=0, le=0.99)
    """vLLM: share of the GPU's memory vLLM takes for weights, activations and KV cache.
    On a GPU the learner shares, leave the learner what it needs (e.g. 0.4)."""
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    """vLLM: GPUs one replica spans."""
    enforce_eager: bool = False
    """vLLM: run without CUDA graphs (less memory and a faster start, slower decoding)."""

    def model_dir(self) -> str:
        """`model`, which an engine needs: a ValueError naming the field when it is unset."""
        if not self.model:
            raise ValueError("model: the base model's directory is required (--model DIR)")
        return self.model

    def vllm_options(self) -> dict[str, Any]:
        """The settings only the vLLM engine reads, as its keyword arguments."""
        return {
            "max_loras": self.max_loras,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "tensor_parallel_size": self.tensor_parallel_size,
            "enforce_eager": self.enforce_eager,
        }


class WorkflowConfig(_RunsCodeConfig):
    """`marl serve workflow`: a worker that runs episodes from the tasks stream."""

    sandbox: str | None = None
    """Sandbox address (host:port) for code rewards; math needs none."""
    concurrency: int = Field(default=512, ge=1, le=100_000)
    """Episodes this worker runs at once."""
    http_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the HTTP server (Prometheus /metrics); 0 picks a free one; none when unset."""
    heartbeat_ttl_s: float = Field(default=5.0, ge=0.5, le=600)
    """Life of the worker's liveness key (renewed every second or so): this long after a
    worker dies, its tasks are claimed by another."""
    claim_idle_s: float = Field(default=120.0, ge=1, le=86_400)
    """A task untouched this long is claimed even from a live worker (one that hangs)."""
    max_deliveries: int = Field(default=5, ge=1, le=1000)
    """Deliveries of one task before it goes to the dead-letter stream."""
    drain_s: float = Field(default=20.0, ge=0, le=3600)
    """On SIGTERM the worker takes no new task and lets its episodes under way finish for
    up to this long; what is left is handed back to the other workers at once. Keep it
    below the pod's terminationGracePeriodSeconds."""
    replica_wait_s: float = Field(default=100.0, ge=0, le=3600)
    """A turn that no inference replica takes (every one the worker knows is down, stopping
    or joining, or none is registered) reads the registry again every half second for this
    long before its episode fails: the only replica restarting (a crash, a rolling update)
    then holds episodes up instead of failing them. Keep it below `claim_idle_s`: a task
    held longer is taken by another worker too (the learner keeps the first rollout). The
    learner waits up to 300 s for a replica to take its adapters. 0: one fresh read, then
    the episode fails."""

    @model_validator(mode="after")
    def _wait_below_claim(self) -> WorkflowConfig:
        if self.replica_wait_s >= self.claim_idle_s:
            raise ValueError(
                f"replica_wait_s ({self.replica_wait_s:g}) must be below claim_idle_s "
                f"({self.claim_idle_s:g}): a task held waiting for a replica that long is "
                "claimed by another worker too; lower replica_wait_s or raise claim_idle_s"
            )
        return self


class LearnerConfig(_RunsCodeConfig):
    """`marl serve learner`: the Runs API and the training step loop."""

    runs_dir: str = "runs"
    """Where run directories (metrics, checkpoints, report) are written: a run without
    `out_dir` writes to `<runs_dir>/<run id>`."""
    out_dir_roots: PathList = Field(default_factory=list)
    """Directories, beside `runs_dir`, under which a run spec's `out_dir` may lie (never in
    another run's directory). Empty: under `runs_dir` only. Comma-separated in a flag or a
    variable."""
    model_roots: PathList = Field(default_factory=list)
    """Directories under which a run spec's `model.path` may lie; model names (`demo`,
    `smollm2`) are always accepted. Empty: model names only. In the chart, where the
    models volume is mounted."""
    data_roots: PathList = Field(default_factory=list)
    """Directories under which a run spec's `data.train_path` and `data.val_path` may lie.
    Empty: the bundled data sets only."""
    max_spec_bytes: int = Field(default=1 * MiB, ge=1024, le=64 * MiB)
    """Largest run spec SubmitRun accepts (its YAML, in bytes)."""
    max_queued_tasks: int = Field(default=4096, ge=1, le=1_000_000)
    """Tasks waiting in (or held from) the tasks stream past which a step adds no more
    until workers catch up: the bound on queued work."""
    burst_threads: int = Field(default=0, ge=0, le=1024)
    """Runs with `train.max_staleness` >= 1, on a machine the learner shares with inference:
    torch threads an update may take once every rollout queued ahead is in (the cores
    generation then leaves idle). 0: the learner's own threads (OMP_NUM_THREADS) throughout;
    leave it so where the learner has cores of its own (a pod with a CPU limit)."""
    warm_policy_processes: int = Field(default=0, ge=0, le=64)
    """Policy processes started with the learner, torch and the model code imported, for
    runs with `learner.policy_process: own` (one-process learners): such a run takes an
    idle one (or starts one), and once it ends the process drops its policy and waits for
    the next run's; at most this many wait. Each idle one holds the memory of those
    imports. 0: every such run starts a process of its own, which ends with it."""
    max_concurrent_runs: int = Field(default=1, ge=1, le=64)
    """Runs this learner process trains at once, each with its own adapters, optimizers and
    step loop, their torch work taking turns on the process's one torch thread. Inference
    replicas and workers serve every run's tasks; raise it so they work while a run updates."""
    http_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the HTTP server (Prometheus /metrics); 0 picks a free one; none when unset."""
    retention_s: float = Field(default=7 * 24 * 3600, ge=0, allow_inf_nan=False)
    """A finished run's Redis state (its record, metrics stream, rollouts stream) expires
    this long after the run ends, and the run leaves `marl runs`; its directory on disk
    stays. 0: kept for good (Redis memory then grows with every run)."""
    drain_s: float = Field(default=100.0, ge=0, le=3600)
    """On SIGTERM each run abandons the step whose rollouts it is gathering (or finishes
    the update under way), checkpoints the steps done and is left to the next learner;
    the process waits up to this long for that, then exits within ~10 s more. Keep it
    below the pod's terminationGracePeriodSeconds (the chart gives it this plus 20 s)."""


class SandboxConfig(_ServiceConfig):
    """`marl serve sandbox`: runs untrusted code against tests under the strongest tier it can."""

    http_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the HTTP front end (SandboxFusion-compatible POST /run_code, Prometheus /metrics);
    0 picks a free one; none when unset."""
    isolation: Literal["auto", "namespaces", "seccomp", "rlimits"] = "auto"
    """Strongest tier to try; `auto` takes the strongest the kernel allows, and refuses to
    start where that is below `seccomp` (set `rlimits` to run with no seccomp filter)."""
    max_concurrency: int = Field(default_factory=lambda: max(1, os.cpu_count() or 1), ge=1, le=256)
    """Jobs executing at once (default: the CPU count)."""
    warm_jails: int = Field(default=2, ge=1, le=64)
    """Jails the zygote keeps built and waiting, so a job does not wait for one."""
    max_queue: int = Field(default=32, ge=0, le=10_000)
    """Jobs waiting for a slot; past this the server answers RESOURCE_EXHAUSTED."""
    default_timeout_seconds: float = Field(default=SANDBOX_TEST_TIMEOUT_S, gt=0, le=600)
    """Per-test wall-clock limit when a request sets none."""
    max_timeout_seconds: float = Field(default=60.0, gt=0, le=3600)
    """Largest per-test limit a request may ask for."""
    default_memory_bytes: int = Field(default=512 * MiB, ge=16 * MiB)
    """Address space a candidate may add to the interpreter's, when a request sets none."""
    max_memory_bytes: int = Field(default=4096 * MiB, ge=16 * MiB)
    """Largest memory limit a request may ask for."""
    default_output_bytes: int = Field(default=1 * MiB, ge=1024)
    """Stdout (and stderr) a test may print, when a request sets none."""
    max_output_bytes: int = Field(default=16 * MiB, ge=1024)
    """Largest output limit a request may ask for."""
    file_bytes: int = Field(default=16 * MiB, ge=MiB)
    """Largest file a candidate may write (RLIMIT_FSIZE)."""
    tmp_bytes: int = Field(default=64 * MiB, ge=MiB)
    """Size of the private /tmp in the namespaces tier."""
    tmp_inodes: int = Field(default=2048, ge=64)
    """Files and directories the private /tmp may hold in the namespaces tier."""
    max_processes: int = Field(default=32, ge=4, le=4096)
    """Tasks (mostly threads) per job in the namespaces tier (RLIMIT_NPROC)."""
    max_tests: int = Field(default=1000, ge=1, le=100_000)
    """Tests one request may carry."""
    max_code_bytes: int = Field(default=1 * MiB, ge=1024)
    """Largest code or assert program."""
    response_output_bytes: int = Field(default=4096, ge=0, le=16 * MiB)
    """Stdout/stderr characters returned per test (the comparison uses all of it)."""
    scratch_root: str | None = None
    """Parent of per-job scratch directories below the namespaces tier (default: a temp dir)."""
    job_overhead_seconds: float = Field(default=5.0, gt=0, le=600)
    """Time a job may take on top of its tests' timeouts before it is killed."""


MODELS: dict[ServiceName, type[_ServiceConfig]] = {
    "inference": InferenceConfig,
    "workflow": WorkflowConfig,
    "learner": LearnerConfig,
    "sandbox": SandboxConfig,
}


def env_name(service: ServiceName, field: str) -> str:
    """The variable that sets `field` of `service`, e.g. MARL_WORKFLOW_CONCURRENCY."""
    return f"MARL_{service}_{field}".upper()


def _flag_kind(annotation: Any) -> tuple[type, list[Any] | None]:
    """A field's type as argparse reads it, and its choices (a `Literal`'s values)."""
    if get_origin(annotation) in (Union, types.UnionType):  # `int | None`: a flag sets the int
        (annotation,) = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) is Literal:
        choices = list(get_args(annotation))
        return type(choices[0]), choices
    if get_origin(annotation) is list:  # comma-separated (the model splits it)
        return str, None
    assert annotation in (str, int, float, bool), f"no flag for a field of type {annotation}"
    return annotation, None


def _flag_help(info: FieldInfo) -> str:
    text = " ".join((info.description or "").split())
    if info.default_factory is None and info.default not in (None, ""):
        text += f" (default: {info.default})"
    return text.replace("%", "%%")  # argparse formats help with %


def add_flags(parser: argparse.ArgumentParser, service: ServiceName) -> None:
    """`--field-name` for every field of the service's model: its type, choices and help
    (the field's docstring and default) are the model's. Every flag defaults to None, so a
    flag not given leaves the value to the file, the environment or the model."""
    for name, info in MODELS[service].model_fields.items():
        kind, choices = _flag_kind(info.annotation)
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, dest=name, default=None, help=_flag_help(info),
                                action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(flag, dest=name, default=None, help=_flag_help(info),
                                type=kind, choices=choices)


def flag_values(args: argparse.Namespace, service: ServiceName) -> dict[str, Any]:
    """The fields `add_flags` parsed, as `load_service_config`'s overrides (None: not given)."""
    return {name: getattr(args, name) for name in MODELS[service].model_fields}


def read_yaml(path: str) -> dict[str, Any]:
    """A config file's mapping; `--config` problems are named as such."""
    from marl.spec.safe_input import load_yaml, read_text

    data = load_yaml(read_text(path, "--config"), f"--config: {path[:200]}") or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a mapping of settings")
    return data


def from_env(service: ServiceName, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The fields the environment sets, as strings (pydantic converts them)."""
    env = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for field in MODELS[service].model_fields:
        value = env.get(env_name(service, field))
        if value is not None:
            out[field] = value
    return out


def load_service_config(
    service: ServiceName,
    path: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Any:
    """Defaults < YAML file < `MARL_<SERVICE>_*` variables < `overrides` (None entries skipped).

    Returns the service's model (typed `Any` so callers get their concrete class
    without a cast; `load_inference` etc. below are the typed doors).
    """
    layers: list[tuple[str, dict[str, Any]]] = []
    if path is not None:
        layers.append((f"in {path}", read_yaml(path)))
    layers.append(("from the environment", dict(from_env(service, environ))))
    layers.append(
        ("on the command line", {k: v for k, v in (overrides or {}).items() if v is not None})
    )
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}
    for where, values in layers:
        merged.update(values)
        source.update(dict.fromkeys(values, where))
    # the deployment-wide settings too: a bad one stops `marl serve` here
    if service == "sandbox":
        sandbox_holds_no_service_token(environ)
    else:
        auth_token(environ)
        auth_users(environ)
    if service in ("sandbox", "workflow"):
        own = sandbox_token(environ)
        if own is not None and own == auth_token(environ):
            raise ValueError(f"{SANDBOX_TOKEN_ENV}: the sandbox's token is the services' "
                             f"({AUTH_TOKEN_ENV}); give the sandbox a token of its own")
    tls_files(environ)
    try:
        return MODELS[service](**merged)
    except ValidationError as e:
        err = e.errors()[0]
        if not err["loc"]:  # a check across fields: its message names them
            raise ValueError(str(err.get("ctx", {}).get("error", err["msg"]))) from None
        field = ".".join(str(p) for p in err["loc"])
        where = source.get(str(err["loc"][0]), "")
        if where == "from the environment":
            where = f"from {env_name(service, str(err['loc'][0]))}"
        raise ValueError(
            f"{field}: {err['msg']} ({where})" if where else f"{field}: {err['msg']}"
        ) from None


def load_inference(path: str | None = None, **overrides: Any) -> InferenceConfig:
    cfg: InferenceConfig = load_service_config("inference", path, overrides)
    return cfg


def load_workflow(path: str | None = None, **overrides: Any) -> WorkflowConfig:
    cfg: WorkflowConfig = load_service_config("workflow", path, overrides)
    return cfg


def load_sandbox(path: str | None = None, **overrides: Any) -> SandboxConfig:
    cfg: SandboxConfig = load_service_config("sandbox", path, overrides)
    return cfg


AUTH_TOKEN_ENV = "MARL_AUTH_TOKEN"
AUTH_TOKEN_FILE_ENV = "MARL_AUTH_TOKEN_FILE"


def auth_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The shared-secret token every service requires and every client sends, or None (off).

    Shared by all services and clients of one deployment, so it is not a per-service field:
    `$MARL_AUTH_TOKEN`, else the content (whitespace stripped) of the file
    `$MARL_AUTH_TOKEN_FILE` names (a mounted Kubernetes Secret). A set but unusable value
    is a ValueError naming the variable. The sandbox never holds it (`sandbox_token`).
    """
    return _token(AUTH_TOKEN_ENV, AUTH_TOKEN_FILE_ENV, environ)


SANDBOX_TOKEN_ENV = "MARL_SANDBOX_TOKEN"
SANDBOX_TOKEN_FILE_ENV = "MARL_SANDBOX_TOKEN_FILE"


def sandbox_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The reward sandbox's own token, or None (its authentication off): the only one it
    accepts, held by it and by its clients (the workflow workers, `marl sandbox run`),
    never by the other services. Code a job runs may reach what the sandbox's process
    holds; with this token it can call the sandbox and nothing else.

    `$MARL_SANDBOX_TOKEN`, else the content of the file `$MARL_SANDBOX_TOKEN_FILE` names,
    checked as `auth_token` is."""
    return _token(SANDBOX_TOKEN_ENV, SANDBOX_TOKEN_FILE_ENV, environ)


def sandbox_holds_no_service_token(environ: Mapping[str, str] | None = None) -> None:
    """ValueError naming the variable when the sandbox's environment holds the services'
    token or the users' file, or reuses the services' token as its own: whatever the
    sandbox holds, code that escapes a job may read."""
    env = os.environ if environ is None else environ
    for name in (AUTH_TOKEN_ENV, AUTH_TOKEN_FILE_ENV, USERS_FILE_ENV):
        if env.get(name):
            raise ValueError(
                f"{name}: the sandbox must not hold the services' token or users' tokens "
                "(code its jobs run could read them); unset it in the sandbox's environment "
                f"and give the sandbox a token of its own in {SANDBOX_TOKEN_ENV} (or "
                f"{SANDBOX_TOKEN_FILE_ENV}), held by its clients too")


def _token(var: str, file_var: str, environ: Mapping[str, str] | None) -> str | None:
    env = os.environ if environ is None else environ
    value = env.get(var) or None  # set but empty: off, as when unset
    where = var
    if value is None and env.get(file_var):
        path = env[file_var]
        where = f"{file_var} ({path[:200]})"
        try:
            value = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, ValueError) as e:
            reason = getattr(e, "strerror", None) or "not a readable UTF-8 file"
            raise ValueError(f"{file_var}: cannot read the token file: {reason}") from None
    if value is None:
        return None
    if not valid_token(value):
        raise ValueError(f"{where}: the token must be 1-4096 printable characters without "
                         "spaces; unset it to turn authentication off")
    return value


def auth_users_file(environ: Mapping[str, str] | None = None) -> str | None:
    """The users' token file `$MARL_AUTH_TOKENS_FILE` names (`marl.spec.users`), or None."""
    env = os.environ if environ is None else environ
    return env.get(USERS_FILE_ENV) or None


def auth_users(environ: Mapping[str, str] | None = None) -> dict[str, Identity]:
    """Token -> user, from the users' token file as it is now ({} without one). Users need
    the service token set too (the services talk to each other with it); a file that
    cannot be read or parsed, or that lists the service token, is a ValueError naming
    the variable."""
    path = auth_users_file(environ)
    if path is None:
        return {}
    service = auth_token(environ)
    if service is None:
        raise ValueError(f"{USERS_FILE_ENV}: users need the services' own token too: set "
                         f"{AUTH_TOKEN_ENV} (or {AUTH_TOKEN_FILE_ENV}) in every service")
    users = read_token_file(path)
    if service in users:
        raise ValueError(f"{USERS_FILE_ENV} ({path[:200]}): user {users[service].user[:60]!r} "
                         f"has the services' token ({AUTH_TOKEN_ENV}); give it one of its own")
    return users


TLS_CERT_ENV = "MARL_TLS_CERT"
TLS_KEY_ENV = "MARL_TLS_KEY"
TLS_CA_ENV = "MARL_TLS_CA"


def tls_files(environ: Mapping[str, str] | None = None) -> dict[str, bytes]:
    """Optional TLS, PEM files named by the environment: `cert` + `key` make every server
    (gRPC and HTTP) serve TLS only; `ca` makes every client verify servers against it.

    Returns the keys that are set, read; a file that cannot be read, or a certificate
    without its key, is a ValueError naming the variable.
    """
    env = os.environ if environ is None else environ
    out: dict[str, bytes] = {}
    for key, name in (("cert", TLS_CERT_ENV), ("key", TLS_KEY_ENV), ("ca", TLS_CA_ENV)):
        path = env.get(name)
        if not path:
            continue
        try:
            out[key] = Path(path).read_bytes()
        except OSError as e:
            raise ValueError(f"{name}: cannot read {path[:200]}: {e.strerror}") from None
    if ("cert" in out) != ("key" in out):
        raise ValueError(f"{TLS_CERT_ENV} and {TLS_KEY_ENV}: set both (a server needs its "
                         "certificate and its key) or neither")
    return out
