"""`marl report` on a run directory written here from real Rollout objects and metric records."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from marl.cli.main import main
from marl.monitor.report import write_report
from marl.rollout import AdapterRef, Rollout, Turn

REF = AdapterRef("t/shared", 0)
PLOTS = {
    "reward_accuracy.png",
    "role_dynamics.png",
    "grad_share.png",
    "role_lengths.png",
    "role_signatures.png",
}


def _episode(step: int, problem: int, aggregator_len: int) -> Rollout:
    turns = [
        Turn(
            "generator",
            s,
            [1, 2],
            [10 + s, 11, 12, 13] * 5,
            [-0.1] * 20,
            "stop",
            REF,
            f"<think>step {step}</think> generator {s}: so \\boxed{{{problem}}}",
        )
        for s in range(3)
    ]
    text = f"aggregator at step {step} picks \\boxed{{{problem}}}"
    turns.append(
        Turn("aggregator", 0, [3], [7] * aggregator_len, [-0.2] * aggregator_len, "stop", REF, text)
    )
    return Rollout(
        f"t:train:{step}:p{problem}:0", "t", step, "train", f"p{problem}", 0, turns, text, 1.0
    )


def make_run(path: Path) -> None:
    path.mkdir()
    (path / "run.yaml").write_text(yaml.safe_dump({"name": "t", "workflow": "voting"}))
    (path / "rollouts").mkdir()
    val = {0: 0.2, 3: 0.6, 6: 0.4}
    lines = []
    for step in range(7):
        rec: dict[str, object] = {"step": step, "alarms": []}
        if step in val:
            rec["val/accuracy"] = val[step]
        if step > 0:
            rec["train/reward_mean"] = 0.1 * step
            rec["train/accuracy"] = 0.1 * step
            for role, chi2 in (("generator", 0.01 * step), ("aggregator", 0.01)):
                rec[f"role/{role}/chi2_token"] = chi2
                rec[f"role/{role}/training_ppl"] = 1.5
                rec[f"role/{role}/grad_norm"] = 0.3
                rec[f"role/{role}/grad_share"] = 0.5
            agg_len = 5 * step  # the aggregator grows toward the generators' 20 tokens
            rollouts = [_episode(step, p, agg_len) for p in range(2)]
            with open(path / "rollouts" / f"step_{step:06d}.jsonl", "w") as f:
                for r in rollouts:
                    f.write(json.dumps(r.to_dict()) + "\n")
        lines.append(json.dumps(rec))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_report_writes_every_plot_and_references_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(run)
    page = write_report(run)
    assert page == run / "report.html"
    html = page.read_text()
    for name in PLOTS:
        assert (run / name).stat().st_size > 1000
        assert f'src="{name}"' in html
    assert set(re.findall(r'src="([^"]+)"', html)) == PLOTS
    # alarms recomputed from the records and the rollouts' signatures
    assert "accuracy_cliff" in html and "down 0.200 from 0.600 at step 3" in html
    assert "gradient_amplification" in html  # generator chi2 climbs 3x past the aggregator's
    assert "median length 5 -&gt; 15 tokens (3.00x), toward generator&#39;s 20" in html
    # one transcript per role at the first, best (val step 3) and last step
    for label, step in (("first", 1), ("best", 3), ("last", 6)):
        assert f"{label} (step {step}) &mdash; generator" in html
        assert f"{label} (step {step}) &mdash; aggregator" in html
    assert "aggregator at step 6 picks" in html
    assert "&lt;think&gt;step 6&lt;/think&gt; generator 0" in html  # model text is escaped
    assert "<think>" not in html


def test_cli_report_out_dir_and_user_error(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run"
    make_run(run)
    out = tmp_path / "out"
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert (out / "report.html").is_file() and (out / "role_lengths.png").is_file()
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
