"""One build per world: every rank of an RPC world must run the same build of the packages
whose functions and classes travel by name.

**Why.** A Python call over ``torch.distributed.rpc`` pickles its function (and every class of
its arguments and answer) by reference: ``module.qualified_name``. A rank running another build
of a package (another version, another checkout, a handler moved or renamed) cannot find what
the others send, and fails deep inside the call with an ``AttributeError`` from unpickling. So
the builds are compared before any such call, and a mismatch fails with :class:`BuildMismatch`,
naming every build in the world and which rank (worker, machine) runs which, and the fix:
install one build on every machine.

**What is compared.** A package declares itself with :func:`declare_build` when it is imported
(``rpc_backend`` here, ``remote_module`` in its ``__init__``): its version, and what can travel
(by default the shape of its source, read from its files with ``ast``, not imported: every
function's and method's name and parameters, every class's name and annotated fields; see
rpc_backend/_wire_names.py for what counts and what does not). Its *wire fingerprint* is a
SHA-256 of the version and those shapes, sorted (:func:`fingerprint`): the same in every
process of one build, whatever the hash seed, and different once a handler moves, gains a
parameter, or a NamedTuple that travels gains a field. A private helper added changes it too
(the source cannot tell what travels): such builds are refused although they would work. Where
a package sits on disk is reported but not compared: two checkouts of one build are one build.

**When.**

* A world formed by :func:`~rpc_backend.init_from_env` (torchrun): right after ``init_rpc``,
  every rank writes its builds to the job's store and reads every other's
  (:func:`check_world`); on a mismatch every rank leaves RPC at once (``rpc.shutdown(graceful=
  False)``) and raises :class:`BuildMismatch` with the same report. A package imported on some
  ranks only (a server that imports nothing before its first call) is imported by name on the
  others for the comparison, so such a rank fails too. *The bound:* the comparison ends before
  the join's ``connect_timeout`` (:data:`~rpc_backend.connect.BUILDS_MARGIN_S` before it, so
  that its own error is the one raised); a rank that has not published its build is called
  (``len(())``, which any build runs; it is looked at every :data:`WAIT_SLICE_S` at most), and once
  that call fails (the rank died: its connection is refused or closed) every other rank fails
  at once, naming it; a stopped or hung rank is named when the bound passes. Either way RPC is
  shut down on every rank that raises. ``run_local`` forks every rank from one process: one
  build by construction, nothing to compare.
* A world formed with plain ``rpc.init_rpc``: :func:`check_peer` asks each peer once per world
  for its builds (one round trip, :func:`answer_builds` on the peer), at the first call that
  ``remote_module`` makes to it (its fan-out calls, which create every remote object, and each
  call of a proxy), and raises :class:`BuildMismatch` there; concurrent first calls share the
  one question, and a mismatch found holds for every later call to that peer in this world. It
  waits at most the call's own timeout on the caller's thread. On a thread that torch's RPC
  agent runs (a handler making a call in turn) it never waits, since a handler thread that
  blocks can starve the pool that would answer: the question is sent, and its answer decides
  every later call to that peer (a mismatch is logged when it arrives).
* Packages declared after the world formed (imported later) were not compared then: each
  peer is asked about them once, at the next call to it, as in a plain ``init_rpc`` world.

A world is told from the next by ``rpc.init_rpc`` itself (a hook run when torch sets the new
agent, rpc_backend/_torch_private.py): everything known of a world's peers is dropped then.

:func:`answer_builds` is what another build calls here by name: it stays at
``rpc_backend.builds.answer_builds``, and speaks in plain dicts and strings, which any build can
read. A peer whose build has no such function (older than this module) is reported as a
mismatch too.

Example (a package of one's own whose handlers travel over RPC; in its ``__init__``)::

    from rpc_backend.builds import declare_build
    __version__ = "1.2.0"
    declare_build("mypackage", __version__)
"""

from __future__ import annotations

import importlib
import json
import logging
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed.rpc as rpc

from rpc_backend._torch_private import after_each_rpc_init, is_rpc_initialized
from rpc_backend._wire_names import defined_names, fingerprint

_log = logging.getLogger(__name__)
#: torch's own ``rpc_async``, taken at import: the question to a peer is no call of the job's,
#: so counters that wrap ``rpc.rpc_async`` later (:class:`~rpc_backend.Traffic`, tests) skip it
_rpc_async = rpc.rpc_async

#: What every report of a mismatch tells the user to do.
FIX = ("install one build of the package on every machine (the same version, from the same wheel or "
       "checkout; check PYTHONPATH and the working directory on each) and start the job again")


class BuildMismatch(RuntimeError):
    """Ranks of one RPC world run different builds of a package whose names travel by
    reference; the message names each build (version, wire fingerprint, where it sits) and the
    ranks that run it."""


class Build(NamedTuple):
    """One package's build in one process (sent as a plain dict, see :meth:`as_dict`)."""

    package: str
    version: str | None
    #: :func:`fingerprint` of the version and the names that can travel ("" with ``error``)
    fingerprint: str
    #: the directory the package was imported from
    location: str
    #: why this process has no build of the package to compare ("" when it has one)
    error: str = ""

    def as_dict(self) -> dict:
        return self._asdict()

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Build:
        return cls(**{k: raw.get(k, "") for k in cls._fields})

    def key(self) -> tuple:
        """What two builds must share to be one (not where they sit)."""
        return (self.version, self.fingerprint, self.error)

    def describe(self) -> str:
        if self.error:
            return f"no build of {self.package} ({self.error})"
        version = f" {self.version}" if self.version else ""
        return f"{self.package}{version} (wire {self.fingerprint}, from {self.location})"


# -- this process's builds ------------------------------------------------------------------------


class _Declared(NamedTuple):
    version: str | None
    names: Callable[[], Iterable[str]] | None


_lock = threading.Lock()
_declared: dict[str, _Declared] = {}
_builds: dict[str, Build] = {}  # computed once per package


def declare_build(package: str, version: str | None, names: Callable[[], Iterable[str]] | None = None) -> None:
    """Declare that ``package`` (imported, or being imported) sends names by reference over
    RPC, so that every rank of a world must run the same build of it. ``names`` returns the
    names that can travel (default: :func:`defined_names` of the package's source, read the
    first time a world needs them, not at import).

    Example (in the package's ``__init__``, after ``__version__``)::

        declare_build("mypackage", __version__)
    """
    with _lock:
        _declared[package] = _Declared(version, names)
        _builds.pop(package, None)
    with _peer_lock:  # declared after the world formed: each peer is asked about it once
        if package not in _world.formed and _world.formed is not EVERY_PACKAGE:
            _world.checked.clear()


def _location(package: str) -> Path | None:
    module = sys.modules.get(package)
    paths = list(getattr(module, "__path__", None) or [])
    if paths:
        return Path(paths[0])
    file = getattr(module, "__file__", None)
    return Path(file).parent if file else None


def _build(package: str) -> Build:
    declared = _declared[package]
    root = _location(package)
    if declared.names is not None:
        names = list(declared.names())
    else:
        names = defined_names(package, root) if root is not None else []
    return Build(package, declared.version, fingerprint(declared.version, names), str(root or "unknown"))


def local_builds(packages: Iterable[str] | None = None) -> dict[str, Build]:
    """This process's :class:`Build` of each of ``packages`` (default: every declared one). A
    package not declared yet is imported by name first (its ``__init__`` declares it); one that
    cannot be imported, or declares nothing, gets a build with ``error`` saying why."""
    wanted = sorted(_declared) if packages is None else sorted(set(packages))
    found: dict[str, Build] = {}
    for package in wanted:
        if package not in _declared:
            try:
                importlib.import_module(package)
            except Exception as exc:  # noqa: BLE001 - reported as this rank's build
                found[package] = Build(package, None, "", "", f"cannot import it here: {type(exc).__name__}: {exc}")
                continue
        with _lock:
            if package not in _declared:
                found[package] = Build(package, None, "", str(_location(package) or "unknown"),
                                       "this build of it declares no build: older than rpc_backend/builds.py")
                continue
            if package not in _builds:
                _builds[package] = _build(package)
            found[package] = _builds[package]
    return found


def answer_builds(packages: Sequence[str]) -> dict:
    """What a peer answers :func:`check_peer`: ``{"host": ..., "builds": {package: Build as a
    dict}}`` for ``packages`` and every package declared here. Other builds call it by this
    name: it never moves, and it answers in plain dicts and strings."""
    wanted = set(packages) | set(_declared)
    return {"host": socket.gethostname(), "builds": {p: b.as_dict() for p, b in local_builds(wanted).items()}}


# -- comparing ------------------------------------------------------------------------------------


class RankBuilds(NamedTuple):
    """Who runs which builds, for a report: ``who`` reads like ``rank 1 (ps0) on node1``."""

    who: str
    builds: Mapping[str, Build]


def mismatch(ranks: Sequence[RankBuilds], packages: Iterable[str] | None = None) -> str | None:
    """The report of the builds that differ among ``ranks`` (for each of ``packages``, default:
    every package any rank has), or ``None`` when every rank runs one build of each. A rank
    without a package at all counts as a build of its own.

    Example::

        mismatch([RankBuilds("rank 0 (ps0) on a", {"pkg": b1}), RankBuilds("rank 1 (t0) on b", {"pkg": b2})])
        # "the ranks of this RPC world run different builds of pkg: pkg 1.0 (wire ..., from ...)
        #  on rank 0 (ps0) on a; pkg 1.1 (wire ..., from ...) on rank 1 (t0) on b. ..."
    """
    if packages is None:
        packages = {p for rank in ranks for p in rank.builds}
    parts: list[str] = []
    differing: list[str] = []
    for package in sorted(set(packages)):
        groups: dict[tuple, tuple[Build, list[str]]] = {}
        for rank in ranks:
            build = rank.builds.get(package) or Build(package, None, "", "", "not reported")
            groups.setdefault(build.key(), (build, []))[1].append(rank.who)
        if len(groups) > 1:
            differing.append(package)
            parts += [f"{build.describe()} on {', '.join(who)}" for build, who in groups.values()]
    if not differing:
        return None
    return (f"the ranks of this RPC world run different builds of {', '.join(differing)}: {'; '.join(parts)}. "
            "A call over RPC names its function and classes by module and name, so a rank of another build "
            f"cannot run what the others send (it would fail unpickling it, with an AttributeError). To fix: {FIX}")


# -- a world formed through rpc_backend: the job's store ------------------------------------------

BUILDS_KEY = "builds/{round}/{rank}"
READ_KEY = "builds/read/{rank}"
#: The longest pause between two looks at the ranks still missing (whether they published, or
#: a call to them failed: a rank whose RPC connection failed has died, no need to wait longer).
WAIT_SLICE_S = 0.5


def _probe(name: str) -> Any:
    """Ask worker ``name`` for its builds (:func:`answer_builds`), with no timeout: it fails at
    once when the worker's RPC is gone (connection refused, EOF) or when the worker runs a build
    older than this module (it cannot unpickle the question), and never ends while the worker
    is stopped or hung. None where RPC is not running (no worker to ask)."""
    if not is_rpc_initialized():
        return None
    try:
        return _rpc_async(name, answer_builds, ([],), timeout=0)
    except Exception as exc:  # noqa: BLE001 - the agent refuses it: the worker is unknown or gone
        failed: Any = torch.futures.Future()
        failed.set_exception(exc)
        return failed


#: Words of the error a worker answers when it cannot find :func:`answer_builds` (its build
#: predates this module, or moved it)
_OLDER_BUILD_SIGNS = ("answer_builds", "rpc_backend.builds", "Can't get attribute", "No module named")


def _gone(probes: dict[int, Any], rank: int, name: str, probe: Callable[[str], Any]) -> str | None:
    """Why rank ``rank`` cannot take part (its probe failed: it died, or runs an older build),
    or None while nothing says so."""
    if rank not in probes:
        probes[rank] = probe(name)
    sent = probes[rank]
    if sent is None or not sent.done():
        return None
    try:
        sent.wait()
    except Exception as exc:  # noqa: BLE001 - the verdict
        text = str(exc).strip()
        first = (text.splitlines() or [type(exc).__name__])[0]
        if any(sign in text for sign in _OLDER_BUILD_SIGNS):
            return f"{rank} ({name}) runs an older build: it cannot answer rpc_backend.builds.answer_builds ({first})"
        return f"{rank} ({name}) died or shut down: {first}"
    return None


def _await_keys(store: Any, keys: Sequence[str], names: Sequence[str], deadline: float,
                probe: Callable[[str], Any]) -> tuple[list[int], list[str]]:
    """Wait until every rank's key is in ``store``: ``([], [])``. Else the ranks still missing
    when ``deadline`` (``time.monotonic()``) passes, ``(silent, [])``, or as soon as a call to
    one of them fails, ``(silent, why each is gone)``. Looks at the store in pauses that grow
    to :data:`WAIT_SLICE_S` (a timed-out ``store.wait`` would log a warning each time)."""
    probes: dict[int, Any] = {}
    pending = list(range(len(keys)))
    pause = 0.01
    while True:
        pending = [r for r in pending if not store.check([keys[r]])]
        if not pending:
            return [], []
        gone = [why for why in (_gone(probes, r, names[r], probe) for r in pending) if why]
        if gone or time.monotonic() >= deadline:
            return pending, gone
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, WAIT_SLICE_S)


def _publish_and_read(store: Any, round_: int, rank: int, names: Sequence[str], mine: Mapping[str, Build],
                      deadline: float, timeout: float, probe: Callable[[str], Any]) -> list[RankBuilds]:
    store.set(BUILDS_KEY.format(round=round_, rank=rank),
              json.dumps({"host": socket.gethostname(), "builds": {p: b.as_dict() for p, b in mine.items()}}))
    keys = [BUILDS_KEY.format(round=round_, rank=r) for r in range(len(names))]
    silent, gone = _await_keys(store, keys, names, deadline, probe)
    me = f"rank {rank} ({names[rank]}) cannot join: "
    if gone:
        raise BuildMismatch(f"{me}rank(s) cannot take part in comparing the builds (a call to each failed): "
                            f"{'; '.join(gone)}. See each one's output; to fix an older build: {FIX}")
    if silent:
        raise BuildMismatch(
            f"{me}rank(s) {', '.join(f'{r} ({names[r]})' for r in silent)} published no build within {timeout:.0f} s "
            "of joining: each runs a build of rpc_backend older than rpc_backend/builds.py, or is stopped or hung "
            f"(see its output). To fix an older build: {FIX}")
    ranks = []
    for r, key in enumerate(keys):
        raw = json.loads(store.get(key))
        builds = {p: Build.from_dict(b) for p, b in raw["builds"].items()}
        ranks.append(RankBuilds(f"rank {r} ({names[r]}) on {raw['host']}", builds))
    return ranks


def check_world(store: Any, rank: int, world_size: int, names: Sequence[str], timeout: float,
                builds: Callable[[Iterable[str] | None], Mapping[str, Build]] = local_builds,
                probe: Callable[[str], Any] = _probe) -> frozenset[str]:
    """Compare this world's builds through ``store`` (a store every rank shares, under a prefix
    of this world's own) and return the packages compared; raise :class:`BuildMismatch` on
    every rank when they differ, or when a rank publishes none within ``timeout`` seconds (an
    older build, or a stopped rank), or as soon as a rank that has not published is seen gone
    (a call to it, ``probe(name)``, fails: it died).

    Round 1: each rank publishes the builds it has declared. When not every rank declared the
    same packages, every rank sees so and runs round 2 with every package any rank declared
    (importing the ones it lacks). On a mismatch each rank says it has read the others', and
    waits (within ``timeout``) for all to have read before it raises: a rank that hosts the
    store stays until every rank has its report. ``builds`` gives this rank's builds (tests
    pass their own).
    """
    deadline = time.monotonic() + timeout
    ranks = _publish_and_read(store, 1, rank, names[:world_size], builds(None), deadline, timeout, probe)
    declared = [set(r.builds) for r in ranks]
    every = set().union(*declared)
    if any(d != declared[0] for d in declared):
        ranks = _publish_and_read(store, 2, rank, names[:world_size], builds(every), deadline, timeout, probe)
    report = mismatch(ranks)
    if report is None:
        return frozenset(every)
    store.set(READ_KEY.format(rank=rank), "1")
    # a rank that never reads: the report is raised here all the same
    _await_keys(store, [READ_KEY.format(rank=r) for r in range(world_size)], names, deadline, probe)
    raise BuildMismatch(f"rank {rank} ({names[rank]}) cannot join: {report}")


# -- a world formed with plain rpc.init_rpc: each peer once ----------------------------------------


class _Question:
    """One question to a peer about ``packages``: sent once, answered once (``event``), with
    ``failure`` on a mismatch."""

    def __init__(self, packages: frozenset[str]) -> None:
        self.packages = packages
        self.event = threading.Event()
        self.failure: str | None = None
        #: a caller waited its whole bound in vain: later callers do not wait (a frozen peer
        #: would otherwise cost each first call its timeout twice)
        self.gave_up = False


#: ``formed`` when every package is one build by construction (the ranks were forked from one process)
EVERY_PACKAGE = frozenset({"*"})


class _World:
    """What this process knows of the builds of one RPC world (a new one per ``rpc.init_rpc``)."""

    def __init__(self) -> None:
        #: peers that run this build of every package declared here: the fast path, read without a lock
        self.checked: set[str] = set()
        #: the question to each peer: in flight, answered (its packages now in ``compared``), or failed
        self.asked: dict[str, _Question] = {}
        #: the packages each peer was found to run this build of
        self.compared: dict[str, frozenset[str]] = {}
        #: the packages every rank was compared on when the world formed
        self.formed: frozenset[str] = frozenset()

    def unchecked(self, name: str) -> frozenset[str]:
        """The packages declared here that ``name`` was not compared on yet."""
        if self.formed is EVERY_PACKAGE:
            return frozenset()
        with _lock:
            declared = frozenset(_declared)
        return declared - self.formed - self.compared.get(name, frozenset())


_peer_lock = threading.Lock()
_world = _World()


def _new_world() -> None:
    """A new RPC world began here (``rpc.init_rpc``): nothing of the last one holds in it."""
    global _world
    with _peer_lock:
        _world = _World()


after_each_rpc_init(_new_world)


def world_checked(packages: Iterable[str] | None = None) -> None:
    """Note that the current world's ranks run one build of ``packages`` (compared when it
    formed; ``None``: of every package, the ranks being forked from one process):
    :func:`check_peer` then asks nobody about them. A package first declared later is asked
    about once per peer."""
    with _peer_lock:
        _world.formed = EVERY_PACKAGE if packages is None else frozenset(packages)
        _world.checked.clear()


def peer_checked(name: str) -> bool:
    """True once worker ``name`` is known to run this build of every package declared here (in
    the current world): a set lookup, for a caller that would otherwise compute
    :func:`check_peer`'s arguments at every call."""
    return name in _world.checked


def _may_wait() -> bool:
    """False on a thread Python did not start (torch's RPC agent's handler threads)."""
    return not isinstance(threading.current_thread(), getattr(threading, "_DummyThread", ()))


def check_peer(name: str, seconds: float | None = None) -> None:
    """Raise :class:`BuildMismatch` when worker ``name`` runs another build of a declared
    package. The first call per peer (in each world, and again for a package declared later)
    asks it (:func:`answer_builds`, one round trip; concurrent first calls share the one
    question) and waits at most ``seconds`` (default: the RPC agent's timeout) for the answer,
    on a thread that may wait (see the module docstring); later calls cost a set lookup. When
    no answer comes in time the call goes ahead, and the answer, when it comes, decides later
    calls; a mismatch found holds for every later call in this world.

    Example (before a call of one's own to a peer)::

        check_peer("worker1", seconds=10)
        rpc.rpc_async("worker1", mypackage.handlers.run, (x,))
    """
    if name in _world.checked:
        return
    question = _ask(name)
    if question is None:
        return
    if not question.event.is_set() and not question.gave_up and _may_wait():
        question.gave_up = not question.event.wait(_wait_seconds(seconds))
    if question.failure is not None:
        raise BuildMismatch(question.failure)


def _wait_seconds(seconds: float | None) -> float | None:
    if seconds is None:
        seconds = rpc.get_rpc_timeout()
        seconds = None if seconds <= 0 else seconds
    return None if seconds is None or seconds == float("inf") else max(0.0, seconds)


def _ask(name: str) -> _Question | None:
    """The peer's question, sent now if it was not; None when there is nothing to check."""
    world = _world
    if not is_rpc_initialized():
        return None
    with _peer_lock:
        question = world.asked.get(name)
        if question is not None and (question.failure is not None or not question.event.is_set()):
            return question  # in flight (shared), or a mismatch this world remembers
        wanted = world.unchecked(name)
        if not wanted or world is not _world or name == rpc.get_worker_info().name:
            world.checked.add(name)
            return None
        mine = local_builds(wanted)
        question = world.asked[name] = _Question(wanted)
    try:
        sent = _rpc_async(name, answer_builds, (sorted(mine),), timeout=0)
    except Exception:  # noqa: BLE001 - RPC shutting down, an unknown name: the call says so itself
        with _peer_lock:
            if world.asked.get(name) is question:
                del world.asked[name]
        question.event.set()
        return None
    sent.add_done_callback(lambda fut: _answered(name, world, mine, question, fut))
    return question


#: what torch says when a peer cannot unpickle a call to rpc_backend.builds (a build without it)
_NO_CHECK = ("answer_builds", "rpc_backend.builds")


def _verdict(name: str, mine: Mapping[str, Build], fut: Any) -> str | None:
    """The report of the peer's answer in ``fut`` (None: one build); raises when the question
    itself failed (a dead peer, a shutdown)."""
    me = f"{rpc.get_worker_info().name} (this process) on {socket.gethostname()}" if is_rpc_initialized() \
        else "this process"
    try:
        answer = fut.value()
    except Exception as exc:
        if not any(marker in str(exc) for marker in _NO_CHECK):
            raise
        first = next(line.strip() for line in str(exc).splitlines() if any(m in line for m in _NO_CHECK))
        return (f"it runs a build of rpc_backend that cannot answer rpc_backend.builds.answer_builds (one "
                f"older than that check; there: {first}), unlike this process's "
                f"{', '.join(b.describe() for b in mine.values())}. To fix: {FIX}")
    theirs = {p: Build.from_dict(b) for p, b in answer["builds"].items()}
    return mismatch([RankBuilds(me, mine), RankBuilds(f"{name} on {answer['host']}", theirs)], mine)


def _answered(name: str, world: _World, mine: Mapping[str, Build], question: _Question, fut: Any) -> None:
    """The peer's answer (on an RPC thread): its verdict, for every call to it in ``world``."""
    try:
        report = _verdict(name, mine, fut)
    except Exception:  # noqa: BLE001 - a dead peer, a shutdown: ask again at the next first call
        report = None
        with _peer_lock:
            if world.asked.get(name) is question:
                del world.asked[name]
    else:
        with _peer_lock:
            if report is None:
                world.compared[name] = world.compared.get(name, frozenset()) | question.packages
                if not world.unchecked(name):
                    world.checked.add(name)
            else:
                question.failure = f"worker {name!r} cannot be called: {report}"
    if report is not None:
        _log.error("%s", question.failure)
    question.event.set()


declare_build("rpc_backend", None)
