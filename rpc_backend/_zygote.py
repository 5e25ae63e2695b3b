"""How ``run_local`` starts its ranks: one fresh process imports torch, then forks them.

Spawning every rank costs each one a fresh interpreter and ``import torch`` (~2 s of CPU),
so a world of N ranks paid N imports before its first message. Here the launcher starts one
process per world, the *zygote*: a fresh interpreter with the caller's environment, working
directory and ``sys.path`` as of the call, which imports torch (and this package) and nothing
of the caller's, then forks the N ranks before it has started a thread. Each rank then does
what a spawned rank did after its interpreter started (``multiprocessing.spawn.prepare``: the
caller's ``sys.argv``, ``sys.path``, working directory, and its ``__main__`` imported as
``__mp_main__``), unpickles its function and arguments, and runs. So the caller's module-level
code runs in every rank, as before, never in the zygote: its seeds, threads and OpenMP pools
are each rank's own. What differs from a spawned rank, and is taken care of:

- **exit**: a forked process ends with ``os._exit``; a rank runs the interpreter's ``atexit``
  handlers itself when its function is done (a spawned rank ran them at interpreter exit);
- **randomness**: a fresh interpreter seeds Python's ``random``, NumPy's global generator
  and torch's default (CPU) generator from the OS, so every spawned rank drew its own streams
  (``torch.initial_seed()`` differs); a forked rank would share the zygote's. Python reseeds
  ``random`` in a forked child itself, and each rank reseeds NumPy's (when imported: torch
  imports it) and torch's from the OS before the caller's script runs. So each rank draws its
  own streams unless the script seeds them (at its top level, which each rank runs, or in the
  rank's function), and then exactly the seeded ones; torch's accelerator generators are
  created in the rank at first use (the zygote starts no accelerator), as in a spawned rank;
- **start method**: a rank's default ``multiprocessing`` start method is ``spawn``, as it was;
- **lifetime**: a rank dies with its zygote (``PR_SET_PDEATHSIG`` and a watchdog thread), and
  the zygote with the launcher, so a launcher killed outright still takes every rank down;
- **signals**: the zygote ignores SIGINT (a terminal's Ctrl-C reaches every process of the
  group; each rank handles it as before) and passes SIGTERM on to its ranks.

Messages (the ranks' "joined", results, errors; the zygote's pids and exit codes, which it
learns with ``waitpid``, so a rank's own children never delay them) travel to the launcher
over one pipe; :class:`Ranks` is the launcher's view of them.

Needs ``fork`` (Linux, macOS).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.spawn
import os
import pickle
import queue
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Sequence

from rpc_backend._lifetime import _set_parent_death_signal, exit_with_parent

#: Messages of the zygote itself (the ranks send the others).
FORKED, EXITED = "forked", "exited"

# What the zygote's interpreter runs: read what the launcher sent, take the caller's sys.path
# (as a spawned process does before it imports anything of the caller's), then serve.
_BOOT = (
    "import os, pickle, sys; "
    "f = os.fdopen(int(sys.argv[1]), 'rb'); sent = pickle.load(f); f.close(); "
    "sys.path[:] = sent[0]['sys_path']; "
    "from rpc_backend._zygote import zygote_main; zygote_main(sent, int(sys.argv[2]), int(sys.argv[3]))"
)


class Messages:
    """The ranks' and the zygote's end of the message pipe: ``put`` one picklable item (whole
    messages, one writer at a time; the lock is inherited by the forked ranks)."""

    def __init__(self, fd: int) -> None:
        self._conn = mp.connection.Connection(fd, readable=False)
        self._lock = mp.get_context("fork").Lock()

    def put(self, item: Any) -> None:
        data = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._conn.send_bytes(data)

    # what run_local's ranks call on a multiprocessing.Queue before they exit: ``put`` is
    # synchronous here, so there is nothing to flush
    def close(self) -> None:
        pass

    def join_thread(self) -> None:
        pass


class _RankProcess(mp.context.ForkProcess):
    """Forked, but a rank's own default start method is ``spawn``, as in a spawned rank (a
    ``multiprocessing.Process`` a rank starts must not fork a process running RPC threads)."""

    _start_method = "spawn"


def _reseed() -> None:
    """Seed NumPy's global generator and torch's default generator from the OS, as a fresh
    interpreter seeds them (Python reseeds ``random`` in a forked child itself)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        try:
            numpy.random.seed()
        except Exception:  # a stub or broken NumPy: nothing to reseed
            pass
    import torch

    torch.default_generator.seed()  # a non-deterministic seed, as torch's own at import


def _forked_rank(prep: dict, payload: bytes, rank: int, zygote_pid: int, messages: Messages) -> None:
    _reseed()  # before the caller's script runs: it may seed them
    from rpc_backend._local_rank import failure_status, rank_entry

    me = mp.current_process()
    # While the script runs as __mp_main__, a run_local it reaches (no ``if __name__ ==
    # "__main__":`` guard) raises multiprocessing's own error, as in a spawned process.
    me._inheriting = True
    try:
        mp.spawn.prepare(prep)  # what a spawned process did first: sys.path, argv, cwd, __main__
        args = pickle.loads(payload)[rank]
    except BaseException as exc:
        messages.put((failure_status(exc), rank, traceback.format_exc()))
        os._exit(1)
    finally:
        del me._inheriting
    try:
        rank_entry(zygote_pid, *args, messages)
    finally:
        # A forked child ends with os._exit (no interpreter exit): run what a spawned rank's
        # interpreter ran at exit. (Ranks that fail end with os._exit themselves, as before.)
        atexit._run_exitfuncs()


def zygote_main(sent: tuple, message_fd: int, launcher_pid: int) -> None:
    """The zygote (see the module docstring): fork a rank per name, report their pids, reap
    them with ``waitpid``, reporting each exit code, and end once none is left."""
    prep, names, payload = sent
    _set_parent_death_signal(signal.SIGKILL)  # no thread yet: forking comes first
    import rpc_backend._local_rank  # noqa: F401  (torch and what every rank runs, imported once)

    messages = Messages(message_fd)
    prep = {k: v for k, v in prep.items() if k != "start_method"}  # a rank's stays "spawn"
    ranks: dict[int, int] = {}
    procs = []
    for rank, name in enumerate(names):
        proc = _RankProcess(
            target=_forked_rank, args=({**prep, "name": f"rpc-{name}"}, payload, rank, os.getpid(), messages),
            name=f"rpc-{name}", daemon=False,
        )
        proc.start()
        procs.append(proc)
        ranks[proc.pid] = rank
    # After the forks, so that the ranks keep Python's own SIGINT handler and SIGTERM default.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def pass_on(signum: int, frame: Any) -> None:
        for pid in list(ranks):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, pass_on)
    exit_with_parent(launcher_pid)
    messages.put((FORKED, -1, [p.pid for p in procs]))
    for proc in procs:  # starting a process reaps finished ones: a rank may be gone already
        if proc.exitcode is not None:
            messages.put((EXITED, ranks.pop(proc.pid), proc.exitcode))
    while ranks:
        try:
            pid, status = os.waitpid(-1, 0)  # not the ranks' sentinels: their children may hold them
        except ChildProcessError:
            break
        rank = ranks.pop(pid, None)
        if rank is not None:
            messages.put((EXITED, rank, os.waitstatus_to_exitcode(status)))
    os._exit(0)


class Ranks:
    """The launcher's view of a world: the zygote's process and the message pipe.

    :meth:`get` returns the ranks' own messages and keeps the zygote's (pids, exit codes) for
    :meth:`alive`, :meth:`exitcode` and :meth:`signal`.
    """

    def __init__(self, prep: dict, names: Sequence[str], payload: bytes) -> None:
        data_r, data_w = os.pipe()
        message_r, message_w = os.pipe()
        cmd = [mp.spawn.get_executable(), *subprocess._args_from_interpreter_flags(), "-c", _BOOT,
               str(data_r), str(message_w), str(os.getpid())]
        try:
            self.zygote = subprocess.Popen(cmd, pass_fds=(data_r, message_w))
        except BaseException:
            for fd in (data_r, data_w, message_r, message_w):
                os.close(fd)
            raise
        os.close(data_r)
        os.close(message_w)
        self._conn = mp.connection.Connection(message_r, writable=False)
        with os.fdopen(data_w, "wb") as f:  # the zygote reads it before anything else
            try:
                pickle.dump((prep, list(names), payload), f, protocol=pickle.HIGHEST_PROTOCOL)
            except BrokenPipeError:
                pass  # the zygote died at once: reported as its exit
        self.pids: list[int | None] = [None] * len(names)
        self.exitcodes: list[int | None] = [None] * len(names)
        self._eof = False

    def get(self, timeout: float) -> tuple:
        """The next message a rank sent, within ``timeout`` seconds (``queue.Empty`` if none)."""
        end = time.monotonic() + timeout
        while True:
            left = max(0.0, end - time.monotonic())
            if self._eof or not self._conn.poll(left):
                if self._eof:
                    time.sleep(min(left, 0.05))
                raise queue.Empty
            try:
                status, rank, payload = pickle.loads(self._conn.recv_bytes())
            except EOFError:  # every writer is gone
                self._eof = True
                continue
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
        zygote_alive = self.zygote.poll() is None
        return [r for r, code in enumerate(self.exitcodes) if code is None and (zygote_alive or _exists(self.pids[r]))]

    def exitcode(self, rank: int) -> int | None:
        """The rank's exit code; the zygote's when it ended without reporting the rank's."""
        code = self.exitcodes[rank]
        if code is None and rank not in self.alive():
            return self.zygote.returncode
        return code

    def exit_text(self, rank: int) -> str:
        """How the rank ended, for an error message."""
        if self.exitcodes[rank] is not None:
            return f"exited with code {self.exitcodes[rank]} without a result"
        return (f"ended without a result when the process that forked the ranks (pid {self.zygote.pid}) "
                f"exited with code {self.zygote.returncode}")

    def any_alive(self) -> bool:
        return bool(self.alive()) or self.zygote.poll() is None

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
        if self.zygote.poll() is None:
            try:
                os.kill(self.zygote.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self, rank: int) -> None:
        """SIGKILL one rank (a frozen rank of an expendable role: the world goes on without it)."""
        pid = self.pids[rank]
        if pid is not None and self.exitcodes[rank] is None:
            try:
                os.kill(pid, signal.SIGKILL)
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
        return True

    def close(self) -> None:
        self._conn.close()


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


def start(fn_args: Sequence[tuple], names: Sequence[str], main_name: str = "rpc-local-world") -> Ranks:
    """Start a world: the zygote, which forks one rank per name; rank ``r`` runs
    ``rpc_backend._local_rank.rank_entry(zygote_pid, *fn_args[r], messages)``. Raises at once
    (nothing started) when the arguments cannot be pickled."""
    prep = mp.spawn.get_preparation_data(main_name)
    if "authkey" in prep:  # an AuthenticationString pickles only while spawning: send its bytes
        prep["authkey"] = bytes(prep["authkey"])
    payload = pickle.dumps(list(fn_args), protocol=pickle.HIGHEST_PROTOCOL)
    return Ranks(prep, names, payload)

