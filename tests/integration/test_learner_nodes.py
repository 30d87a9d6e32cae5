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
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.cluster import ClusterFactory
from tests.support.runs import resume_spec, rows, submit, wait_end, wait_for_rows
from tests.support.specs import demo_model_dir

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
def one_node(tmp_path_factory: pytest.TempPathFactory, module_clusters: ClusterFactory) -> Path:
    """The uninterrupted run on a one-process learner."""
    out = tmp_path_factory.mktemp("one") / "out"
    c = module_clusters(sandbox_replicas=0)
    run = wait_end(c, submit(c, resume_spec(demo_model_dir(), out)))
    assert run.state == "SUCCEEDED", run.error
    return out


def test_two_learner_nodes_train_as_one_and_survive_losing_one(
    one_node: Path, tmp_path: Path, clusters: ClusterFactory
) -> None:
    model_dir = demo_model_dir()
    want = rows(one_node)
    c = clusters(sandbox_replicas=0, learner_nodes=2)
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

