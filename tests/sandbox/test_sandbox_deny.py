"""Adversarial jobs, one property each: the attack must not work.

Every test runs its attack next to a benign job (which must still pass), and
the `server` fixture then checks that no process or scratch file was left
behind. Attacks are bounded (so sabotage mode, where they succeed, stays safe)
and report what they achieved on stdout; the assertions read that report and
the verdict. With MARL_SANDBOX_SABOTAGE=1 every test here must fail
(scripts/check_sandbox_sabotage.py).
"""

from __future__ import annotations

import re
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.sandbox import DENY_LIMITS, SandboxServer, run_alongside


def stdio(code: str, expected: str = "") -> tuple[str, list[dict[str, Any]]]:
    return code, [{"stdin": "", "expected_stdout": expected}]


def out(result: Any, i: int = 0) -> str:
    return str(result.results[i].stdout)


# -- processes -----------------------------------------------------------------


def test_deny_fork_bomb(server: SandboxServer, needs: Any) -> None:
    needs("seccomp")
    code = """
import os, time
made = 0
for _ in range(64):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    made += 1
print(made)
"""
    result, _ = run_alongside(server, *stdio(code))
    assert out(result).strip() == "0"


def test_deny_thread_bomb(server: SandboxServer, needs: Any) -> None:
    needs("namespaces")
    # RLIMIT_NPROC caps threads too, but the kernel never applies it to the real root
    # uid: a server running as root must run each jail under a uid of its own.
    code = """
import threading
threading.stack_size(32 * 1024)
stop = threading.Event()
made = 0
for _ in range(1500):
    try:
        threading.Thread(target=stop.wait, daemon=True).start()
    except (RuntimeError, MemoryError):
        break
    made += 1
print(made)
stop.set()
"""
    result, _ = run_alongside(server, *stdio(code))
    # max_processes (32 by default) per job, whatever uid the server runs as
    assert 0 <= int(out(result).strip() or "0") <= 32, out(result)


def test_deny_memory_bomb_one_process(server: SandboxServer) -> None:
    result, _ = run_alongside(server, *stdio("x = bytes(2 << 30)\nprint('allocated')\n"))
    assert result.verdicts == ["MEMORY_LIMIT"]
    assert "allocated" not in out(result)


def test_deny_memory_bomb_many_processes(server: SandboxServer, needs: Any) -> None:
    needs("seccomp")
    code = """
import os
kids = 0
for _ in range(8):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        try:
            x = bytes(1 << 30)
            os._exit(0)
        except MemoryError:
            os._exit(3)
    kids += 1
allocated = 0
for _ in range(kids):
    allocated += os.waitstatus_to_exitcode(os.wait()[1]) == 0
print(allocated)
"""
    result, _ = run_alongside(server, *stdio(code))
    assert out(result).strip() == "0"


def test_deny_cpu_spin(server: SandboxServer) -> None:
    code = """
while True:
    try:
        while True:
            pass
    except BaseException:
        pass
"""
    result, took = run_alongside(server, *stdio(code))
    assert result.verdicts == ["TIMEOUT"]
    assert took < DENY_LIMITS["timeout_seconds"] + 2.5


def test_deny_sleep_with_sigterm_trapped(server: SandboxServer) -> None:
    code = """
import signal, time
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM):
    signal.signal(s, signal.SIG_IGN)
while True:
    try:
        time.sleep(100)
    except BaseException:
        pass
"""
    result, took = run_alongside(server, *stdio(code))
    assert result.verdicts == ["TIMEOUT"]
    assert took < DENY_LIMITS["timeout_seconds"] + 2.5


def test_deny_double_fork_daemon(server: SandboxServer, needs: Any) -> None:
    needs("seccomp")
    code = """
import os, sys, time
r, w = os.pipe()
try:
    pid = os.fork()
except OSError:
    print('no fork')
    sys.exit(0)
if pid == 0:
    if os.fork() == 0:
        os.setsid()
        os.write(w, str(os.getpid()).encode())
        os.close(1)
        os.close(2)
        time.sleep(30)
    os._exit(0)
os.waitpid(pid, 0)
os.close(w)
print('daemon', os.read(r, 100).decode())
"""
    result, _ = run_alongside(server, *stdio(code))
    assert "daemon" not in out(result)


def test_deny_kill_parent(server: SandboxServer, needs: Any) -> None:
    needs("seccomp")
    code = """
import os, signal
try:
    os.kill(os.getppid(), signal.SIGKILL)
    print('killed')
except OSError:
    print('denied')
"""
    result, _ = run_alongside(server, *stdio(code, "denied\n"))
    assert result.verdicts == ["PASSED"]
    assert server.proc is not None and server.proc.poll() is None


def test_deny_os_system(server: SandboxServer, needs: Any) -> None:
    needs("seccomp")
    code = "import os\nprint('rc', os.system('echo SPAWNED'))\n"
    result, _ = run_alongside(server, *stdio(code))
    assert "SPAWNED" not in out(result)


def test_deny_subprocess(server: SandboxServer, needs: Any) -> None:
    needs("seccomp")
    code = """
import subprocess, sys
try:
    r = subprocess.run([sys.executable, '-c', 'print("SPAWNED")'], capture_output=True, text=True)
    print(r.stdout)
except OSError as e:
    print('denied', type(e).__name__)
"""
    result, _ = run_alongside(server, *stdio(code))
    assert "SPAWNED" not in out(result)


def test_deny_ctypes_syscalls(server: SandboxServer, needs: Any) -> None:
    needs("seccomp")
    if not re.match("x86_64", __import__("platform").machine()):
        pytest.skip("syscall numbers below are x86_64")
    code = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
done = {
    'socket': libc.syscall(41, 2, 1, 0) >= 0,
    'unshare': libc.syscall(272, 0x10000000) == 0,
    'ptrace': libc.syscall(101, 0, 0, 0, 0) == 0,
    'fork': False,
}
print(sorted(k for k, v in done.items() if v))
"""
    result, _ = run_alongside(server, *stdio(code, "[]\n"))
    assert out(result).strip() == "[]"


# -- files and output --------------------------------------------------------------


def test_deny_one_gib_file_write(server: SandboxServer) -> None:
    code = """
written = 0
chunk = b'x' * (1 << 20)
try:
    with open('big.bin', 'wb', buffering=0) as f:
        for _ in range(1024):
            written += f.write(chunk)
except OSError:
    pass
print(written)
"""
    result, _ = run_alongside(server, *stdio(code))
    assert int(out(result).strip() or 0) <= 16 << 20


def test_deny_many_small_files(server: SandboxServer, needs: Any) -> None:
    needs("namespaces")
    code = """
n = 0
try:
    for i in range(20000):
        with open(f'f{i}', 'w') as f:
            f.write('x')
        n += 1
except OSError:
    pass
print(n)
"""
    result, _ = run_alongside(server, *stdio(code))
    assert int(out(result).strip() or 0) <= 2048


def test_deny_output_flood(server: SandboxServer) -> None:
    code = ("import sys\nchunk = 'y' * 65535 + '\\n'\n"
            "for _ in range(512):\n    sys.stdout.write(chunk)\n")
    result, took = run_alongside(server, *stdio(code))
    assert result.verdicts == ["OUTPUT_LIMIT"]
    assert len(out(result)) <= 4096
    assert took < 5


def test_deny_symlink_at_output_paths(server: SandboxServer, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    canary.write_text("intact")
    names = ["main.py", "solution.py", "result.json", "output.txt", "stdout.txt", "stderr.txt"]
    code = f"""
import os
for name in {names!r}:
    try:
        os.remove(name)
    except OSError:
        pass
    try:
        os.symlink({str(canary)!r}, name)
    except OSError:
        pass
print('ok')
"""
    tests = [{"stdin": "", "expected_stdout": "ok"}] * 2
    result, _ = run_alongside(server, code, tests)
    assert result.verdicts == ["PASSED", "PASSED"]
    assert canary.read_text() == "intact"


# -- network ---------------------------------------------------------------------


class Listener:
    """A loopback server that records whether anything reached it."""

    def __init__(self, kind: str, address: Any = ("127.0.0.1", 0)):
        family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
        sock_type = socket.SOCK_DGRAM if kind == "udp" else socket.SOCK_STREAM
        self.sock = socket.socket(family, sock_type)
        self.sock.bind(address)
        if sock_type == socket.SOCK_STREAM:
            self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.address = self.sock.getsockname()
        self.hits: list[bytes] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(sock_type,), daemon=True)
        self.thread.start()

    def _serve(self, sock_type: int) -> None:
        while not self.stop.is_set():
            try:
                if sock_type == socket.SOCK_DGRAM:
                    self.hits.append(self.sock.recvfrom(4096)[0])
                else:
                    conn, _ = self.sock.accept()
                    self.hits.append(b"connection")
                    conn.close()
            except OSError:
                continue

    def close(self) -> list[bytes]:
        time.sleep(0.3)
        self.stop.set()
        self.thread.join()
        self.sock.close()
        return self.hits


def test_deny_tcp_connect(server: SandboxServer, needs: Any) -> None:
    needs("seccomp")
    listener = Listener("tcp")
    port = listener.address[1]
    code = f"""
import socket
try:
    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)
    s.sendall(b'hello')
    print('connected')
except OSError as e:
    print('denied', type(e).__name__)
"""
    result, _ = run_alongside(server, *stdio(code))
    assert listener.close() == []
    assert "connected" not in out(result)


def test_deny_udp_send(server: SandboxServer, needs: Any) -> None:
    needs("seccomp")
    listener = Listener("udp")
    port = listener.address[1]
    code = f"""
import socket
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto(b'leak', ('127.0.0.1', {port}))
    print('sent')
except OSError as e:
    print('denied', type(e).__name__)
"""
    result, _ = run_alongside(server, *stdio(code))
    assert listener.close() == []
    assert "sent" not in out(result)


def test_deny_dns_lookup(server: SandboxServer, needs: Any) -> None:
    needs("seccomp")
    resolver = Listener("udp")
    port = resolver.address[1]
    code = f"""
import socket, struct
query = struct.pack('>HHHHHH', 0x1234, 0x0100, 1, 0, 0, 0)
query += b''.join(bytes([len(p)]) + p for p in b'example.com'.split(b'.')) + b'\\0'
query += struct.pack('>HH', 1, 1)
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(1)
    s.sendto(query, ('127.0.0.1', {port}))
    print('queried')
except OSError as e:
    print('denied', type(e).__name__)
"""
    result, _ = run_alongside(server, *stdio(code))
    assert resolver.close() == []
    assert "queried" not in out(result)


def test_deny_unix_socket_connect(server: SandboxServer, tmp_path: Path, needs: Any) -> None:
    needs("seccomp")
    abstract = Listener("unix", "\0marl-deny-" + uuid.uuid4().hex)
    path = str(tmp_path / "s.sock")
    on_disk = Listener("unix", path)
    code = f"""
import socket
for address in ({abstract.address!r}, {path!r}):
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(address)
        print('connected')
    except OSError as e:
        print('denied', type(e).__name__)
"""
    result, _ = run_alongside(server, *stdio(code))
    assert abstract.close() == [] and on_disk.close() == []
    assert "connected" not in out(result)


# -- secrets of the host -------------------------------------------------------------


def test_deny_read_server_environment(server: SandboxServer) -> None:
    code = """
import os
print(dict(os.environ))
found = []
try:
    for pid in os.listdir('/proc')[:2000]:
        try:
            with open(f'/proc/{pid}/environ', 'rb') as f:
                if b'MARL_SANDBOX_TEST_SECRET' in f.read():
                    found.append(pid)
        except OSError:
            pass
except OSError:
    pass
print('found', found)
"""
    result, _ = run_alongside(server, *stdio(code))
    assert server.secret not in out(result)
    assert "found []" in out(result)


def test_deny_read_parent_environ(server: SandboxServer) -> None:
    code = """
import os
for pid in (os.getppid(), 1):
    try:
        with open(f'/proc/{pid}/environ', 'rb') as f:
            print(f.read().decode(errors='replace'))
    except OSError as e:
        print('denied', type(e).__name__)
"""
    result, _ = run_alongside(server, *stdio(code))
    assert server.secret not in out(result)


# -- reward integrity ----------------------------------------------------------------


ADD_CHECK = "def check(candidate):\n    assert candidate(2, 3) == 5\n"


def assert_job(code: str, program: str = ADD_CHECK,
               entry: str = "add") -> tuple[str, list[dict[str, Any]]]:
    return code, [{"assert_program": program, "entry_point": entry}]


def test_deny_early_sys_exit(server: SandboxServer) -> None:
    code = "import sys\nsys.exit(0)\ndef add(a, b):\n    return a - b\n"
    result, _ = run_alongside(server, *assert_job(code))
    assert result.pass_rate == 0.0


def test_deny_early_os_exit(server: SandboxServer) -> None:
    code = "import os\nos._exit(0)\ndef add(a, b):\n    return a - b\n"
    result, _ = run_alongside(server, *assert_job(code))
    assert result.pass_rate == 0.0


def test_deny_raise_system_exit(server: SandboxServer) -> None:
    code = "def add(a, b):\n    raise SystemExit\n"
    result, _ = run_alongside(server, *assert_job(code))
    assert result.pass_rate == 0.0


def test_deny_print_passed(server: SandboxServer) -> None:
    code = """
import os, sys
def double(x):
    print('PASSED')
    print('__MARL_RESULT__ PASSED')
    print('ok 1 - all tests passed')
    sys.stdout.flush()
    os._exit(0)
"""
    result, _ = run_alongside(server, code, [{"fn_name": "double", "args": [2], "expected": 4}])
    assert result.pass_rate == 0.0


ALWAYS_EQUAL = """
class Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
"""


def test_deny_always_equal_return_value(server: SandboxServer) -> None:
    code = ALWAYS_EQUAL + "def double(x):\n    return Anything()\n"
    result, _ = run_alongside(server, code, [{"fn_name": "double", "args": [2], "expected": 4}])
    assert result.verdicts == ["FAILED"]


def test_deny_always_equal_in_assert_program(server: SandboxServer) -> None:
    code = ALWAYS_EQUAL + "def add(a, b):\n    return Anything()\n"
    result, _ = run_alongside(server, *assert_job(code))
    assert result.verdicts == ["FAILED"]


@pytest.mark.parametrize("program", [
    "def check(candidate):\n    assert all(map(lambda x: candidate(x) == 2 * x, range(5)))\n",
    "def check(candidate):\n    for got in map(candidate, range(5)):\n        assert got == 0\n",
])
def test_deny_candidate_stop_iteration_cuts_the_tests_loop(server: SandboxServer,
                                                           program: str) -> None:
    code = "def double(x):\n    raise StopIteration('wrong on purpose')\n"
    result, _ = run_alongside(server, *assert_job(code, program, "double"))
    assert result.pass_rate == 0.0


def test_deny_patched_builtins(server: SandboxServer) -> None:
    program = ("def check(candidate):\n    assert len(candidate('abc')) == 3\n"
               "    assert sorted(candidate('cba')) == ['a', 'b', 'c']\n")
    code = ("import builtins\nbuiltins.len = lambda x: 3\n"
            "builtins.sorted = lambda x: ['a', 'b', 'c']\ndef letters(s):\n    return ''\n")
    result, _ = run_alongside(server, *assert_job(code, program, "letters"))
    assert result.verdicts == ["FAILED"]


def test_deny_patched_unittest(server: SandboxServer) -> None:
    program = ("import unittest\n\ndef check(candidate):\n    t = unittest.TestCase()\n"
               "    t.assertEqual(candidate(2), 4)\n    t.assertTrue(candidate(3) == 6)\n")
    code = ("import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n"
            "unittest.TestCase.assertTrue = lambda *a, **k: None\n"
            "def double(x):\n    return 0\n")
    result, _ = run_alongside(server, *assert_job(code, program, "double"))
    assert result.pass_rate == 0.0


SEARCH_MEMORY = r"""
import gc, re
PATTERN = re.compile(rb'tok-[0-9a-f]{32}')
def find():
    for o in gc.get_objects():
        code = getattr(o, '__code__', None)
        values = o.values() if isinstance(o, dict) else getattr(code, 'co_consts', ())
        for v in values:
            if isinstance(v, str) and PATTERN.fullmatch(v.encode()):
                return v
    try:
        with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
            for line in maps:
                span, perms = line.split()[:2]
                if 'r' not in perms:
                    continue
                lo, hi = (int(x, 16) for x in span.split('-'))
                try:
                    mem.seek(lo)
                    m = PATTERN.search(mem.read(hi - lo))
                except (OSError, OverflowError, ValueError, MemoryError):
                    continue
                if m:
                    return m.group().decode()
    except OSError:
        pass
    return None
"""


def test_deny_search_memory_for_expected_value(server: SandboxServer) -> None:
    token = "tok-" + uuid.uuid4().hex
    code = SEARCH_MEMORY + "def answer():\n    return find()\n"
    result, _ = run_alongside(server, code, [{"fn_name": "answer", "args": [], "expected": token}])
    assert result.verdicts == ["FAILED"]
    assert token not in out(result)


def test_deny_search_memory_for_assert_program(server: SandboxServer) -> None:
    token = "tok-" + uuid.uuid4().hex
    program = f"def check(candidate):\n    assert candidate() == {token!r}\n"
    code = SEARCH_MEMORY + "def answer():\n    return find()\n"
    result, _ = run_alongside(server, *assert_job(code, program, "answer"))
    assert result.verdicts == ["FAILED"]


def test_deny_search_disk_for_expected_value(server: SandboxServer) -> None:
    token = "tok-" + uuid.uuid4().hex
    code = r"""
import os, re, time
PATTERN = re.compile(rb'tok-[0-9a-f]{32}')
def answer():
    start, seen = time.monotonic(), 0
    for top in ('.', '/tmp', '/'):
        for root, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if os.path.join(root, d) not in ('/proc', '/sys', '/dev')]
            for name in files:
                seen += 1
                if seen > 30000 or time.monotonic() - start > 1.5:
                    return None
                try:
                    path = os.path.join(root, name)
                    if os.path.getsize(path) < 1 << 20:
                        with open(path, 'rb') as f:
                            m = PATTERN.search(f.read())
                        if m:
                            return m.group().decode()
                except OSError:
                    pass
    return None
"""
    result, _ = run_alongside(server, code, [{"fn_name": "answer", "args": [], "expected": token}])
    assert result.verdicts == ["FAILED"]
