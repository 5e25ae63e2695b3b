"""tests/ps/_world.PSWorld.freeze: the rank is stopped, every thread of it, when it returns (a
bare ``os.kill(pid, SIGSTOP)`` returns before that, and a loaded machine's rank then still
answers calls sent right after it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.ps._world import PSWorld

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc")

# threads that wait in the kernel, as a rank's RPC threads do
CHILD = """
import sys, threading
ev = threading.Event()
for _ in range(8):
    threading.Thread(target=ev.wait, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


def _states(pid: int) -> list[str]:
    return [(task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in Path(f"/proc/{pid}/task").iterdir()]


def test_freeze_returns_with_every_thread_of_the_rank_stopped_and_thaw_resumes_it():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        world = PSWorld.__new__(PSWorld)  # only its ranks: no RPC world needed
        world.procs = {"ps1": proc}
        for _ in range(20):
            world.freeze("ps1")
            states = _states(proc.pid)
            assert set(states) == {"T"}, f"threads not stopped when freeze returned: {states}"
            world.thaw("ps1")
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
