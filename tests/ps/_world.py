"""One RPC world for the parameter-server tests: a ``driver`` rank plus servers and trainers
(``ps0 .. psN``, ``trainer0 .. trainerM``), all plain subprocesses on loopback.

The pytest process cannot be the driver itself: it may already be rank 0 of the session world
(tests/conftest.py), and a process joins one RPC world only. So the driver is a subprocess that
pytest steers through a pipe: each request is one line (a pickled module-level function and its
arguments), run on the driver, answered by one ``RESULT`` line. :meth:`PSWorld.run` uses that to
call functions on several workers concurrently (``rpc_async`` from the driver) and returns their
values to pytest, which computes the local references itself. Every process is reaped at
:meth:`PSWorld.close` (and each rank exits by itself if pytest dies).

    python -m tests.ps._world NAME RANK WORLD_SIZE INIT_METHOD PARENT_PID RPC_TIMEOUT
"""

from __future__ import annotations

import base64
import itertools
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from tests._deadlines import HANG_S, SETUP_S
from tests._transport import world_options

ROOT = Path(__file__).resolve().parents[2]


def role_names(roles: dict[str, int]) -> list[str]:
    """``{"ps": 2, "trainer": 1}`` -> ``["driver", "ps0", "ps1", "trainer0"]``."""
    return ["driver"] + [f"{role}{i}" for role, n in roles.items() for i in range(n)]


def _encode(obj: Any) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode("ascii")


def _decode(text: str) -> Any:
    return pickle.loads(base64.b64decode(text))


class PSWorld:
    """pytest's handle on the world: start it, run functions on its workers, kill ranks, close it."""

    def __init__(self, roles: dict[str, int], rpc_timeout: float = SETUP_S, start_timeout: float = SETUP_S) -> None:
        """Start the ranks and wait until each answers (``start_timeout``). ``rpc_timeout`` is
        every rank's default RPC timeout: init_rpc's rendezvous waits that long for the last
        rank to arrive, and every call made without a timeout of its own (creating a job, a
        table) may take that long. Both are set-up guards (tests/_deadlines.py): a test's own
        short timeouts are set on the calls it expects to time out, never here."""
        from rpc_backend.loopback import fresh_file_rendezvous, loopback_env

        self.names = role_names(roles)
        init_method, self._path = fresh_file_rendezvous()
        env = {**os.environ, **loopback_env(),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1"}
        self._stderr = tempfile.TemporaryFile()
        self.procs: dict[str, subprocess.Popen] = {}
        for rank, name in enumerate(self.names):
            driver = rank == 0
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "tests.ps._world", name, str(rank), str(len(self.names)), init_method,
                 str(os.getpid()), str(rpc_timeout)],
                cwd=ROOT, env=env, text=True,
                stdin=subprocess.PIPE if driver else subprocess.DEVNULL,
                stdout=subprocess.PIPE if driver else subprocess.DEVNULL,
                stderr=self._stderr,
            )
        self._answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._lock = threading.Lock()
        try:
            self.call(_ready, self.names[1:], start_timeout, timeout=start_timeout + HANG_S)
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        for line in self.procs["driver"].stdout:
            if line.startswith("RESULT "):
                self._answers.put(_decode(line[len("RESULT "):].strip()))
        self._answers.put(("error", "the driver exited"))

    def stderr_tail(self, chars: int = 3000) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-chars:]

    def call(self, fn: Callable, *args: Any, timeout: float = SETUP_S + HANG_S) -> Any:
        """``fn(*args)`` on the driver (``fn`` at module level); its value, or AssertionError
        with the driver's traceback. ``timeout`` is a hang guard (tests/_deadlines.py), no time
        limit: reaching it fails the test. By default it outlasts what the driver's own calls
        may take (creating a job on the trainers: the world's RPC timeout, SETUP_S), so their
        error is the one seen."""
        with self._lock:
            driver = self.procs["driver"]
            driver.stdin.write(_encode((fn, args)) + "\n")
            driver.stdin.flush()
            try:
                kind, value = self._answers.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"hang guard: the driver did not answer {fn.__name__} within {timeout} s; "
                                     f"stderr:\n{self.stderr_tail()}") from None
        if kind != "ok":
            raise AssertionError(f"{fn.__name__} failed on the driver:\n{value}\nstderr:\n{self.stderr_tail()}")
        return value

    def run(self, calls: dict[str, tuple], timeout: float = HANG_S) -> dict[str, Any]:
        """``{worker: (fn, *args)}`` run concurrently on those workers (sent together by the
        driver); ``{worker: value}``. Any failure raises AssertionError naming every one.
        ``timeout`` (each call's RPC timeout) is a hang guard, no time limit."""
        outcomes = self.call(fan, [(w, c[0], tuple(c[1:])) for w, c in calls.items()], timeout,
                             timeout=timeout + HANG_S)
        failed = {w: text for w, (kind, text) in zip(calls, outcomes) if kind != "ok"}
        if failed:
            raise AssertionError("failed on " + "; ".join(f"{w}: {t}" for w, t in failed.items()))
        return {w: value for w, (_, value) in zip(calls, outcomes)}

    def freeze(self, name: str) -> None:
        """SIGSTOP one rank and wait until it is stopped. ``kill()`` returns before the stop takes
        effect: one thread of the rank takes the signal and only then stops the others, so on a
        loaded machine the rank's RPC threads may still answer calls sent right after it (in a
        frozen-server test a step then succeeds). pytest is its parent: ``waitpid(WUNTRACED)``
        returns once every thread of it has stopped."""
        import signal

        pid = self.procs[name].pid
        os.kill(pid, signal.SIGSTOP)
        _, status = os.waitpid(pid, os.WUNTRACED)
        if not os.WIFSTOPPED(status):
            raise AssertionError(f"{name} did not stop on SIGSTOP: wait status {status:#x}")

    def thaw(self, name: str) -> None:
        """SIGCONT a rank stopped by :meth:`freeze`."""
        import signal

        os.kill(self.procs[name].pid, signal.SIGCONT)

    def kill(self, name: str) -> None:
        """SIGKILL one rank and reap it."""
        proc = self.procs[name]
        proc.kill()
        proc.wait()

    def close(self) -> None:
        """Reap every rank. They are killed, not shut down gracefully: a graceful RPC shutdown
        of this world costs ~6 s and proves nothing here (the session world proves it)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
        if os.path.exists(self._path):
            os.unlink(self._path)
        self._stderr.close()

    def __enter__(self) -> "PSWorld":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_job_ids = itertools.count()


def job(what: str) -> str:
    """A job name no other test of this pytest run uses (jobs live on for the world's life)."""
    return f"{what}-{next(_job_ids)}"


# ---- run on the driver -----------------------------------------------------------------------


def _ready(names: list[str], seconds: float) -> list[str]:
    """Every rank answers (and has imported the PS test helpers) within ``seconds`` (a set-up
    guard: on a loaded machine those imports take minutes)."""
    import torch.distributed.rpc as rpc

    from tests.ps import _dense_remote

    futs = [rpc.rpc_async(n, _dense_remote.ready, (n.startswith("ps"),), timeout=seconds) for n in names]
    return [f.wait() for f in futs]


def fan(calls: list[tuple[str, Callable, tuple]], timeout: float) -> list[tuple[str, Any]]:
    """Send every ``(worker, fn, args)`` at once; ``("ok", value)`` or ``("error", text)`` each."""
    import torch.distributed.rpc as rpc

    futs = [rpc.rpc_async(w, fn, args, timeout=timeout) for w, fn, args in calls]
    out = []
    for fut in futs:
        try:
            out.append(("ok", fut.wait()))
        except Exception as exc:
            out.append(("error", f"{type(exc).__name__}: {exc}"))
    return out


def _exit_when_orphaned(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.5)


def _serve_requests(stdout) -> None:
    """The driver's loop: run each request, answer it, until pytest closes the pipe."""
    for line in sys.stdin:
        try:
            fn, args = _decode(line)
            answer = ("ok", fn(*args))
        except BaseException:
            answer = ("error", traceback.format_exc())
        try:
            text = _encode(answer)
        except Exception:
            text = _encode(("error", f"the answer does not pickle:\n{traceback.format_exc()}"))
        stdout.write("RESULT " + text + "\n")
        stdout.flush()


def main(argv: list[str]) -> None:
    name, rank, world_size, init_method, parent_pid, rpc_timeout = argv
    threading.Thread(target=_exit_when_orphaned, args=(int(parent_pid),), daemon=True).start()
    import torch.distributed.rpc as rpc

    options = world_options(init_method=init_method, rpc_timeout=float(rpc_timeout),
                                              num_worker_threads=16)
    rpc.init_rpc(name, rank=int(rank), world_size=int(world_size), rpc_backend_options=options)
    if name != "driver":
        rpc.shutdown()  # serves until PSWorld.close kills it
        return
    stdout = sys.stdout
    sys.stdout = sys.stderr  # only RESULT lines on the pipe
    _serve_requests(stdout)
    os._exit(0)  # pytest reaps every rank (PSWorld.close)


if __name__ == "__main__":
    main(sys.argv[1:])
