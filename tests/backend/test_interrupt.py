"""Ctrl-C on a script that runs a local world (``make demo``): the ranks are stopped and the
console gets the interrupt alone, not a traceback per rank, chained tracebacks or warnings of
leaked semaphores."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._deadlines import HANG_S, SETUP_S

pytestmark = [pytest.mark.slow]

SCRIPTS = Path(__file__).parent / "scripts"


def _as_from_a_terminal() -> None:
    """SIGINT as a job started from a terminal has it: this process may have inherited it
    ignored (a non-interactive shell starts its background jobs so, e.g. ``make test &``), and
    a Python started with SIGINT ignored keeps ignoring it (no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_once(cmd: list[str], ready: callable, cwd: str | None = None) -> tuple[int, str, str]:
    """Run ``cmd`` in a session of its own; once ``ready(stdout_line)`` holds for a line it
    printed, send SIGINT to its process group, as a terminal's Ctrl-C does; returns its exit
    code, the output it printed after the signal, and all its output. Every process of the
    group has exited by then."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=cwd, preexec_fn=_as_from_a_terminal)
    before = []
    try:
        for line in proc.stdout:
            before.append(line)
            if ready(line):
                break
        else:
            proc.wait(HANG_S)
            pytest.fail(f"exited ({proc.returncode}) before it was ready:\n{''.join(before)[-4000:]}")
        os.killpg(proc.pid, signal.SIGINT)
        after, _ = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + HANG_S  # the group's last processes (a rank's children) exit after it
    while time.monotonic() < deadline and _group_alive(proc.pid):
        time.sleep(0.05)
    assert not _group_alive(proc.pid), "processes of the interrupted job are left (hang guard)"
    return proc.returncode, _without_peer_gone_warnings(after), "".join(before) + after


#: TensorPipe's C++ log line when a peer's connection closes: the ranks are stopped together,
#: but one that is still reading may see another's socket close first and log it (once)
_PEER_GONE = re.compile(r"^\[W\d{4} [\d:.]+ tensorpipe_agent\.cpp:\d+\] RPC agent for \S+ encountered error "
                        r"when reading incoming (request|response) from \S+: EOF")


def _without_peer_gone_warnings(text: str) -> str:
    """``text`` without the lines :data:`_PEER_GONE` matches (torch's, not this project's)."""
    return "".join(line for line in text.splitlines(keepends=True) if not _PEER_GONE.match(line))


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ctrl_c_stops_the_ranks_and_raises_keyboardinterrupt_alone(tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()

    def ready(line: str) -> bool:
        if line.startswith("STARTED"):  # then wait for every rank to be running its function
            deadline = time.monotonic() + SETUP_S
            while len(list(gate.glob("ready?"))) < 3:
                assert time.monotonic() < deadline, "hang guard: the ranks did not start"
                time.sleep(0.02)
            return True
        return False

    code, after, everything = _interrupt_once([sys.executable, str(SCRIPTS / "interrupted_job.py"), str(gate)], ready)
    # the caller's KeyboardInterrupt, and nothing of the ranks: Python's one traceback (the
    # call of run_local), ending with KeyboardInterrupt, and the process ends by SIGINT
    assert code == -signal.SIGINT, everything
    assert after.count("Traceback") == 1 and after.rstrip().endswith("KeyboardInterrupt"), everything
    assert "During handling" not in after and "rank " not in after and "leaked" not in after, everything
    assert len(after.splitlines()) <= 10, everything
    assert not any(line.startswith("RESULT") for line in everything.splitlines()), everything


def test_ctrl_c_on_the_demo_prints_one_line_and_exits_130(tmp_path):
    # `make demo` runs this module; Ctrl-C once its trainers train (its ranks run their
    # functions; a server serves in its shutdown): one line, exit code 130, as a shell reports
    # a job stopped by SIGINT; no warnings of semaphores a rank left (tqdm's lock, made with
    # each bar, even one a pipe disables)
    cmd = [sys.executable, "-m", "remote_module.demos.dlrm", "--servers", "1", "--trainers", "2",
           "--steps", "1000000", "--plot", ""]
    # (off a terminal each trainer prints a progress line every few seconds once it trains; the
    # two print theirs at about the same step, so the signal goes once both printed one: a line
    # of the other trainer's on its way then is no line after the signal)
    printed: set[str] = set()

    def both_train(line: str) -> bool:
        if line.startswith(("trainer0: step ", "trainer1: step ")):
            printed.add(line[:8])
        return len(printed) == 2

    code, after, everything = _interrupt_once(cmd, both_train, cwd=str(tmp_path))
    assert code == 130, everything
    assert after.split() == ["interrupted"], everything
