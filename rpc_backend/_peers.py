"""What a rank knows of its peers, and what follows from it at a given time: the decision of
``rpc_backend/watch.py`` (who is due a heartbeat, who is lost), without threads or RPC, so
that tests drive it with a fake clock."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rpc_backend._beats import LEAVING, RUNNING, Beat, LostWorker
from rpc_backend._watch_settings import WatchSettings
from rpc_backend.roles import RankPlacement

#: Silence read late still counts once it is this many times ``lost_after`` old: a rank whose
#: RPC threads are all blocked (on the lost peer itself, say) never reads its queue, so its own
#: probe cannot tell how far behind it is; it names a lost peer within this bound anyway.
LATE_READ_FACTOR = 4
#: Heartbeats in flight to one peer at most (their answers may wait in this rank's queue).
MAX_BEATS_IN_FLIGHT = 1000


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
    else: the :class:`~rpc_backend.watch.Watcher` calls them under its lock with
    ``time.monotonic()``.
    """

    me: str
    layout: list[RankPlacement]
    settings: WatchSettings
    started: float
    phase: str = RUNNING
    #: the graceful shutdown is done here (an expendable peer was lost), not by torch
    survivors: bool = False
    #: silence is counted only up to what this rank's own RPC queue has handled (the
    #: :class:`~rpc_backend.watch.Watcher` probes it with a heartbeat to itself); off, up to ``now``
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

