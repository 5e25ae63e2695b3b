"""A lost worker, named in time: every rank hears from every other, servers included.

Why heartbeats over RPC. A parameter server makes no calls of its own and asynchronous
trainers never call each other, so user traffic cannot tell a rank that a peer is gone: a
server would wait in its graceful shutdown for a dead trainer forever. So each rank sends every
peer a small heartbeat (:func:`_beat`, a Python RPC of a few hundred bytes) every ``heartbeat``
seconds over the world's own TensorPipe agent, and records when it last heard from each: a
peer's heartbeat arriving, or a peer's answer to its own. A peer not heard from for
``lost_after`` seconds is lost, whatever the cause: its processes killed (SIGKILL leaves no
time to say goodbye), its machine or its link down (nothing arrives, nothing fails), or its
process frozen. The alternatives were weighed:

* timestamps in the job's store: the store lives on one machine, which may be the lost one
  (then every rank's store call hangs until its own timeout), and every rank would write to
  and poll one server;
* a side channel of its own (UDP): one more port per rank to open, publish and firewall, for
  nothing RPC does not already carry. Heartbeats over RPC need no new port or address, reach
  exactly the peers RPC reaches, and a peer whose RPC no longer answers is lost to the job
  anyway.

The cost: each rank sends N-1 heartbeats a second and answers N-1, plus one to itself
(tests/benchmarks/bench_watch.py measures it; tutorials/torchrun.md has the figures).

A backlog is not silence. Heartbeats, and the answers to a rank's own, are handled by its RPC
threads after every message that arrived before them, so a rank whose threads are busy and
whose queue is long (thousands of short calls, or long handlers) reads its peers' heartbeats
late. So each rank also probes its own queue, a heartbeat to itself every ``heartbeat``
seconds: once it is handled, everything that arrived before it was sent has been read, and a
peer's silence is counted only up to then (:meth:`Peers.heard_until`). Such a rank names no
healthy peer, and it keeps telling its peers it is alive (its heartbeats leave from the
watcher's thread, without waiting for the answers to the earlier ones); a rank frozen, or
whose main thread holds the GIL, is named by its peers and, when it resumes, blames none of
them. Its own detection of a lost peer comes that much later: within ``lost_after +
heartbeat`` seconds plus its own queue's delay, and never later than ``LATE_READ_FACTOR *
lost_after`` (40 s by default): a rank whose RPC threads are all blocked, on the lost peer
itself say, reads nothing, and its probe cannot tell that from a long queue.

What each heartbeat carries (:class:`Beat`): the sender's name, whether it is shutting down
(``phase``), a status line that layers above may provide (:func:`add_status`:
``remote_module.ps`` reports a trainer's step), and where it runs (:class:`Origin`: hostname,
address, torchrun's group rank, pid). A lost peer is therefore named with its machine and its
last known step, from its last heartbeat.

The bound. A peer is lost once nothing was heard from it for ``lost_after`` seconds (default
10, ``RPC_BACKEND_LOST_AFTER_S``); heartbeats go out every ``heartbeat`` seconds (default 1,
``RPC_BACKEND_HEARTBEAT_S``), and the check runs as often, so every surviving rank names it
within ``lost_after + heartbeat`` seconds of its last heartbeat (plus, on a rank behind a
backlog, that backlog's delay: see above). ``lost_after=math.inf`` (or
the variable set to ``off``) turns watching off, e.g. while a debugger holds a rank.

How a rank ends. A lost peer whose role is not expendable ends every rank that notices it:
the rank logs one error line naming the lost workers grouped by machine (``rpc_backend.watch``
logger), sends the peers it still hears from that verdict in a last heartbeat (each ends at
once naming the same workers, before this rank's end could fail their calls to it with some
other error; the rank waits up to :data:`VERDICT_WAIT_S` for their answers), then raises
:class:`WorkerLost` in its main thread (a ``BaseException``, as
``KeyboardInterrupt``: ``except Exception`` does not swallow it; delivered with a signal, so a
main thread waiting in a graceful shutdown, a sleep or a lock wakes up), and if the process
is still alive :data:`END_GRACE_S` seconds later (its main thread blocked in C++, e.g. an RPC
to the lost peer that has not timed out yet) it writes the line to stderr again and exits
with status 1 (``os._exit``). Either way the rank exits non-zero, so torchrun's agent stops
that machine's other workers and exits non-zero too, and so does ``run_local``.

Expendable roles. A peer of a role named in ``expendable`` is reported when lost (a warning
line, and the callables given to :func:`on_lost`) and the job goes on. torch's graceful
shutdown waits for every worker of a world, so once an expendable worker is lost the graceful
shutdown of :func:`~rpc_backend.shutdown_rpc` is done here instead: each rank waits until
every surviving peer is shutting down too and has heard that this one is, then shuts down
immediately (calls still in flight then are not awaited: wait for your futures first).

Shutting down. A rank in a graceful shutdown keeps watching (it may be waiting for a peer
that is lost), so a graceful shutdown never waits for a lost peer: the watcher ends it. The
watcher stops once ``rpc.shutdown`` has returned.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

from rpc_backend.options import positive_seconds
from rpc_backend.roles import RankPlacement

#: Seconds between heartbeats, unless ``heartbeat=`` or :data:`HEARTBEAT_ENV` says otherwise.
DEFAULT_HEARTBEAT_S = 1.0
#: Seconds of silence after which a peer is lost, unless ``lost_after=`` or :data:`LOST_AFTER_ENV` says otherwise.
DEFAULT_LOST_AFTER_S = 10.0
HEARTBEAT_ENV = "RPC_BACKEND_HEARTBEAT_S"
LOST_AFTER_ENV = "RPC_BACKEND_LOST_AFTER_S"
#: What :data:`LOST_AFTER_ENV` may be set to for "never lost" (watching off).
OFF_WORDS = ("off", "inf", "none")
#: Seconds a rank that lost a peer has to end by its :class:`WorkerLost` before it exits anyway.
END_GRACE_S = 5.0
#: Seconds (at most) a rank that lost a peer waits for the others to hear it before it ends.
VERDICT_WAIT_S = 3.0
#: Silence read late still counts once it is this many times ``lost_after`` old: a rank whose
#: RPC threads are all blocked (on the lost peer itself, say) never reads its queue, so its own
#: probe cannot tell how far behind it is; it names a lost peer within this bound anyway.
LATE_READ_FACTOR = 4
#: Heartbeats in flight to one peer at most (their answers may wait in this rank's queue).
MAX_BEATS_IN_FLIGHT = 1000
#: The exit status of a rank that :data:`END_GRACE_S` ended.
EXIT_STATUS = 1
#: Longest status line a heartbeat carries.
MAX_STATUS_CHARS = 200

RUNNING = "running"
LEAVING = "leaving"

_log = logging.getLogger("rpc_backend.watch")


class Origin(NamedTuple):
    """Where a worker runs: what a lost one is named by."""

    hostname: str
    address: str
    #: torchrun's ``GROUP_RANK`` (its machine's rank in the job), "" when not under torchrun
    group_rank: str
    pid: int

    def machine(self) -> str:
        """``"machine1 (10.42.0.2, torchrun group rank 1)"``."""
        details = [d for d in (self.address, self.group_rank and f"torchrun group rank {self.group_rank}") if d]
        return f"{self.hostname} ({', '.join(details)})" if details else self.hostname


class Beat(NamedTuple):
    """What a heartbeat carries, each way (the answer is the receiver's own)."""

    name: str
    #: :data:`RUNNING`, or :data:`LEAVING` once the sender's graceful shutdown has begun
    phase: str
    #: what layers above report (:func:`add_status`), e.g. "step 41 of PSModel 'mlp'"; "" if nothing
    status: str
    origin: Origin
    #: set in the last heartbeats of a rank that lost a peer and ends: the receivers end too
    lost: tuple = ()


class LostWorker(NamedTuple):
    """A peer not heard from for ``lost_after`` seconds (or, named with one, for some seconds)."""

    name: str
    rank: int
    role: str
    #: where it ran, from its last heartbeat (None: never heard from)
    origin: Origin | None
    #: its last status line ("" if none)
    status: str
    #: its last phase heard (:data:`RUNNING` when never heard from)
    phase: str
    #: seconds since it was last heard from, when it was named
    silent_s: float
    expendable: bool

    def describe(self) -> str:
        """``"trainer1 (rank 2, pid 4242, at step 41 of PSModel 'mlp', not heard from for 10.2 s)"``."""
        parts = [f"rank {self.rank}"]
        if self.origin is not None:
            parts.append(f"pid {self.origin.pid}")
        if self.status:
            parts.append(f"at {self.status}")
        if self.phase == LEAVING:
            parts.append("in its graceful rpc.shutdown()")  # (where a server serves: not leaving yet)
        parts.append(f"not heard from for {self.silent_s:.1f} s")
        return f"{self.name} ({', '.join(parts)})"


def describe_lost(lost: Sequence[LostWorker]) -> str:
    """The lost workers grouped by machine, e.g. ``"trainer1 (...) and trainer2 (...) on
    machine1 (10.42.0.2, torchrun group rank 1)"``; machines in the order of their first
    worker's rank."""
    groups: dict[str, list[LostWorker]] = {}
    for worker in sorted(lost, key=lambda w: w.rank):
        where = worker.origin.machine() if worker.origin is not None else "a machine never heard from"
        groups.setdefault(where, []).append(worker)
    parts = []
    for where, workers in groups.items():
        named = [w.describe() for w in workers]
        listed = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"
        parts.append(f"{listed} on {where}")
    return "; ".join(parts)


#: The shortest heartbeat accepted (seconds): shorter ones flood every peer with messages.
MIN_HEARTBEAT_S = 0.05


class WorkerLost(BaseException):
    """Raised in a rank's main thread when a peer of a role that is not expendable is lost.

    A ``BaseException`` (as ``KeyboardInterrupt``), so that ``except Exception`` in a training
    loop does not swallow it; ``lost`` lists the :class:`LostWorker` records, the message names
    them by machine. The rank exits anyway :data:`END_GRACE_S` seconds after it is raised.
    """

    def __init__(self, message: str, lost: Sequence[LostWorker]) -> None:
        super().__init__(message)
        self.lost = list(lost)


class WatchSettings(NamedTuple):
    """How a rank watches its peers (:func:`watch_settings` resolves and checks them)."""

    heartbeat: float
    lost_after: float
    expendable: frozenset[str]


def _seconds_from(value: Any, what: str, variable: str, env: Mapping[str, str], default: float) -> float:
    if value is None:
        raw = env.get(variable, "").strip()
        if not raw:
            return default
        if raw.lower() in OFF_WORDS:
            return math.inf
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{variable}={raw!r} is not a number of seconds; set it to e.g. 10, or to 'off'") from None
        what = variable
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == math.inf:
        return math.inf
    return positive_seconds(value, what)


def watch_settings(
    heartbeat: float | None = None,
    lost_after: float | None = None,
    expendable: Iterable[str] = (),
    roles: Iterable[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> WatchSettings | None:
    """The checked settings, or ``None`` when watching is off.

    ``heartbeat`` and ``lost_after`` are seconds; ``None`` takes :data:`HEARTBEAT_ENV` /
    :data:`LOST_AFTER_ENV` from ``env`` (default ``os.environ``), else the defaults (1 s, 10 s).
    ``lost_after`` of ``math.inf`` (the variable: ``off``) turns watching off. ``lost_after``
    must be at least twice ``heartbeat``. ``expendable`` names roles (checked against
    ``roles`` when given).

    Example::

        >>> watch_settings(heartbeat=0.5, lost_after=5, expendable=("replica",), roles=("ps", "replica"), env={})
        WatchSettings(heartbeat=0.5, lost_after=5.0, expendable=frozenset({'replica'}))
    """
    env = os.environ if env is None else env
    if isinstance(expendable, str):
        raise TypeError(f"expendable takes role names, e.g. expendable=({expendable!r},), got the str {expendable!r}")
    expendable = frozenset(expendable)
    for role in expendable:
        if not isinstance(role, str):
            raise TypeError(f"expendable takes role names (str), got {role!r}")
    if roles is not None:
        known = list(dict.fromkeys(roles))
        unknown = sorted(expendable - set(known))
        if unknown:
            raise ValueError(f"expendable names {', '.join(map(repr, unknown))}, which is not a role of this job "
                             f"(roles: {', '.join(map(repr, known))})")
    # name each setting where the user gave it: the argument, or the environment variable
    hb_what = "heartbeat" if heartbeat is not None or not env.get(HEARTBEAT_ENV, "").strip() else HEARTBEAT_ENV
    after_what = ("lost_after" if lost_after is not None or not env.get(LOST_AFTER_ENV, "").strip()
                  else LOST_AFTER_ENV)
    hb = _seconds_from(heartbeat, "heartbeat", HEARTBEAT_ENV, env, DEFAULT_HEARTBEAT_S)
    if hb == math.inf:
        raise ValueError(f"{hb_what} must be a finite number of seconds; to stop watching, set lost_after=math.inf "
                         f"or {LOST_AFTER_ENV}=off")
    if hb < MIN_HEARTBEAT_S:
        raise ValueError(f"{hb_what} ({hb} s) is below {MIN_HEARTBEAT_S} s: every rank would send each peer "
                         f"{1 / hb:.0f} heartbeats a second")
    after = _seconds_from(lost_after, "lost_after", LOST_AFTER_ENV, env, DEFAULT_LOST_AFTER_S)
    if after == math.inf:
        return None
    if after < 2 * hb:
        raise ValueError(f"{after_what} ({after} s) must be at least twice {hb_what} ({hb} s): a peer is lost only "
                         f"after missing several heartbeats")
    return WatchSettings(hb, after, expendable)


# ---- status lines from layers above --------------------------------------------------------

_status_lock = threading.Lock()
_statuses: list[tuple[Callable[..., str | None], Any]] = []  # (describe, weakref to owner or None)


def add_status(describe: Callable[..., str | None], owner: Any = None) -> Callable[[], None]:
    """Report ``describe()`` in this rank's heartbeats (``describe(owner)`` while ``owner``
    lives, held weakly, when an owner is given); a peer that loses this rank names it with
    that line. Returns a callable that removes it. ``describe`` runs on the heartbeat thread
    every heartbeat: keep it cheap; ``None`` or an exception leaves it out.

    Example (``remote_module.ps`` reports each model's step this way)::

        add_status(lambda model: f"step {model.steps} of {model.name!r}", owner=model)
        add_status(lambda: f"epoch {epoch[0]}")
    """
    entry = (describe, None if owner is None else weakref.ref(owner))
    with _status_lock:
        # (owners gone are dropped here too: a process may make many models and never watch)
        _statuses[:] = [e for e in _statuses if e[1] is None or e[1]() is not None]
        _statuses.append(entry)

    def remove() -> None:
        with _status_lock:
            if entry in _statuses:
                _statuses.remove(entry)

    return remove


def current_status() -> str:
    """This rank's status line: every :func:`add_status` line, joined (at most
    :data:`MAX_STATUS_CHARS` characters)."""
    lines = []
    with _status_lock:
        entries = list(_statuses)
    dead = []
    for describe, ref in entries:
        try:
            if ref is None:
                line = describe()
            else:
                owner = ref()
                if owner is None:
                    dead.append((describe, ref))
                    continue
                line = describe(owner)
        except Exception:
            continue
        if line:
            lines.append(str(line))
    if dead:
        with _status_lock:
            _statuses[:] = [e for e in _statuses if e not in dead]
    text = "; ".join(lines)
    return text if len(text) <= MAX_STATUS_CHARS else text[: MAX_STATUS_CHARS - 3] + "..."


# ---- the decision, without threads or RPC (tests drive it with a fake clock) ---------------

@dataclass
class _Peer:
    placement: RankPlacement
    rank: int
    expendable: bool
    last_heard: float
    beat: Beat | None = None
    #: heartbeats sent to it whose answers have not come back (or not been handled yet: an
    #: answer waits in this rank's RPC queue like any message)
    in_flight: int = 0
    sent_at: float = -math.inf
    #: a heartbeat sent while this rank was leaving got an answer: the peer knows it is leaving
    acked_leaving: bool = False
    #: it answered a heartbeat of this rank: it has heard this rank say who and where it is
    answered: bool = False
    #: seconds until the next heartbeat to it: longer after one failed (fewer of torch's
    #: warnings about a peer that is gone; none is needed to hear from it)
    every: float = 0.0
    lost: LostWorker | None = None


@dataclass
class Peers:
    """What this rank knows of its peers, and what follows from it at a given time.

    All methods take the time (``now``, seconds of a monotonic clock) and change nothing
    else: the :class:`Watcher` calls them under its lock with ``time.monotonic()``.
    """

    me: str
    layout: list[RankPlacement]
    settings: WatchSettings
    started: float
    phase: str = RUNNING
    #: the graceful shutdown is done here (an expendable peer was lost), not by torch
    survivors: bool = False
    #: silence is counted only up to what this rank's own RPC queue has handled (the
    #: :class:`Watcher` probes it with a heartbeat to itself); off, up to ``now``
    probing: bool = False
    peers: dict[str, _Peer] = field(default_factory=dict)
    #: every message that reached this rank before this time has been handled (the sending
    #: time of the last probe answered)
    caught_up: float = field(init=False)
    #: when the probe in flight was sent (None: none in flight), and the last one
    probe_sent: float | None = None
    probe_at: float = -math.inf

    def __post_init__(self) -> None:
        self.caught_up = self.started
        for rank, placement in enumerate(self.layout):
            if placement.name != self.me:
                self.peers[placement.name] = _Peer(placement, rank, placement.role in self.settings.expendable,
                                                   self.started)

    def due(self, now: float) -> list[str]:
        """The peers to send a heartbeat to now (counted in flight): not lost, fewer than
        :meth:`_most_in_flight` in flight, and none sent for a heartbeat (at once after
        :meth:`leave`)."""
        out = []
        most = self._most_in_flight()
        for name, peer in self.peers.items():
            if (peer.lost is None and peer.in_flight < most
                    and now - peer.sent_at >= max(peer.every, self.settings.heartbeat)):
                peer.in_flight, peer.sent_at = peer.in_flight + 1, now
                out.append(name)
        return out

    def _most_in_flight(self) -> int:
        """Heartbeats in flight to one peer at most: as many as ``LATE_READ_FACTOR *
        lost_after`` holds (at most :data:`MAX_BEATS_IN_FLIGHT`). Not one: the answers to a
        rank's heartbeats wait in its own RPC queue, and a rank behind a backlog must go on
        telling its peers it is alive for as long as its own silence would not count."""
        after = self.settings.lost_after
        if not (self.probing and math.isfinite(after)):
            return 1
        # (to last until its silence counts even read late, LATE_READ_FACTOR * lost_after)
        return min(MAX_BEATS_IN_FLIGHT, math.ceil(LATE_READ_FACTOR * after / self.settings.heartbeat) + 1)

    def heard(self, name: str, beat: Beat | None, now: float) -> None:
        """``name`` is alive: its heartbeat arrived, or it answered one (``beat``: what it said)."""
        peer = self.peers.get(name)
        if peer is None:
            return
        peer.last_heard = max(peer.last_heard, now)
        if beat is not None:
            peer.beat = beat

    def answered(self, name: str, beat: Beat | None, ok: bool, phase: str, now: float) -> None:
        """The heartbeat sent to ``name`` in ``phase`` came back (``ok``: answered, with ``beat``)
        or failed (an error or its timeout: nothing heard)."""
        peer = self.peers.get(name)
        if peer is None:
            return
        peer.in_flight = max(0, peer.in_flight - 1)
        if ok:
            self.heard(name, beat, now)
            peer.every, peer.answered = self.settings.heartbeat, True
            if phase == LEAVING:
                peer.acked_leaving = True
        else:  # back off, to a third of lost_after at most: a peer back in time is still heard
            peer.every = min(2 * max(peer.every, self.settings.heartbeat), self.settings.lost_after / 3)

    def probe_due(self, now: float) -> bool:
        """Whether to send this rank's own queue a probe now (marked in flight): none in
        flight, and none sent for a heartbeat."""
        if not self.probing or self.probe_sent is not None or now - self.probe_at < self.settings.heartbeat:
            return False
        self.probe_sent = self.probe_at = now
        return True

    def probed(self, ok: bool, now: float) -> None:
        """The probe came back through this rank's RPC queue (``ok``), or failed: at once (RPC
        refusing to send, shutting down: no sign of a queue) or by its timeout (a queue that
        long tells nothing new)."""
        sent, self.probe_sent = self.probe_sent, None
        if sent is not None and (ok or now - sent < self.settings.heartbeat):
            self.caught_up = max(self.caught_up, sent)

    def heard_until(self, now: float) -> float:
        """Up to when this rank has heard what its peers sent: ``now`` while its own RPC queue
        keeps up (its last probe was handled within two heartbeats), else the time up to which
        it has handled everything (a peer's heartbeats may be waiting in that queue, behind
        calls or in a frozen process)."""
        if not self.probing or now - self.caught_up <= 2 * self.settings.heartbeat:
            return now
        return self.caught_up

    def leave(self) -> None:
        """This rank's graceful shutdown has begun: heartbeats say so, at once."""
        self.phase = LEAVING
        for peer in self.peers.values():
            peer.sent_at, peer.every = -math.inf, 0.0

    def _left(self, peer: _Peer, now: float) -> bool:
        """Shutting down, then silent for two heartbeats: done (only looked at in survivors mode)."""
        return (peer.beat is not None and peer.beat.phase == LEAVING
                and now - peer.last_heard >= 2 * self.settings.heartbeat)

    def _record(self, peer: _Peer, now: float) -> LostWorker:
        beat = peer.beat
        return LostWorker(peer.placement.name, peer.rank, peer.placement.role,
                          beat.origin if beat else None, beat.status if beat else "",
                          beat.phase if beat else RUNNING, now - peer.last_heard, peer.expendable)

    def check(self, now: float) -> tuple[list[LostWorker], list[LostWorker]]:
        """The peers lost since the last check: ``(fatal, spared)``. ``fatal`` is empty unless a
        peer of a role that is not expendable has been silent for ``lost_after``; then it also
        names every other peer silent for over two heartbeats (a machine's workers stop
        together). ``spared``: expendable peers silent for ``lost_after``, each reported once.
        Silence is counted up to :meth:`heard_until`: what waits in this rank's own queue is
        not silence, for at most ``LATE_READ_FACTOR * lost_after`` seconds."""
        after, two = self.settings.lost_after, 2 * self.settings.heartbeat
        seen = self.heard_until(now)
        late = (LATE_READ_FACTOR - 1) * after  # (inf - inf: watching off, nothing is ever lost)
        # seconds of silence counted: up to what this rank has read, or at most ``late`` behind now
        silent = {name: max(seen - p.last_heard, now - p.last_heard - late) if math.isfinite(after) else 0.0
                  for name, p in self.peers.items()}
        fatal: list[LostWorker] = []
        spared: list[LostWorker] = []
        for name, peer in self.peers.items():
            if peer.lost is not None or silent[name] < after:
                continue
            if self.survivors and self._left(peer, now):
                continue
            if peer.expendable:
                peer.lost = self._record(peer, now)
                spared.append(peer.lost)
            else:
                fatal.append(self._record(peer, now))
        if fatal:
            named = {w.name for w in fatal}
            fatal += [self._record(p, now) for p in self.peers.values()
                      if p.placement.name not in named and p.lost is None and silent[p.placement.name] > two
                      and not (self.survivors and self._left(p, now))]
            for worker in fatal:
                self.peers[worker.name].lost = worker
        return sorted(fatal, key=lambda w: w.rank), spared

    def spared(self) -> list[LostWorker]:
        """The expendable peers lost so far."""
        return [p.lost for p in self.peers.values() if p.lost is not None and p.expendable]

    def survivors_ready(self, now: float) -> bool:
        """Every peer not lost is shutting down and knows this rank is (it answered a
        heartbeat sent while leaving), or has left (shutting down, then silent)."""
        if self.phase != LEAVING:
            return False
        for peer in self.peers.values():
            if peer.lost is not None:
                continue
            leaving = peer.beat is not None and peer.beat.phase == LEAVING
            if not (leaving and (peer.acked_leaving or self._left(peer, now))):
                return False
        return True


# ---- the watcher: a thread, the heartbeats, the ending -------------------------------------

def _own_origin(env: Mapping[str, str]) -> Origin:
    """This process's hostname, the address its peers reach it by (the interface of
    ``TP_SOCKET_IFNAME``, else the source address toward ``MASTER_ADDR``), torchrun's group rank."""
    from rpc_backend import network

    address = ""
    try:
        ifname = env.get("TP_SOCKET_IFNAME")
        if ifname:
            address = next((a for n, a in network.interface_addresses() if n == ifname and ":" not in a), "")
        if not address and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
            address = network.route_source(env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    except (OSError, ValueError):
        pass
    return Origin(socket.gethostname(), address, env.get("GROUP_RANK", ""), os.getpid())


def _send_beat(peer: str, beat: Beat, timeout: float, done: Callable[[Beat | None, bool], None]) -> None:
    """Send ``beat`` to ``peer`` over RPC; ``done(answer, ok)`` runs when it settles."""
    import torch.distributed.rpc as rpc

    future = rpc.rpc_async(peer, _beat, args=(beat,), timeout=timeout)

    def settled(fut: Any) -> None:
        try:
            answer = fut.value()
        except Exception:
            done(None, False)
            return
        done(answer if isinstance(answer, Beat) else None, True)

    future.add_done_callback(settled)


class Watcher:
    """The heartbeats of one rank: a daemon thread that sends them, checks the peers, reports
    expendable losses and ends the rank on any other (see the module docstring).

    ``send`` (default: RPC), ``clock`` and ``end`` are replaceable for tests. Started by
    :func:`start_watching`; :func:`~rpc_backend.shutdown_rpc` drives :meth:`leave`,
    :meth:`wait_survivors` and :meth:`stop`.
    """

    def __init__(self, me: str, layout: Sequence[RankPlacement], settings: WatchSettings, *,
                 origin: Origin | None = None, send: Callable[..., None] = _send_beat,
                 clock: Callable[[], float] = time.monotonic,
                 end: Callable[[WorkerLost], None] | None = None) -> None:
        self.settings = settings
        self.clock = clock
        self.origin = origin if origin is not None else _own_origin(os.environ)
        self.peers = Peers(me, list(layout), settings, clock(), probing=True)
        self._send = send
        self._end = end if end is not None else _raise_then_exit
        self._cond = threading.Condition()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        #: the :class:`WorkerLost` this rank ended with, once it has
        self.ended: WorkerLost | None = None

    @property
    def me(self) -> str:
        return self.peers.me

    def beat(self, phase: str | None = None) -> Beat:
        """What this rank says in a heartbeat (or an answer)."""
        return Beat(self.me, self.peers.phase if phase is None else phase, current_status(), self.origin)

    def received(self, beat: Beat) -> Beat:
        """A peer's heartbeat arrived: it is alive; answer with this rank's own. When the peer
        ends because it lost workers (``beat.lost``), this rank ends too, naming them."""
        ending = None
        with self._cond:
            self.peers.heard(beat.name, beat, self.clock())
            if beat.lost and self.ended is None:
                for worker in beat.lost:
                    if worker.name in self.peers.peers:
                        self.peers.peers[worker.name].lost = worker
                self.ended = ending = WorkerLost(self._message(beat.lost, f"noticed by {beat.name}"), beat.lost)
                self._stopped.set()
            self._cond.notify_all()
        answer = self.beat()
        if ending is not None:
            _log.error("%s", ending)
            self._end(ending)
        return answer

    def _message(self, lost: Sequence[LostWorker], found: str) -> str:
        return (f"rpc_backend: lost {describe_lost(lost)} ({found}: lost after {self.settings.lost_after:g} s "
                f"without a heartbeat, {LOST_AFTER_ENV} sets it); ending {self.me}")

    def tick(self) -> None:
        """Send the heartbeats due, then check: report the expendable peers lost, end on any other."""
        if self.ended is not None:
            return
        with self._cond:
            now = self.clock()
            due = self.peers.due(now)
            probe = self.peers.probe_due(now)
            phase = self.peers.phase
        if due:
            beat = self.beat(phase)
            for peer in due:
                self._send_one(peer, beat, phase)
        if probe:
            self._probe()
        with self._cond:
            fatal, spared = self.peers.check(self.clock())
            ending = None
            if fatal and self.ended is None:
                self.ended = ending = WorkerLost(self._message(fatal, "noticed here"), fatal)
                self._stopped.set()
            self._cond.notify_all()
        for lost in spared:
            _log.warning("rpc_backend: lost %s, of the expendable role %r: the job goes on without it "
                         "(lost after %g s without a heartbeat)", describe_lost([lost]), lost.role,
                         self.settings.lost_after)
            _tell_lost_callbacks(lost)
        if ending is not None:
            _log.error("%s", ending)
            self._tell(ending)
            self._end(ending)

    def _tell(self, ending: WorkerLost) -> None:
        """Send the peers still heard from the verdict, and wait (a little) for their answers:
        each ends at once, naming the same workers, before this rank's end breaks their calls."""
        with self._cond:
            told = [name for name, p in self.peers.peers.items() if p.lost is None]
        beat = self.beat()._replace(lost=tuple(ending.lost))
        answered: list[str] = []

        def done(name: str) -> Callable[[Beat | None, bool], None]:
            def settled(answer: Beat | None, ok: bool) -> None:
                with self._cond:
                    answered.append(name)
                    self._cond.notify_all()
            return settled

        for name in told:
            try:
                self._send(name, beat, self.settings.lost_after, done(name))
            except Exception:
                answered.append(name)
        deadline = time.monotonic() + min(self.settings.lost_after, max(2 * self.settings.heartbeat, VERDICT_WAIT_S))
        with self._cond:
            while len(answered) < len(told) and time.monotonic() < deadline:
                self._cond.wait(max(0.0, min(0.1, deadline - time.monotonic())))

    def _send_one(self, peer: str, beat: Beat, phase: str) -> None:
        def done(answer: Beat | None, ok: bool) -> None:
            with self._cond:
                self.peers.answered(peer, answer, ok, phase, self.clock())
                self._cond.notify_all()

        try:
            self._send(peer, beat, self.settings.lost_after, done)
        except Exception:  # e.g. the agent is shutting down: nothing heard
            done(None, False)

    def _probe(self) -> None:
        """A heartbeat to this rank itself: handled by its RPC threads after every message
        that arrived before it, so its answer tells how far this rank has caught up."""
        def done(answer: Beat | None, ok: bool) -> None:
            with self._cond:
                self.peers.probed(ok, self.clock())
                self._cond.notify_all()

        try:
            self._send(self.me, self.beat(), self.settings.lost_after, done)
        except Exception:  # e.g. the agent is shutting down
            done(None, False)

    def run(self) -> None:
        """The thread's loop: a tick every heartbeat until :meth:`stop` (or the rank ends)."""
        from rpc_backend._torch_private import is_rpc_initialized

        while not self._stopped.wait(self.settings.heartbeat):
            if self._send is _send_beat and not is_rpc_initialized():
                _forget(self)  # rpc.shutdown was called directly: this world is gone
                return
            try:
                self.tick()
            except Exception:  # a watcher must never take the rank down by itself
                _log.exception("rpc_backend: heartbeat check failed")

    def start(self) -> Watcher:
        self._thread = threading.Thread(target=self.run, name="rpc-backend-heartbeats", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sending and checking (after ``rpc.shutdown``, or before an immediate one)."""
        self._stopped.set()
        with self._cond:
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # gone when stop() returns (a heartbeat in flight ends with the agent's shutdown;
            # bounded, so that a stuck send never holds up a shutdown)
            thread.join(timeout=2.0)

    def leave(self) -> None:
        """This rank's graceful shutdown begins: tell the peers at once."""
        with self._cond:
            self.peers.leave()
        self.tick()

    def spared(self) -> list[LostWorker]:
        """The expendable peers lost so far."""
        with self._cond:
            return self.peers.spared()

    def machine_of(self, name: str) -> str | None:
        """Where peer ``name`` runs, from its last heartbeat, when that is not this rank's
        machine (see :func:`machine_of`)."""
        with self._cond:
            peer = self.peers.peers.get(name)
            beat = peer.beat if peer is not None else None
        if beat is None:
            return None
        theirs, mine = beat.origin, self.origin
        if (theirs.hostname, theirs.address) == (mine.hostname, mine.address):
            return None
        return theirs.machine()

    def known_to(self) -> list[str]:
        """The peers that have answered a heartbeat of this rank (they could name it if lost)."""
        with self._cond:
            return [name for name, p in self.peers.peers.items() if p.answered]

    def lost(self) -> list[LostWorker]:
        """Every peer lost so far (expendable or not)."""
        with self._cond:
            return [p.lost for p in self.peers.peers.values() if p.lost is not None]

    def wait_survivors(self, timeout: float | None) -> bool:
        """Shut down without torch's barrier (an expendable peer is lost): wait until every
        surviving peer is shutting down and knows this rank is (see :meth:`Peers.survivors_ready`).
        False when ``timeout`` seconds passed first. A peer lost meanwhile ends the rank as usual."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self.peers.survivors = True
            while not self.peers.survivors_ready(self.clock()):
                if self.ended is not None:
                    raise self.ended
                left = self.settings.heartbeat if deadline is None else min(self.settings.heartbeat,
                                                                            deadline - time.monotonic())
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True


_lost_callbacks: list[Callable[[LostWorker], None]] = []


def on_lost(callback: Callable[[LostWorker], None]) -> Callable[[], None]:
    """Call ``callback(lost_worker)`` (on the heartbeat thread) for each expendable peer lost;
    returns a callable that removes it. (A peer that is not expendable ends the rank instead.)

    Example (a router that stops sending to a lost replica)::

        on_lost(lambda lost: replicas.discard(lost.name))
    """
    _lost_callbacks.append(callback)
    return lambda: _lost_callbacks.remove(callback) if callback in _lost_callbacks else None


def _tell_lost_callbacks(lost: LostWorker) -> None:
    for callback in list(_lost_callbacks):
        try:
            callback(lost)
        except Exception:
            _log.exception("rpc_backend: an on_lost callback raised")


# ---- the one watcher of this process -------------------------------------------------------

_current: list[Watcher] = []
#: the signal that carries :class:`WorkerLost` to the main thread
END_SIGNAL = getattr(signal, "SIGUSR2", None)
_pending: list[WorkerLost] = []
_handler_installed = False


def _deliver(signum: int, frame: Any) -> None:
    if _pending:
        raise _pending.pop()


def _install_handler() -> None:
    """Take :data:`END_SIGNAL` for :class:`WorkerLost`, from the main thread, unless someone
    else's handler is there."""
    global _handler_installed
    if _handler_installed or END_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(END_SIGNAL) in (signal.SIG_DFL, None):
        signal.signal(END_SIGNAL, _deliver)
        _handler_installed = True


def _raise_then_exit(exc: WorkerLost) -> None:
    """Raise ``exc`` in the main thread; exit the process :data:`END_GRACE_S` seconds later
    if it is still alive."""
    main = threading.main_thread()
    if _handler_installed and main.is_alive():
        _pending[:] = [exc]
        try:
            signal.pthread_kill(main.ident, END_SIGNAL)  # type: ignore[arg-type]
        except (OSError, ValueError):
            pass

    def exit_later() -> None:
        time.sleep(END_GRACE_S)
        os.write(2, f"{exc} (the rank did not end within {END_GRACE_S:g} s of it: exiting)\n".encode())
        os._exit(EXIT_STATUS)

    threading.Thread(target=exit_later, name="rpc-backend-lost-exit", daemon=True).start()


def start_watching(me: str, layout: Sequence[RankPlacement], settings: WatchSettings | None) -> Watcher | None:
    """Start this process's watcher (none when ``settings`` is None); replaces an earlier one.
    Call it from the main thread right after ``init_rpc`` (``init_from_env`` and ``run_local`` do)."""
    stop_watching()
    if settings is None:
        return None
    _install_handler()
    watcher = Watcher(me, layout, settings)
    _current[:] = [watcher]
    return watcher.start()


def _forget(watcher: Watcher) -> None:
    """``watcher``'s world ended without :func:`stop_watching`: it is no longer current."""
    watcher._stopped.set()
    if _current and _current[-1] is watcher:
        _current.clear()


def current_watcher() -> Watcher | None:
    """This process's watcher, if one runs."""
    return _current[-1] if _current else None


def stop_watching() -> None:
    """Stop this process's watcher, if one runs."""
    if _current:
        _current.pop().stop()


def shutdown_with_survivors(watcher: Watcher, timeout: float | None, immediate: Callable[[], None]) -> None:
    """The graceful shutdown once an expendable peer is lost (torch's would wait for it):
    wait until every surviving peer is shutting down and knows this rank is, then shut down
    with ``immediate()`` (``rpc.shutdown(graceful=False)``). ``timeout`` seconds bound the
    wait (then ``RuntimeError``, after the immediate shutdown)."""
    lost = ", ".join(w.name for w in watcher.spared())
    _log.info("rpc_backend: %s shuts down with the surviving workers (lost: %s)", watcher.me, lost)
    try:
        ready = watcher.wait_survivors(timeout)
    finally:
        watcher.stop()
        immediate()
    if not ready:
        raise RuntimeError(
            f"graceful RPC shutdown did not complete within {timeout} s (waiting for the workers that survived "
            f"{lost}); shut down immediately instead. Pass timeout=None to wait however long it takes"
        )


def machine_of(name: str) -> str | None:
    """The machine of peer ``name`` as its last heartbeat gave it, e.g. ``"machine0 (10.42.0.1,
    torchrun group rank 0)"``, for errors about it (a call to it that failed on a broken
    connection says where the peer was before the heartbeats name it lost); None when it runs
    on this rank's machine, nothing was heard from it, or no watcher runs."""
    watcher = current_watcher()
    return None if watcher is None else watcher.machine_of(name)


def lost_workers() -> list[LostWorker]:
    """The peers this rank has lost so far (the expendable ones: the job went on)."""
    watcher = current_watcher()
    return [] if watcher is None else watcher.lost()


def _beat(beat: Beat) -> Beat | None:
    """The heartbeat's RPC handler: note that the sender is alive; answer with this rank's own
    (None where no watcher runs, which still tells the sender this rank is alive)."""
    watcher = current_watcher()
    return None if watcher is None else watcher.received(beat)
