"""run_local's ranks never outlive it: SIGINT/SIGTERM to the launcher stop them first (then
the signal has its usual effect), and they exit by themselves when the launcher is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rpc_backend._lifetime import StopSignals, exit_with_parent
from tests._deadlines import HANG_S, SETUP_S

ROOT = Path(__file__).resolve().parents[2]


def _is_gone(pid: int) -> bool:
    """No such process, or only its zombie (an orphan's new parent may not reap it at once)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def _wait_for(predicate, seconds: float, what: str) -> None:
    """Poll ``predicate``; ``seconds`` is a hang guard (tests/_deadlines.py)."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"hang guard: {what} within {seconds} s")
        time.sleep(0.1)


class _Launcher:
    """tests/backend/_lifetime_world.py in a subprocess, with its ranks' pids once they are up."""

    def __init__(self, tmp_path: Path, mode: str) -> None:
        self.pid_dir = tmp_path
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.backend._lifetime_world", str(tmp_path), mode],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.rank_pids: list[int] = []

    def wait_for_ranks(self) -> list[int]:
        files = [self.pid_dir / f"rank{r}.pid" for r in range(2)]
        _wait_for(lambda: all(f.exists() for f in files) or self.proc.poll() is not None, SETUP_S,
                  "ranks did not start")
        assert self.proc.poll() is None, self.proc.communicate()
        self.rank_pids = [int(f.read_text()) for f in files]
        assert not any(_is_gone(pid) for pid in self.rank_pids)
        return self.rank_pids

    def finish(self) -> tuple[int, dict | None, str]:
        out, err = self.proc.communicate(timeout=HANG_S)  # stopping ranks: slow under load
        line = next((line for line in out.splitlines() if line.startswith("REPORT ")), None)
        return self.proc.returncode, None if line is None else json.loads(line[len("REPORT "):]), err

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.rank_pids:
            if not _is_gone(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def launcher(tmp_path):
    made: list[_Launcher] = []

    def start(mode: str = "plain") -> _Launcher:
        made.append(_Launcher(tmp_path, mode))
        return made[-1]

    yield start
    for one in made:
        one.cleanup()


@pytest.mark.slow
def test_sigint_stops_the_ranks_then_raises_keyboard_interrupt(launcher):
    job = launcher()
    pids = job.wait_for_ranks()
    job.proc.send_signal(signal.SIGINT)  # to the launcher only: its ranks do not see it
    code, report, err = job.finish()
    assert code == 3, err[-3000:]
    assert report == {"children_left": [], "sigint_restored": True, "sigterm_restored": True,
                      "via": "KeyboardInterrupt"}
    assert all(_is_gone(pid) for pid in pids)


@pytest.mark.slow
def test_sigterm_stops_the_ranks_then_ends_the_process(launcher):
    job = launcher()
    pids = job.wait_for_ranks()
    job.proc.send_signal(signal.SIGTERM)
    code, report, err = job.finish()
    assert code == -signal.SIGTERM, err[-3000:]  # ended by SIGTERM, as without run_local
    assert report is None
    _wait_for(lambda: all(_is_gone(pid) for pid in pids), HANG_S, "ranks still running")


@pytest.mark.slow
def test_sigterm_runs_the_previous_handler_after_stopping_the_ranks(launcher):
    job = launcher("own-sigterm")
    pids = job.wait_for_ranks()
    job.proc.send_signal(signal.SIGTERM)
    code, report, err = job.finish()
    assert code == 4, err[-3000:]
    # the handler ran with the ranks already stopped and reaped, and was itself reinstalled
    assert report == {"children_left": [], "sigint_restored": True, "sigterm_restored": True, "via": "own-sigterm"}
    assert all(_is_gone(pid) for pid in pids)


@pytest.mark.slow
def test_ranks_exit_when_the_launcher_is_killed(launcher):
    job = launcher()
    pids = job.wait_for_ranks()
    job.proc.kill()  # SIGKILL: the launcher can do nothing; the ranks must notice
    job.proc.wait()
    _wait_for(lambda: all(_is_gone(pid) for pid in pids), HANG_S, "ranks outlived their killed launcher")


def test_parent_watchdog_notices_a_new_parent():
    # without prctl, only the polling thread: told the parent is someone else, it fires at once
    fired = threading.Event()
    exit_with_parent(os.getppid() + 1_000_000, interval=0.05, on_orphaned=fired.set, use_prctl=False)
    assert fired.wait(HANG_S)  # a hang guard: it fires at its first poll
    calm = threading.Event()
    exit_with_parent(os.getppid(), interval=0.05, on_orphaned=calm.set, use_prctl=False)
    assert not calm.wait(0.5)


def test_stop_signals_do_nothing_outside_the_main_thread():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    seen = {}

    def body() -> None:
        with StopSignals() as stop:
            seen["active"] = stop.active
            seen["handlers"] = {s: signal.getsignal(s) for s in before}

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == {"active": False, "handlers": before}


@pytest.fixture
def python_signal_handlers():
    """SIGINT and SIGTERM as a Python started from a terminal has them, whatever this process
    inherited (a shell starts background jobs with SIGINT ignored); put back afterwards."""
    inherited = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, handler in inherited.items():
        signal.signal(s, handler)


def test_stop_signals_are_installed_and_restored_in_the_main_thread(python_signal_handlers):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with StopSignals() as stop:
        assert stop.active
        assert all(signal.getsignal(s) == stop._record for s in before)
        stop.raise_if_received()  # nothing received: no-op
    assert {s: signal.getsignal(s) for s in before} == before


def test_an_ignored_stop_signal_stays_ignored(python_signal_handlers):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with StopSignals() as stop:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == stop._record
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
