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
import os
import signal
import socket
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from rpc_backend._beats import (
    LEAVING,
    MAX_STATUS_CHARS,
    RUNNING,
    Beat,
    LostWorker,
    Origin,
    WorkerLost,
    add_status,
    current_status,
    describe_lost,
)
from rpc_backend._peers import LATE_READ_FACTOR, MAX_BEATS_IN_FLIGHT, Peers
from rpc_backend._watch_settings import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_LOST_AFTER_S,
    HEARTBEAT_ENV,
    LOST_AFTER_ENV,
    MIN_HEARTBEAT_S,
    OFF_WORDS,
    WatchSettings,
    watch_settings,
)
from rpc_backend.roles import RankPlacement

__all__ = [  # (the records, settings and peer bookkeeping live in _beats, _watch_settings, _peers)
    "DEFAULT_HEARTBEAT_S", "DEFAULT_LOST_AFTER_S", "HEARTBEAT_ENV", "LOST_AFTER_ENV", "OFF_WORDS",
    "MIN_HEARTBEAT_S", "END_GRACE_S", "VERDICT_WAIT_S", "LATE_READ_FACTOR", "MAX_BEATS_IN_FLIGHT", "EXIT_STATUS",
    "MAX_STATUS_CHARS", "RUNNING", "LEAVING", "END_SIGNAL", "Origin", "Beat", "LostWorker", "describe_lost",
    "WorkerLost", "WatchSettings", "watch_settings", "add_status", "current_status", "Peers", "Watcher",
    "on_lost", "start_watching", "current_watcher", "stop_watching", "shutdown_with_survivors", "machine_of",
    "lost_workers",
]

#: Seconds a rank that lost a peer has to end by its :class:`WorkerLost` before it exits anyway.
END_GRACE_S = 5.0
#: Seconds (at most) a rank that lost a peer waits for the others to hear it before it ends.
VERDICT_WAIT_S = 3.0
#: The exit status of a rank that :data:`END_GRACE_S` ended.
EXIT_STATUS = 1

_log = logging.getLogger("rpc_backend.watch")


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
