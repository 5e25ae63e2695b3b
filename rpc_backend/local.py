"""``run_local``: run a function on N local processes that form one RPC world.

The embedded default used by ``make demo``, the tutorials and tests: processes on loopback,
each with RPC initialized and RANK / WORLD_SIZE / LOCAL_RANK set as torchrun would set them.
The launcher spawns one fresh process per world, which imports torch once and forks the ranks
(``rpc_backend/_zygote.py`` says what a forked rank keeps of a spawned one's semantics).
Like torchrun's agent, the launcher hosts the job's store (on 127.0.0.1 only) and gives every
rank MASTER_ADDR / MASTER_PORT / TORCHELASTIC_USE_AGENT_STORE, so code written for torchrun
(``init_role_process_group``, ``init_process_group("gloo")``) runs unchanged. A failing rank
stops the world within seconds instead of hanging it.
"""

from __future__ import annotations

import ast
import contextlib
import io
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch.distributed.rpc as rpc

from rpc_backend._lifetime import StopSignals, exit_with_parent
from rpc_backend._quiet import hide_functional_optimizer_deprecation, no_backend_as_process_group_warning
from rpc_backend._zygote import Ranks
from rpc_backend._zygote import start as start_world
from rpc_backend.builds import world_checked
from rpc_backend.loopback import loopback_env, loopback_store
from rpc_backend.options import DEFAULT_TRANSPORT, make_options, positive_seconds
from rpc_backend.roles import RankPlacement, placements
from rpc_backend.watch import WatchSettings, on_lost, start_watching, watch_settings
from rpc_backend.world import Worker, _set_current

_log = logging.getLogger("rpc_backend.run_local")


class LocalWorldError(RuntimeError):
    """A rank of a local world failed; ``rank`` names it and the message carries its traceback.
    ``interrupted``: it failed with ``KeyboardInterrupt`` (it got SIGINT)."""

    def __init__(self, rank: int, name: str, text: str, interrupted: bool = False) -> None:
        what = "was interrupted (KeyboardInterrupt: it received SIGINT)" if interrupted else "failed"
        super().__init__(f"rank {rank} ({name}) {what}:\n{text}")
        self.rank = rank
        self.name = name
        self.text = text
        self.interrupted = interrupted


def _rank_entry(
    parent_pid: int,
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    layout: list[RankPlacement],
    store_port: int,
    option_kwargs: dict,
    shutdown_timeout: float | None,
    watching: WatchSettings | None,
    results: Any,
) -> None:
    exit_with_parent(parent_pid)  # a parent killed outright (SIGKILL) cannot stop its ranks
    signal.signal(signal.SIGINT, _interrupt_once)
    hide_functional_optimizer_deprecation()
    # The user's script runs here as __mp_main__: show the DeprecationWarnings its own lines
    # trigger, as Python's default filters do for __main__ (a plain run or torchrun).
    warnings.filterwarnings("default", category=DeprecationWarning, module="__mp_main__")
    world_size = len(layout)
    me = layout[rank]
    os.environ.update(loopback_env())
    os.environ.update(
        # the launcher's store, as torchrun's agent provides one (MASTER_ADDR is 127.0.0.1)
        MASTER_PORT=str(store_port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        ROLE_NAME=me.role,
        ROLE_RANK=str(me.role_rank),
        ROLE_WORLD_SIZE=str(me.role_size),
    )
    try:
        init_method = f"tcp://{os.environ['MASTER_ADDR']}:{store_port}"
        options = make_options(init_method=init_method, worker_names=[p.name for p in layout], **option_kwargs)
        with no_backend_as_process_group_warning():
            rpc.init_rpc(me.name, rank=rank, world_size=world_size, rpc_backend_options=options)
        world_checked()  # every rank is forked from one process: one build (rpc_backend/builds.py)
        start_watching(me.name, layout, watching)
        if watching is not None and watching.expendable:
            _tell_launcher_of_losses(results, me.name)
        worker = _set_current(
            Worker(me.name, rank, world_size, rank, me.role, me.role_rank, me.role_size,
                   shutdown_timeout=shutdown_timeout, layout=list(layout))
        )
        results.put(("joined", rank, None))  # for the caller's progress messages
        value = fn(*args)
        results.put(("returned", rank, None))
    except BaseException as exc:
        _report_failure(results, rank, exc)
        # Skip the graceful barrier: the others may be waiting on this rank forever.
        os._exit(1)
    try:
        # Serve the other ranks until every one is done; the result goes out afterwards, so a
        # rank that could not finish its shutdown is reported as failed.
        worker.shutdown(graceful=True)
    except BaseException as exc:
        _report_failure(results, rank, exc)
        os._exit(1)
    try:
        payload = _result_bytes(value)
    except _UnpicklableResult as exc:
        _send(results, ("error", rank, str(exc)))
        os._exit(1)
    _send(results, ("ok", rank, payload))


def _tell_launcher_of_losses(results: Any, me: str) -> None:
    """Send the launcher each expendable peer this rank's heartbeats count lost: a frozen rank
    never exits by itself, and the launcher waits for every process (it kills that one)."""

    def tell(lost: Any) -> None:
        try:
            results.put(("lost", lost.rank, f"not heard from for {lost.silent_s:.1f} s (noticed by {me})"))
        except (OSError, ValueError):  # this rank is past its report: the launcher has its result
            pass

    on_lost(tell)


def _interrupt_once(signum: int, frame: Any) -> None:
    """A rank's SIGINT handler: the first raises ``KeyboardInterrupt`` as Python's own does;
    later ones are ignored. The same Ctrl-C has reached the launcher, which stops every rank,
    so a second one (``timeout`` and some shells send it again to the whole group) would only
    interrupt the rank's report of the first, printing chained tracebacks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _report_failure(results: Any, rank: int, exc: BaseException) -> None:
    """Send the launcher ``exc``'s traceback. A rank interrupted (``KeyboardInterrupt``) then
    waits, its connections open, until the launcher stops the world: the launcher then stops
    the ranks together (or the same Ctrl-C has reached them all), whereas a rank that
    exited alone made its peers' TensorPipe agents warn on the console that it was gone."""
    status = _failure(exc)
    _send(results, (status, rank, traceback.format_exc()))
    if status == "interrupted":
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: nothing more to say
        while True:
            signal.pause()  # SIGTERM (the launcher's _stop) ends the process


def _failure(exc: BaseException) -> str:
    """How a rank reports ``exc``: "interrupted" for a ``KeyboardInterrupt`` (the rank got
    SIGINT, as every process of a terminal's foreground group does on Ctrl-C), else "error"."""
    return "interrupted" if isinstance(exc, KeyboardInterrupt) else "error"


class _UnpicklableResult(Exception):
    """A rank's return value cannot be pickled; the message names the offending type."""


def _result_bytes(value: Any) -> bytes:
    """``value`` pickled by value with the plain pickler.

    The result queue's own pickler (multiprocessing's, with torch's reducers) would share a
    tensor's storage through a file descriptor of this process, which is gone by the time the
    caller reads it; plain pickle copies tensors into the bytes instead.
    """
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        where, culprit = _first_unpicklable(value, "result")
        raise _UnpicklableResult(
            f"fn returned a value run_local cannot send back: {where} is of type "
            f"{_type_name(culprit)}, which cannot be pickled ({type(exc).__name__}: {exc}); return "
            f"picklable data instead (tensors, numbers, strings, lists, dicts, ...)"
        ) from None


def _first_unpicklable(value: Any, where: str, depth: int = 0) -> tuple[str, Any]:
    """The path and value of the innermost part of ``value`` that cannot be pickled, looking
    into lists, tuples, sets and dicts; ``value`` itself when no part is to blame."""
    if depth < 20:
        if isinstance(value, dict):
            items: Any = [(f"{where}[{k!r}]", v) for k, v in value.items()]
            items += [(f"a key of {where}", k) for k in value]
        elif isinstance(value, (list, tuple)):
            items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, (set, frozenset)):
            items = [(f"an element of {where}", v) for v in value]
        else:
            items = []
        for inner_where, inner in items:
            try:
                pickle.dumps(inner, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:
                return _first_unpicklable(inner, inner_where, depth + 1)
    return where, value


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _send(results: Any, item: tuple) -> None:
    """Put ``item`` and wait until it is flushed: the process may ``os._exit`` right after."""
    results.put(item)
    results.close()
    results.join_thread()


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *,
    roles: Mapping[str, int] | None = None,
    names: Sequence[str] | None = None,
    args: tuple = (),
    rpc_timeout: float = 60.0,
    num_worker_threads: int = 16,
    timeout: float | None = None,
    stop_grace: float = 3.0,
    device_maps: dict[str, dict[str, dict]] | None = None,
    shutdown_timeout: float | None = None,
    progress: Callable[[str], None] | None = None,
    progress_every: float = 2.0,
    transport: str = DEFAULT_TRANSPORT,
    heartbeat: float | None = None,
    lost_after: float | None = None,
    expendable: Sequence[str] = (),
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` local processes forming one RPC world.

    Worker names come from ``roles`` (``{"ps": 1, "trainer": 2}`` -> ps0, trainer0, trainer1)
    or are given as ``names``; default ``worker0 .. worker{N-1}``. Each rank sees RANK,
    WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE as under torchrun (plus ROLE_NAME, ROLE_RANK,
    ROLE_WORLD_SIZE), and listens on loopback only. When the calling process gets SIGINT or
    SIGTERM (while ``run_local`` runs in the main thread), the ranks are stopped first
    (terminate, then kill) and then the signal has its usual effect (``KeyboardInterrupt``;
    the process ends); the ranks also exit by themselves if the caller dies outright. A
    terminal's Ctrl-C reaches the ranks as well: what they report then (their own
    ``KeyboardInterrupt``, a peer gone) is not printed or raised, so the caller's
    ``KeyboardInterrupt`` comes alone. A rank interrupted while the caller is not fails the
    world with a :class:`LocalWorldError` whose ``interrupted`` is true. The ranks
    keep two unactionable torch warnings off the console (see ``rpc_backend/_quiet.py``).
    As torchrun does, ranks start with ``OMP_NUM_THREADS=1`` (one intra-op thread each: they
    share the machine's cores) unless the caller's environment sets it. They also start with
    ``MALLOC_ARENA_MAX=2`` unless it is set: glibc gives each thread that allocates its own
    memory arena, and each of an RPC server's handler threads kept the freed temporaries of
    the calls it ran (a long-lived table server's memory grew 2.3x as much over a stream of
    lookups and pushes: tests/benchmarks/bench_admission.py).
    MASTER_ADDR / MASTER_PORT name a store the launcher hosts on 127.0.0.1 (as torchrun's agent
    does), so :func:`~rpc_backend.init_role_process_group` and ``init_process_group`` work in
    ``fn``. Returns the ranks' return values ordered by rank, copied by value with plain pickle
    (tensors arrive intact, with no storage shared with the exited rank); a value that cannot be
    pickled fails the world with :class:`LocalWorldError` naming the rank and the offending
    type. If a rank raises, its traceback is printed, the other ranks are stopped and
    :class:`LocalWorldError` is raised within ``stop_grace`` seconds. ``timeout`` bounds the
    whole run (None: no bound). ``fn`` must be importable: each rank imports it by module and
    name, so it is defined at the top level of a module or of the script run as ``__main__``
    (not a lambda or a nested function, nor in ``python -c`` or a notebook, which give the ranks
    no file to import); otherwise, or when ``args`` cannot be pickled, ``TypeError`` names the
    culprit before any process starts.
    The ranks are forked from one fresh interpreter per call (the caller's environment, working
    directory and ``sys.path`` as of the call), which imports torch once and none of the
    caller's code; each rank then imports the caller's ``__main__`` as a spawned rank did, so
    module-level code and threads are its own, and runs its ``atexit`` handlers when done (see
    ``rpc_backend/_zygote.py``). Each rank draws its own random streams, as a fresh interpreter
    does: Python's ``random``, NumPy's and torch's generators are seeded from the OS in every
    rank (``torch.initial_seed()`` differs), before the script's top level runs there; a script
    that seeds them at its top level or in ``fn`` gets exactly the seeded streams in every rank.
    A rank whose ``fn`` returned keeps serving the others until every rank is done, however
    long that takes; ``shutdown_timeout`` seconds bound that wait (a rank that hits the bound
    shuts down immediately and fails the world).
    ``device_maps`` maps a worker name to its own device maps, e.g.
    ``{"worker0": {"worker1": {"cuda:0": "cuda:0"}}}``.
    ``progress``, when given, is called in the caller with one-line messages while the world
    starts (seconds: the process that forks the ranks imports torch first): once when the
    processes start, every ``progress_every`` seconds while some rank has not joined the RPC
    world yet (naming them), and once when all have joined; then, once every ``fn`` has
    returned, while the ranks shut down and exit (the same way); e.g. ``progress=print``.
    ``transport`` is TensorPipe's transport, ``"uv"`` (default; idle ranks use no CPU) or
    ``"shm"`` (torch's defaults, which busy-poll), as in :func:`~rpc_backend.make_options`.
    ``heartbeat``, ``lost_after`` and ``expendable`` are as in :func:`~rpc_backend.init_from_env`:
    the ranks hear from each other (a rank frozen for ``lost_after`` seconds ends the world;
    a rank that exits is noticed by the launcher at once, as before). A rank of an
    ``expendable`` role that fails or exits without a result is logged as lost and the world
    goes on; its value in the returned list is ``None``.

    Example::

        def main():                      # runs on every rank
            if rpc.get_worker_info().id == 0:
                return rpc.rpc_sync("worker1", torch.add, (1, 2))

        if __name__ == "__main__":
            print(run_local(main, 2))    # [3, None]
    """
    if roles is not None and names is not None:
        raise ValueError("pass roles or names, not both")
    _check_importable(fn)
    layout = placements(world_size, roles)
    if names is not None:
        names = list(names)
        if len(names) != world_size or len(set(names)) != world_size:
            raise ValueError(f"names must be {world_size} distinct worker names, got {names!r}")
        layout = [RankPlacement(n, "worker", r, world_size) for r, n in enumerate(names)]
    names = [p.name for p in layout]
    if shutdown_timeout is not None:
        shutdown_timeout = positive_seconds(shutdown_timeout, "shutdown_timeout")
    progress_every = positive_seconds(progress_every, "progress_every")
    watching = watch_settings(heartbeat, lost_after, expendable, roles=[p.role for p in layout])
    spared = {r for r, p in enumerate(layout) if p.role in set(expendable)}
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable taking one str (e.g. print), got {progress!r}")
    option_kwargs = dict(rpc_timeout=rpc_timeout, num_worker_threads=num_worker_threads, device_maps=None,
                         transport=transport)
    # validate here, in the caller, before any process starts
    make_options(worker_names=names, **option_kwargs)
    maps_by_worker = dict(device_maps or {})
    for worker, maps in maps_by_worker.items():
        if worker not in names:
            raise ValueError(f"device_maps names worker {worker!r}, which is not in the world {names}")
        make_options(worker_names=names, **{**option_kwargs, "device_maps": maps})
    stop = StopSignals()
    with stop:  # main thread only: SIGINT/SIGTERM stop the ranks first, then take effect
        store = loopback_store()
        ranks: Ranks | None = None
        deadline = None if timeout is None else time.monotonic() + timeout
        rank_args = [
            (fn, args, rank, layout, store.port, {**option_kwargs, "device_maps": maps_by_worker.get(names[rank])},
             shutdown_timeout, watching)
            for rank in range(world_size)
        ]
        try:
            stop.raise_if_received()
            with _environment_lock, _one_thread_unless_set(world_size), \
                    _unless_set("MALLOC_ARENA_MAX", "2"):  # read by the zygote as it starts
                try:
                    ranks = start_world(rank_args, names)  # pickles first: nothing started if that fails
                except Exception as exc:
                    _raise_if_unsendable(args, exc)
                    raise
            if progress is not None:
                progress(f"started {world_size} processes ({', '.join(names)}), forked from one that imports "
                         f"torch once; each then joins the RPC world")
            values = _collect(ranks, names, deadline, timeout, stop, _JoinReporter(names, progress, progress_every),
                              spared)
        finally:
            if ranks is not None:
                _stop(ranks, stop_grace, hurry=lambda: stop.received is not None)
                ranks.close()
            del store
    return [values[r] for r in range(world_size)]


_IMPORTABLE = (
    "each rank imports the function by its module and name, so it must be defined at the top "
    "level of a module the ranks can import (the script run as __main__ counts, with its "
    "run_local call under `if __name__ == \"__main__\":`), not a lambda, a function nested in "
    "another or a method of a local class; pass what it needs through args=(...)"
)


def _check_importable(fn: Any) -> None:
    """Raise ``TypeError`` unless the ranks can import ``fn`` (it pickles by reference, and not
    to ``__main__`` of a session that has no file for the ranks to run: ``python -c``, stdin, a
    notebook). Checked in the caller, before any process starts."""
    if not callable(fn):
        raise TypeError(f"run_local's fn must be callable, got {fn!r}")
    modules: set[str | None] = set()
    from_main: set[str] = set()  # the top-level names in __main__ that fn refers to

    class Recorder(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__"):
                module = getattr(obj, "__module__", None)
                modules.add(module)
                if module == "__main__":
                    from_main.add(str(obj.__qualname__).split(".")[0])
            return NotImplemented

    try:
        Recorder(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(fn)
    except Exception as exc:
        raise TypeError(
            f"run_local cannot send fn {_callable_name(fn)} to its ranks ({type(exc).__name__}: {exc}): "
            f"{_IMPORTABLE}"
        ) from None
    main = sys.modules.get("__main__")
    if "__main__" in modules and main is not None and not _main_importable(main):
        raise TypeError(
            f"run_local cannot send fn {_callable_name(fn)} to its ranks: it is (or refers to) code defined "
            f"in __main__ of a session that has no file the ranks could import (python -c, stdin, a "
            f"notebook); put it in a file, a module or the script you run, and import it from there"
        )
    guarded = sorted(from_main - _main_top_level_names(main)) if from_main and main is not None else []
    if guarded:
        raise TypeError(
            f"run_local cannot send fn {_callable_name(fn)} to its ranks: {', '.join(guarded)} is defined under "
            f"`if __name__ == \"__main__\":` in {main.__file__}, which the ranks do not run (each imports the "
            f"script as __mp_main__, as a spawned process does); define it at the script's top level"
        )


def _main_top_level_names(main: Any) -> set[str]:
    """The names the script run as ``__main__`` binds at its top level outside an
    ``if __name__ == "__main__":`` block (what a rank importing it has); every name of
    ``main`` when that cannot be told (no source file, a star import)."""
    everything = set(vars(main))
    path = getattr(main, "__file__", None)
    try:
        with open(path, encoding="utf-8") as f:  # type: ignore[arg-type]
            tree = ast.parse(f.read())
    except (OSError, TypeError, SyntaxError, ValueError):
        return everything

    def is_main_guard(test: ast.expr) -> bool:
        return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
                and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
                and test.comparators[0].value == "__main__")

    names: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return everything
        if isinstance(node, ast.If) and is_main_guard(node.test):
            body += node.orelse
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
            continue
        stores = [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
        if isinstance(node, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try)):
            # a block: its statements bind at the top level too (the walk above over-counts names
            # bound inside functions defined in it: that only lets more through)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    body.append(child)
                elif isinstance(child, ast.excepthandler):
                    body += child.body
        names.update(stores)
    return names


def _main_importable(main: Any) -> bool:
    """Whether a rank can import ``main`` as ``__mp_main__``, as ``multiprocessing`` decides
    (``-m`` module name or the script's file)."""
    name = getattr(getattr(main, "__spec__", None), "name", None)
    return name is not None or getattr(main, "__file__", None) is not None


def _callable_name(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if name is None:
        return repr(fn)
    return f"{module}.{name}" if module else name


def _raise_if_unsendable(args: tuple, exc: Exception) -> None:
    """When ``args`` cannot be pickled (the reason ``exc`` was raised), a ``TypeError`` naming
    the offending argument; otherwise nothing."""
    try:
        pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        where, culprit = _first_unpicklable(args, "args")
        what = _callable_name(culprit) if callable(culprit) else f"of type {_type_name(culprit)}"
        raise TypeError(
            f"run_local cannot send {where} ({what}) to its ranks: it cannot be pickled "
            f"({type(exc).__name__}: {exc}); a function or class passed in args must be defined at "
            f"the top level of a module the ranks can import, and other values must be picklable"
        ) from None


#: Held while a world's zygote starts with the environment ``_one_thread_unless_set`` made
#: (two run_local calls in two threads would otherwise see and undo each other's setting).
_environment_lock = threading.Lock()


@contextlib.contextmanager
def _one_thread_unless_set(world_size: int) -> Iterator[None]:
    """``OMP_NUM_THREADS=1`` in this process's environment while the ranks start (a spawned
    process gets the environment as it is at its start), as torchrun sets it for more than one
    process per machine, unless the caller has set it; the caller's environment afterwards."""
    if world_size < 2:
        yield
        return
    with _unless_set("OMP_NUM_THREADS", "1"):
        yield


@contextlib.contextmanager
def _unless_set(name: str, value: str) -> Iterator[None]:
    """``name=value`` in this process's environment meanwhile, unless the caller has set it."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def _collect(
    ranks: Ranks, names: list[str], deadline: float | None, timeout: float | None,
    stop: StopSignals, joins: _JoinReporter, spared: set[int] | frozenset[int] = frozenset(),
) -> dict[int, Any]:
    """Every rank's value by rank; raises for the first rank that fails or exits without one,
    unless it is one of the ``spared`` ranks (of an expendable role): that one's value is None."""
    values: dict[int, Any] = {}

    def lose(rank: int, why: str) -> None:
        _log.warning("rank %d (%s), of an expendable role, is lost: %s; the world goes on", rank, names[rank], why)
        values[rank] = None
        joins.lost(rank)
    while len(values) < len(names) or ranks.any_alive():
        stop.raise_if_received()
        joins.tick(ranks.alive())
        try:
            status, rank, payload = ranks.get(timeout=0.2)
        except queue.Empty:
            gone = [r for r in range(len(names)) if r not in values and ranks.exitcode(r) is not None]
            if not gone:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"local world {names} did not finish within {timeout} s") from None
                continue
            try:  # a rank sends its result before it exits: read what is still in the pipe
                status, rank, payload = ranks.get(timeout=0.5)
            except queue.Empty:
                stop.raise_if_received()  # the ranks got the caller's Ctrl-C too: not a failure
                r = gone[0]
                if r in spared:
                    lose(r, ranks.exit_text(r))
                    continue
                raise LocalWorldError(r, names[r], ranks.exit_text(r)) from None
        if status in ("joined", "returned"):
            joins.mark(status, rank)
            continue
        if status == "lost":  # a peer's heartbeats lost this rank: it may be frozen, never exiting
            if rank in spared and rank not in values:
                ranks.kill(rank)
                lose(rank, payload)
            continue
        if status in ("error", "interrupted"):
            # A terminal's Ctrl-C reaches the caller and every rank at once: what the ranks
            # report then (their KeyboardInterrupt, a peer gone) is the stop, not a failure.
            stop.raise_if_received()
            if status == "interrupted":
                raise LocalWorldError(rank, names[rank], payload, interrupted=True)
            if rank in spared:
                lose(rank, f"it failed:\n{payload}")
                continue
            _log.error("rank %d (%s) failed:\n%s", rank, names[rank], payload)
            raise LocalWorldError(rank, names[rank], payload)
        joins.done(rank)
        try:
            values[rank] = pickle.loads(payload)
        except Exception as exc:
            raise LocalWorldError(
                rank, names[rank],
                f"its result could not be unpickled in the caller ({type(exc).__name__}: {exc}); "
                f"return values whose classes the caller can import (not ones defined in the "
                f"script run as __main__)",
            ) from exc
    return values


class _JoinReporter:
    """``run_local``'s progress messages about ranks joining the RPC world (none without a
    ``progress`` callable)."""

    def __init__(self, names: list[str], progress: Callable[[str], None] | None, every: float) -> None:
        self.names = names
        self.progress = progress
        self.every = every
        self.start = self.last = time.monotonic()
        self.unjoined = set(range(len(names)))
        self.running = set(range(len(names)))
        self.stopping: set[int] | None = None  # the ranks not done shutting down, once all returned
        self.exiting = False  # every result is in; the processes are exiting

    def mark(self, status: str, rank: int) -> None:
        """A rank joined the world or its ``fn`` returned."""
        now = time.monotonic()
        if status == "joined":
            self.unjoined.discard(rank)
            if not self.unjoined:
                self._say(f"all {len(self.names)} ranks joined the RPC world ({now - self.start:.1f} s)")
        else:
            self.running.discard(rank)
            if not self.running:
                self.stopping, self.start = set(range(len(self.names))), now
                self._say(f"all {len(self.names)} ranks returned; shutting the RPC world down")

    def lost(self, rank: int) -> None:
        """A rank is gone without a result (of an expendable role: the world goes on)."""
        self.unjoined.discard(rank)
        self.mark("returned", rank)
        self.done(rank)

    def done(self, rank: int) -> None:
        """A rank finished its shutdown (its result arrived)."""
        if self.stopping is not None:
            self.stopping.discard(rank)
            if not self.stopping and not self.exiting:
                self.exiting, self.start = True, time.monotonic()

    def tick(self, alive: list[int]) -> None:
        """Say which ranks have not joined (shut down, exited) yet, at most every ``every`` s;
        ``alive``: the ranks whose processes still run."""
        now = time.monotonic()
        if now - self.last < self.every:
            return
        if self.unjoined:
            missing, what = self.unjoined, "join the RPC world"
        elif self.stopping:
            missing, what = self.stopping, "shut down"
        elif self.exiting and alive:
            missing, what = set(alive), "exit"
        else:
            return
        names = ", ".join(self.names[r] for r in sorted(missing))
        self._say(f"waiting for {names} to {what} ({now - self.start:.0f} s)")

    def _say(self, message: str) -> None:
        self.last = time.monotonic()
        if self.progress is not None:
            self.progress(message)


def _stop(ranks: Ranks, grace: float, hurry: Callable[[], bool]) -> None:
    """Give the ranks ``grace`` seconds to exit (none once ``hurry()``), then terminate, then kill."""
    deadline = time.monotonic() + grace
    while ranks.any_alive() and time.monotonic() < deadline and not hurry():
        ranks.reap(0.05)
    if ranks.any_alive():
        ranks.signal(signal.SIGTERM)
        if not ranks.reap(2.0):
            ranks.signal(signal.SIGKILL)
            ranks.reap(5.0)
