"""Rank functions whose module does, at import, what a training script's top level may do:
run an OpenMP-parallel op and start a thread (for tests/backend/test_launcher.py). run_local
imports this module in every rank; in the test process (the launcher) the module-level work
is skipped."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import torch
import torch.distributed.rpc as rpc

if multiprocessing.parent_process() is not None:  # in a rank (or anything run_local started)
    torch.set_num_threads(2)
    _a = torch.randn(256, 256)
    _warm = float((_a @ _a).sum())  # starts OpenMP's thread pool in whatever imports this
    HEARTBEAT = threading.Thread(target=lambda: time.sleep(3600), name="heartbeat", daemon=True)
    HEARTBEAT.start()
else:
    HEARTBEAT = None


def matmul_and_heartbeat() -> dict:
    """A parallel op in the rank, and whether the module's thread runs here."""
    b = torch.ones(256, 256)
    return {"sum": float((b @ b).sum()), "threads": torch.get_num_threads(),
            "heartbeat": HEARTBEAT is not None and HEARTBEAT.is_alive()}


def leave_a_child(pid_dir: str) -> int:
    """Start a child that outlives this rank and keeps every inherited descriptor open;
    returns its pid (the test kills it)."""
    # (an hour: alive when the test looks, however slow the machine; the test kills it)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], close_fds=False)
    return child.pid


def kill_the_forking_process() -> None:
    """Rank 0 kills its parent, the process that forked the ranks (the others wait)."""
    if rpc.get_worker_info().id == 0:
        os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(3600)  # until the launcher stops the world
