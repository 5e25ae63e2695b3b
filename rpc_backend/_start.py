"""How ``run_local`` starts its ranks: forked from a fresh server that imported torch once.

A spawned rank is a new interpreter that imports torch (about 1.5 CPU seconds each). For each
``run_local`` call this module starts multiprocessing's forkserver with torch preloaded and
forks every rank from it, so a world of N ranks pays one import instead of N. The server is
started by the call, so it has the caller's environment, working directory and standard
streams at that moment, as spawned ranks would; it is stopped when the call ends.

Two things differ from spawn, and are made up for. Forked ranks start with the server's
random state: ``rpc_backend._forked`` reseeds torch's generator (and numpy's, if loaded) in each
one, right after the fork and before the caller's ``__main__`` is imported (so its
``torch.manual_seed`` still applies). And the ranks' parent is the server, not the caller: a rank
therefore also watches a pipe whose write end only the caller holds (:func:`launcher_link`,
:func:`rpc_backend._lifetime.exit_when_closed`): it exits when the caller dies, however it dies.

The server is stopped (and waited for) once this call's ranks are gone; a process forked from
it by someone else meanwhile (code in another thread of the caller using the forkserver start
method) keeps it alive until that process exits too.

Falls back to spawn where the forkserver start method is missing (Windows), where this
Python's multiprocessing lacks the parts used here, and when a forkserver already runs in this
process (someone else's: its environment and preloads are not this call's to choose).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
from typing import Any, Iterator

#: imported once by the server, before any rank is forked (the rank entry point's module pulls
#: in torch.distributed.rpc and the rest of rpc_backend); ``rpc_backend._forked`` makes each
#: forked rank reseed torch's generator, as a new interpreter would have a seed of its own
PRELOAD = ["torch", "torch.distributed.rpc", "rpc_backend.local", "rpc_backend._forked"]
#: the start methods ``run_local`` accepts
START_METHODS = ("forkserver", "spawn")
_lock = threading.Lock()


def _server() -> Any:
    """multiprocessing's forkserver object, or None where it lacks what this module uses."""
    if "forkserver" not in mp.get_all_start_methods():
        return None
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    needed = ("_forkserver_pid", "_preload_modules", "_stop", "ensure_running", "set_forkserver_preload")
    return server if all(hasattr(server, name) for name in needed) else None


@contextlib.contextmanager
def rank_context(method: str) -> Iterator[Any]:
    """The multiprocessing context to start this call's ranks with (see the module docstring);
    a forkserver started here is stopped on exit, once the ranks are gone."""
    if method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {method!r}")
    server = _server() if method == "forkserver" else None
    pid = None
    if server is not None:
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


def launcher_link(ctx: Any) -> tuple[Any, Any]:
    """A one-way pipe ``(read end, write end)``: the ranks get the read end, the caller keeps
    the write end open until its ranks are gone; a rank reading EOF knows the caller died."""
    return ctx.Pipe(duplex=False)
