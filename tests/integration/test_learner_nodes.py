"""One run's learner across two "machines": `marl up --learner-nodes 2` starts the learner
as two torchrun agents of one rank each, joined over TCP by torch's c10d rendezvous on
loopback (services/learner/group.py), each rank holding half of every decoder layer.

A 3-step Isolated-Policy Voting run gives the one-process learner's per-step losses; a
second node SIGKILLed mid-run (its agent and rank together, as a lost machine) is started
again, the group re-forms, and the run resumes from its checkpoint and SUCCEEDS with the
uninterrupted run's final adapters.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from learner_runs import demo_model_dir, rows, submit, wait_end
from safetensors.torch import load_file
from test_learner_resume import resume_spec, wait_for_rows

from marl.local.launcher import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.resume, pytest.mark.timeout(1500)]
LOSSES = ("policy/generator/loss", "policy/aggregator/loss")


def final_adapters(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    root = out / "checkpoints"
    ckpt = root / (root / "latest").read_text().strip()
    return {
        p.name: load_file(str(p / "adapter_model.safetensors"))
        for p in sorted((ckpt / "adapters").iterdir())
    }


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The uninterrupted run on a one-process learner."""
    model_dir = demo_model_dir()
    work = tmp_path_factory.mktemp("one")
    with Cluster(work, str(model_dir), engine="transformers", sandbox_replicas=0) as c:
        run = wait_end(c, submit(c, resume_spec(model_dir, work / "out")))
        assert run.state == "SUCCEEDED", run.error
    yield work / "out"


def test_two_learner_nodes_train_as_one_and_survive_losing_one(
    one_node: Path, tmp_path: Path
) -> None:
    model_dir = demo_model_dir()
    want = rows(one_node)
    with Cluster(tmp_path, str(model_dir), engine="transformers", sandbox_replicas=0,
                 learner_nodes=2) as c:
        nodes = [p for p in c.processes if p.kind == "learner"]
        assert len(nodes) == 2 and all(p.launch for p in nodes)

        run = wait_end(c, submit(c, resume_spec(model_dir, tmp_path / "whole")))
        assert run.state == "SUCCEEDED", run.error
        got = rows(tmp_path / "whole")
        assert [r["step"] for r in got] == [r["step"] for r in want]
        for a, b in zip(want, got, strict=True):
            for key in LOSSES:
                if key in a:
                    assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)

        killed = tmp_path / "killed"
        run_id = submit(c, resume_spec(model_dir, killed))
        wait_for_rows(killed, 2)
        second = nodes[1]
        os.killpg(second.proc.pid, signal.SIGKILL)
        second.proc.wait(timeout=30)
        c.restart(second)
        run = wait_end(c, run_id, timeout_s=900)
        assert run.state == "SUCCEEDED", run.error

    assert [r["step"] for r in rows(killed)][-1] == want[-1]["step"]
    want_adapters = final_adapters(one_node)
    got_adapters = final_adapters(killed)
    assert got_adapters.keys() == want_adapters.keys()
    for p, weights in want_adapters.items():
        for k, v in weights.items():
            torch.testing.assert_close(got_adapters[p][k], v, rtol=1e-5, atol=1e-5)
