"""A call cancelled at the moment its jail's pid arrives must still kill that jail.

Python 3.11's `asyncio.wait_for` returns the result instead of raising when the
waiting task is cancelled in the same loop iteration as the result arrives; the
zygote client used it, so such a call ran its job to the time limit (the leaked
jails that `test_calls_cancelled_at_any_moment_leave_nothing` saw under load).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time

import pytest

from services.reward_sandbox import wire
from services.reward_sandbox.forkserver_client import ZygoteClient


def _gone(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return True
        time.sleep(0.02)
    return False


def test_cancel_as_the_pid_arrives_kills_the_jail() -> None:
    jail = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:

        async def go() -> None:
            client = ZygoteClient({"sabotage": False})
            ours, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            client.sock = ours
            call = asyncio.ensure_future(client.spawn({}, []))
            while not client._pending:
                await asyncio.sleep(0)
            msg, _ = wire.recv_msg(zygote_end)  # type: ignore[misc]
            # The pid arrives and the caller is cancelled in the same loop iteration.
            client._pending.pop(msg["id"]).set_result(jail.pid)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await asyncio.sleep(0.05)  # the kill runs as a done-callback
            ours.close()
            zygote_end.close()

        asyncio.run(go())
        assert _gone(jail), "the jail of a cancelled call was left running"
    finally:
        if jail.poll() is None:
            jail.kill()
            jail.wait()
