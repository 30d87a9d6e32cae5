"""What the zygote prepares once for every jail is what each jail used to build itself.

The fast paths must not change a single layer: the filters packed ahead of
time are byte for byte the programs, and the zygote carries no threading
machinery into the jails it forks.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.reward_sandbox import forkserver, seccomp


@pytest.mark.skipif(not seccomp.supported(), reason="seccomp needs x86_64/aarch64")
def test_prepacked_filters_are_the_programs() -> None:
    assert seccomp._base_packed() == seccomp.pack(seccomp.base_program())
    for pid in (1, 2, 77, 4_194_304, 2**31 - 1):
        assert seccomp.strict_packed(pid) == seccomp.pack(seccomp.strict_program(pid))


def test_zygote_imports_no_threads_or_asyncio() -> None:
    probe = (f"import sys; sys.path.insert(0, {forkserver.ROOT!r}); "
             "from services.reward_sandbox import forkserver; "
             "[__import__(m) for m in forkserver._PRELOAD]; "
             "print(sorted({'asyncio', 'threading', 'subprocess'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True,
                         text=True, check=True, env={})
    assert out.stdout.strip() == "[]"
