"""How ``run_local`` starts its ranks: one spawned process imports torch, then forks them.

Spawning every rank costs each one a fresh interpreter and ``import torch`` (~2 s of CPU),
so a world of N ranks paid N imports before its first message. Here the launcher spawns one
process per world, the *zygote*: a fresh interpreter started like any spawned process (the
caller's environment, working directory and ``sys.path`` as of the call, the caller's
``__main__`` imported as ``__mp_main__``), which imports torch once and then forks the N ranks
before it has started a thread or touched a device. Each rank then runs as a spawned one
would, with these differences taken care of:

- **exit**: a forked process ends with ``os._exit``; a rank runs the interpreter's ``atexit``
  handlers itself when its function is done (a spawned rank ran them at interpreter exit), so
  loggers flush and user handlers run;
- **randomness**: every rank starts from the generator states the zygote had once the
  caller's ``__main__`` (and ``fn``'s module) were imported, for Python's ``random``, NumPy's
  global generator and torch's, as a spawned rank started from what its own import of the
  same script left: a script that seeds at its top level gets those seeded streams in every
  rank. (Python reseeds ``random`` in a forked child; that is undone.) One difference: a
  script that seeds nothing gets one stream shared by its ranks, where spawned ranks each
  drew fresh OS entropy for Python and NumPy; seed with the rank for independent streams;
- **lifetime**: a rank dies with its zygote (``PR_SET_PDEATHSIG`` and a watchdog thread), and
  the zygote with the launcher, so a launcher killed outright still takes every rank down;
- **start method**: a rank's default ``multiprocessing`` start method is ``spawn``, as it was;
- **signals**: the zygote ignores SIGINT (a terminal's Ctrl-C reaches every process of the
  group; each rank handles it as before) and passes SIGTERM on to its ranks.

The zygote reports the ranks' pids and, as it reaps them, their exit codes through the
world's result queue; :class:`Ranks` is the launcher's view of them (alive, exit code,
terminate, kill), driven by the messages it reads.

Needs the ``fork`` start method (Linux, macOS).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import random
import signal
import sys
import time
from typing import Any, Callable, Sequence

from rpc_backend._lifetime import _set_parent_death_signal, exit_with_parent

#: Messages of the zygote itself on the result queue (the ranks send the others).
FORKED, EXITED = "forked", "exited"


def _generator_states() -> tuple[Any, Any]:
    """Python's ``random`` state and NumPy's global one (None without NumPy)."""
    numpy_state = None
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        try:
            numpy_state = numpy.random.get_state()
        except Exception:  # a stub or broken NumPy: nothing to carry over
            pass
    return random.getstate(), numpy_state


def _restore_generators(states: tuple[Any, Any]) -> None:
    python_state, numpy_state = states
    random.setstate(python_state)  # Python reseeded it in this forked child
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)


class _RankProcess(mp.context.ForkProcess):
    """Forked, but a rank's own default start method is ``spawn``, as in a spawned rank (a
    ``multiprocessing.Process`` a rank starts must not fork a process running RPC threads)."""

    _start_method = "spawn"


def _forked_rank(target: Callable[..., None], args: tuple, states: tuple[Any, Any]) -> None:
    _restore_generators(states)
    try:
        target(*args)
    finally:
        # A forked child ends with os._exit (no interpreter exit): run what a spawned rank's
        # interpreter ran at exit. (Ranks that fail end with os._exit themselves, as before.)
        atexit._run_exitfuncs()


def zygote_main(
    launcher_pid: int, target: Callable[..., None], rank_args: Sequence[tuple], names: Sequence[str], results: Any,
) -> None:
    """The zygote: fork one rank per entry of ``rank_args``, which runs
    ``target(zygote_pid, *rank_args[r])``; report their pids, then reap them, reporting each
    exit code, until none is left."""
    _set_parent_death_signal(signal.SIGKILL)  # no thread yet: forking comes first
    states = _generator_states()  # what the caller's script left, for every rank
    ranks = []
    for args, name in zip(rank_args, names):
        proc = _RankProcess(target=_forked_rank, args=(target, (os.getpid(), *args), states), name=f"rpc-{name}",
                            daemon=False)
        proc.start()
        ranks.append(proc)
    # After the forks, so that the ranks keep Python's own SIGINT handler and SIGTERM default.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def pass_on(signum: int, frame: Any) -> None:
        for p in ranks:
            if p.exitcode is None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    signal.signal(signal.SIGTERM, pass_on)
    exit_with_parent(launcher_pid)
    results.put((FORKED, -1, [p.pid for p in ranks]))
    left = {p.sentinel: (rank, p) for rank, p in enumerate(ranks)}
    while left:
        for sentinel in mp.connection.wait(list(left)):
            rank, proc = left.pop(sentinel)
            proc.join()
            results.put((EXITED, rank, proc.exitcode))
    results.close()
    results.join_thread()  # every report flushed before this process ends


class Ranks:
    """The launcher's view of a zygote's ranks (see the module docstring).

    ``get`` returns the ranks' own messages from the result queue and keeps the zygote's
    (pids, exit codes) for :meth:`alive`, :meth:`exitcode`, :meth:`signal`.
    """

    def __init__(self, zygote: Any, results: Any, world_size: int) -> None:
        self.zygote = zygote
        self.results = results
        self.pids: list[int | None] = [None] * world_size
        self.exitcodes: list[int | None] = [None] * world_size

    def get(self, timeout: float) -> tuple:
        """The next message a rank sent, within ``timeout`` seconds (``queue.Empty`` if none)."""
        end = time.monotonic() + timeout
        while True:
            status, rank, payload = self.results.get(timeout=max(0.0, end - time.monotonic()))
            if status == FORKED:
                self.pids = list(payload)
            elif status == EXITED:
                self.exitcodes[rank] = payload
            else:
                return status, rank, payload

    def drain(self) -> None:
        """Read what is queued now (keeping the zygote's reports, dropping the rest)."""
        while True:
            try:
                self.get(0.0)
            except queue.Empty:
                return

    def alive(self) -> list[int]:
        """The ranks whose processes may still run (as far as the reports read so far say)."""
        zygote_alive = self.zygote.is_alive()
        return [r for r, code in enumerate(self.exitcodes) if code is None and (zygote_alive or _exists(self.pids[r]))]

    def exitcode(self, rank: int) -> int | None:
        """The rank's exit code; the zygote's when the zygote ended without reporting it."""
        code = self.exitcodes[rank]
        if code is None and rank not in self.alive():
            return self.zygote.exitcode
        return code

    def any_alive(self) -> bool:
        return bool(self.alive()) or self.zygote.is_alive()

    def signal(self, signum: int) -> None:
        """Send ``signum`` to every rank still running and to the zygote."""
        self.drain()
        for rank in self.alive():
            pid = self.pids[rank]
            if pid is not None:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
        if self.zygote.is_alive():
            try:
                os.kill(self.zygote.pid, signum)
            except ProcessLookupError:
                pass

    def reap(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every rank and the zygote to end; True when they have."""
        deadline = time.monotonic() + timeout
        while self.any_alive():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                self.get(min(0.05, left))
            except queue.Empty:
                pass
        self.zygote.join()
        return True


def _exists(pid: int | None) -> bool:
    """``pid`` runs (None, a rank the zygote never reported: False). Asked once the zygote is
    gone: its ranks are then orphans, and a zombie counts as gone (a container's init may never
    reap it)."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
