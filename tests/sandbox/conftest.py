"""Fixtures for the sandbox tests: one real server per module, checked after every test.

After each test the server must be back to its idle processes with an empty
scratch root; anything left behind fails the test, and the server is replaced
so the next test starts clean.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from marl.clients import SandboxClient
from tests.support.sandbox import ROOT, SandboxServer, cmdline


@pytest.fixture(scope="session")
def machine_tier() -> str:
    """The tier this machine allows, probed without sabotage."""
    out = subprocess.run([sys.executable, "-m", "services.reward_sandbox.doctor", "--json"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return str(json.loads(out.stdout)["tier"])


_RANK = {"rlimits": 0, "seccomp": 1, "namespaces": 2}


@pytest.fixture
def needs(machine_tier: str):  # type: ignore[no-untyped-def]
    def check(tier: str) -> None:
        if _RANK[machine_tier] < _RANK[tier]:
            pytest.skip(f"needs the {tier} tier; this machine allows {machine_tier}")

    return check


class _Holder:
    server: SandboxServer | None = None


@pytest.fixture(scope="module")
def _holder() -> Iterator[_Holder]:
    holder = _Holder()
    yield holder
    if holder.server is not None:
        holder.server.stop()


@pytest.fixture
def server(_holder: _Holder) -> Iterator[SandboxServer]:
    """The module's server; a test that leaves anything behind fails and gets it replaced."""
    if _holder.server is None:
        _holder.server = SandboxServer({}).start()
    srv = _holder.server
    yield srv
    pids, files = srv.leftovers()
    if pids or files:
        srv.stop()
        _holder.server = None
        details = [f"{p}: {' '.join(cmdline(p))[:80]}" for p in pids]
        pytest.fail(f"left behind: processes {details}, scratch files {files[:10]}")


@pytest.fixture
def client(server: SandboxServer) -> Iterator[SandboxClient]:
    with SandboxClient(server.address) as c:
        yield c


