"""Test worlds whose ranks are forked from a forkserver that imported torch once.

Only for the test suite's fault worlds (tests/_faults/subworld.py): each rank there is a fresh
``python -m MODULE`` otherwise, and every one pays ``import torch`` (~1.5 CPU s). Those ranks
print a report and end with ``os._exit``, are reaped by the test, and are given their
environment explicitly, so the ways a forked rank differs from a spawned one do not reach
them. ``rpc_backend.run_local`` spawns its ranks: a forkserver child skips ``atexit`` and
interpreter shutdown, inherits the server's alive-pipe (so the server, and a launcher waiting
for it, outlive a SIGKILLed launcher or a rank's stray child), and Python 3.11's server imports
its preloads with the working directory first on ``sys.path`` (a review of that attempt).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
from typing import Any, Iterator

#: imported once by the server, before any rank is forked
PRELOAD = ["torch", "torch.distributed.rpc", "rpc_backend.local"]
_lock = threading.Lock()


@contextlib.contextmanager
def fork_context() -> Iterator[Any]:
    """A multiprocessing context whose processes fork from a server started here (torch
    preloaded) and stopped on exit, once they are gone; spawn where that is not possible
    (no forkserver start method, or a forkserver already running in this process)."""
    server = None
    if "forkserver" in mp.get_all_start_methods():
        from multiprocessing import forkserver

        server = getattr(forkserver, "_forkserver", None)
    pid = None
    if server is not None and hasattr(server, "_stop"):
        with _lock:
            if server._forkserver_pid is None:
                previous = list(server._preload_modules)
                server.set_forkserver_preload(PRELOAD)
                try:
                    server.ensure_running()
                finally:
                    server.set_forkserver_preload(previous)
                pid = server._forkserver_pid
    if pid is None:
        yield mp.get_context("spawn")
        return
    try:
        yield mp.get_context("forkserver")
    finally:
        with _lock:
            if server._forkserver_pid == pid:
                server._stop()
