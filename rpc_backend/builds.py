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
  (:func:`check_world`); on a mismatch every rank leaves RPC at once and raises
  :class:`BuildMismatch` with the same report. A package imported on some ranks only (a server
  that imports nothing before its first call) is imported by name on the others for the
  comparison, so such a rank fails too. ``run_local`` forks every rank from one process: one
  build by construction, nothing to compare.
* A world formed with plain ``rpc.init_rpc``: :func:`check_peer` asks each peer once per process
  for its builds (one round trip, :func:`answer_builds` on the peer), at the first call that
  ``remote_module`` makes to it (its fan-out calls, which create every remote object, and a
  proxy's first lookup of its host), and raises :class:`BuildMismatch` there. It waits at most the
  call's own timeout on the caller's thread. On a thread that torch's RPC agent runs (a handler
  making a call in turn) it never waits, since a handler thread that blocks can starve the
  pool that would answer: the question is sent, and its answer decides every later call to
  that peer (a mismatch is logged when it arrives). A world whose ranks all checked one peer
  needs no check between the others: a build equal to a third is equal to it.

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
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import torch.distributed as dist
import torch.distributed.rpc as rpc

from rpc_backend._torch_private import current_agent_token, is_rpc_initialized
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


def _publish_and_read(store: Any, round_: int, rank: int, world_size: int, names: Sequence[str],
                      mine: Mapping[str, Build], timeout: float) -> list[RankBuilds]:
    host = socket.gethostname()
    store.set(BUILDS_KEY.format(round=round_, rank=rank),
              json.dumps({"host": host, "builds": {p: b.as_dict() for p, b in mine.items()}}))
    keys = [BUILDS_KEY.format(round=round_, rank=r) for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=max(0.001, timeout)))
    except dist.DistStoreError as exc:
        if "timeout" not in str(exc).lower():
            raise
        silent = [f"{r} ({names[r]})" for r, key in enumerate(keys) if not store.check([key])]
        raise BuildMismatch(
            f"rank {rank} ({names[rank]}) cannot join: rank(s) {', '.join(silent)} published no build within "
            f"{timeout:.0f} s of joining: each runs a build of rpc_backend older than rpc_backend/builds.py, or "
            f"died (see its output). To fix an older build: {FIX}"
        ) from None
    ranks = []
    for r, key in enumerate(keys):
        raw = json.loads(store.get(key))
        builds = {p: Build.from_dict(b) for p, b in raw["builds"].items()}
        ranks.append(RankBuilds(f"rank {r} ({names[r]}) on {raw['host']}", builds))
    return ranks


def check_world(store: Any, rank: int, world_size: int, names: Sequence[str], timeout: float,
                builds: Callable[[Iterable[str] | None], Mapping[str, Build]] = local_builds) -> None:
    """Compare this world's builds through ``store`` (a store every rank shares, under a prefix
    of this world's own); raise :class:`BuildMismatch` on every rank when they differ, or when
    a rank publishes none within ``timeout`` seconds (an older build, or a dead rank).

    Round 1: each rank publishes the builds it has declared. When not every rank declared the
    same packages, every rank sees so and runs round 2 with every package any rank declared
    (importing the ones it lacks). On a mismatch each rank says it has read the others', and
    waits (within ``timeout``) for all to have read before it raises: a rank that hosts the
    store stays until every rank has its report. ``builds`` gives this rank's builds (tests
    pass their own).
    """
    ranks = _publish_and_read(store, 1, rank, world_size, names, builds(None), timeout)
    declared = [set(r.builds) for r in ranks]
    if any(d != declared[0] for d in declared):
        every = set().union(*declared)
        ranks = _publish_and_read(store, 2, rank, world_size, names, builds(every), timeout)
    report = mismatch(ranks)
    if report is None:
        return
    store.set(READ_KEY.format(rank=rank), "1")
    try:
        store.wait([READ_KEY.format(rank=r) for r in range(world_size)], timedelta(seconds=max(0.001, timeout)))
    except dist.DistStoreError:
        pass  # a rank that never reads: the report is raised here all the same
    raise BuildMismatch(f"rank {rank} ({names[rank]}) cannot join: {report}")


# -- a world formed with plain rpc.init_rpc: each peer once ----------------------------------------


class _Question:
    """One peer's check: sent once, answered once (``event``), with ``failure`` on a mismatch."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.failure: str | None = None
        #: a caller waited its whole bound in vain: later callers do not wait (a frozen peer
        #: would otherwise cost each first call its timeout twice)
        self.gave_up = False


_peer_lock = threading.Lock()
_checked: set[str] = set()  # peers whose builds match: the fast path, read without the lock
_asked: dict[str, _Question] = {}
_world_token: list[int] = [0]  # the agent the peers above belong to
_formed_token: list[int] = [0]  # the agent of a world rpc_backend formed (checked already)


def world_checked() -> None:
    """Note that the current world's ranks run one build (compared when it formed, or forked
    from one process): :func:`check_peer` then asks nobody."""
    _formed_token[0] = current_agent_token()


def _may_wait() -> bool:
    """False on a thread Python did not start (torch's RPC agent's handler threads)."""
    return not isinstance(threading.current_thread(), getattr(threading, "_DummyThread", ()))


def check_peer(name: str, seconds: float | None = None) -> None:
    """Raise :class:`BuildMismatch` when worker ``name`` runs another build of a declared
    package. The first call per peer (and process) asks it (:func:`answer_builds`, one round
    trip) and waits at most ``seconds`` (default: the RPC agent's timeout) for the answer, on a
    thread that may wait (see the module docstring); later calls cost a set lookup, so a
    later world in this process whose peer has a name checked in an earlier world is not
    asked again (a peer whose question was not answered yet, or failed, is). When no answer
    comes in time the call goes ahead, and the answer, when it comes, decides later calls.

    Example (before a call of one's own to a peer)::

        check_peer("worker1", seconds=10)
        rpc.rpc_async("worker1", mypackage.handlers.run, (x,))
    """
    if name in _checked:
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
    if not is_rpc_initialized():
        return None
    token = current_agent_token()
    with _peer_lock:
        if _world_token[0] != token:  # a new world: what was checked was another's
            _checked.clear()
            _asked.clear()
            _world_token[0] = token
        if token == _formed_token[0] or name == rpc.get_worker_info().name:
            _checked.add(name)
            return None
        question = _asked.get(name)
        if question is not None:
            return question
        mine = local_builds()
        question = _asked[name] = _Question()
    try:
        sent = _rpc_async(name, answer_builds, (sorted(mine),), timeout=0)
    except Exception:  # noqa: BLE001 - RPC shutting down, an unknown name: the call says so itself
        with _peer_lock:
            _asked.pop(name, None)
        question.event.set()
        return None
    sent.add_done_callback(lambda fut: _answered(name, token, mine, question, fut))
    return question


#: what torch says when a peer cannot unpickle a call to rpc_backend.builds (a build without it)
_NO_CHECK = ("answer_builds", "rpc_backend.builds")


def _answered(name: str, token: int, mine: Mapping[str, Build], question: _Question, fut: Any) -> None:
    """The peer's answer (on an RPC thread): its verdict, for every call to it from now on."""
    me = f"{rpc.get_worker_info().name} (this process) on {socket.gethostname()}" if is_rpc_initialized() \
        else "this process"
    try:
        answer = fut.value()
        theirs = {p: Build.from_dict(b) for p, b in answer["builds"].items()}
        report = mismatch([RankBuilds(me, mine), RankBuilds(f"{name} on {answer['host']}", theirs)], mine)
    except Exception as exc:  # noqa: BLE001 - the question itself failed
        if not any(marker in str(exc) for marker in _NO_CHECK):
            with _peer_lock:  # a dead peer, a shutdown: ask again at the next first call
                if _asked.get(name) is question:
                    del _asked[name]
            question.event.set()
            return
        first = next(line.strip() for line in str(exc).splitlines() if any(m in line for m in _NO_CHECK))
        report = (f"it runs a build of rpc_backend that cannot answer rpc_backend.builds.answer_builds (one "
                  f"older than that check; there: {first}), unlike this process's "
                  f"{', '.join(b.describe() for b in mine.values())}. To fix: {FIX}")
    if report is None:
        with _peer_lock:
            if _world_token[0] == token:
                _checked.add(name)
    else:
        question.failure = f"worker {name!r} cannot be called: {report}"
        _log.error("%s", question.failure)
    question.event.set()


declare_build("rpc_backend", None)
