"""Settling futures so that no callback can keep other futures from being settled, and a
process-wide watcher that visits objects at their deadlines.

Setting a ``torch.futures.Future``'s result runs its callbacks in the thread that sets it,
and a callback may block (on an event, or on another call to a host that is frozen). When
one thread settles several futures in turn, a blocked callback would leave every later
future unsettled. So futures are settled in *runs*: one thread works through a run in order,
and when it has spent more than :data:`STUCK_S` in one callback, the watcher hands the rest of
the run to another thread (up to :data:`MAX_THREADS` settler threads; past that, later runs
wait for a thread to come free). A future behind ``k`` blocked callbacks is settled about
``k * STUCK_S`` late, not never.

The watcher is one daemon thread: it calls ``target.expire(now)`` at the times given to
:meth:`Watcher.schedule` (at most every :data:`WATCH_TICK_S` per burst of deadlines), and every
:data:`STUCK_S` while runs are being settled, it rescues the stuck ones.

Example (settle the futures of a message's calls, here or on a settler thread)::

    settle_here([lambda: fut.set_result(v) for fut, v in zip(futures, values)])
    settle_elsewhere([lambda: fut.set_exception(TimeoutError()) for fut in expired])

    run = watched_run(jobs)     # settled here after the next message left, or elsewhere
    send_next_message()         # when sending is held up (RPC may run a callback inline)
    finish_run(run)
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

from torch.futures import Future

#: The watcher visits deadlines at most this often (timeouts fire within this of their deadline).
WATCH_TICK_S = 0.05
#: A callback that has run this long is presumed blocked: the rest of its run moves on.
STUCK_S = 0.02
#: At most this many settler threads (callbacks that block forever each hold one).
MAX_THREADS = 64

_clock = time.monotonic
_log = logging.getLogger("remote_module")


def complete(future: Future, value: Any, is_error: bool) -> None:
    """Set ``future``'s result (or exception). torch reports a callback that raises itself;
    what fails here (a future settled twice: a bug) is logged, never raised into the thread
    that settles."""
    try:
        if is_error:
            future.set_exception(value)
        else:
            future.set_result(value)
    except Exception:
        _log.exception("settling a remote call's future failed")


def followed(future: Future, then: Callable[[Future], Any]) -> Future:
    """A new future set to ``then(future)`` once ``future`` is done, or to what ``then`` raises,
    as raised (torch's ``Future.then`` would retype it as a ``RuntimeError``)."""
    out: Future = Future()

    def arrived(done: Future) -> None:
        try:
            value = then(done)
        except BaseException as exc:
            out.set_exception(exc)
            return
        out.set_result(value)

    future.add_done_callback(arrived)
    return out


def _run_job(job: Callable[[], None]) -> None:
    try:
        job()
    except Exception:
        _log.exception("settling a remote call's future")


class _Run:
    """Jobs settled in order; ``busy`` maps each thread working on it to when its current job
    started. Its fields are touched without a lock where one CPython operation suffices
    (``deque.popleft``, a dict store)."""

    __slots__ = ("jobs", "busy", "helper_queued")

    def __init__(self, jobs: list[Callable[[], None]]) -> None:
        self.jobs = deque(jobs)
        self.busy: dict[int, float] = {}
        self.helper_queued = False


class _Settlers:
    """Runs in progress, and the threads that take over runs whose thread is stuck."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._runs: set[_Run] = set()  # runs with jobs left that the watcher looks after
        self._waiting: deque[_Run] = deque()  # runs waiting for a settler thread
        self._idle = 0
        self._threads = 0

    def settle_here(self, jobs: list[Callable[[], None]]) -> None:
        """Run ``jobs`` in order on this thread; if one blocks, the rest go on elsewhere."""
        if len(jobs) <= 1:  # nothing behind a job to hold up
            for job in jobs:
                _run_job(job)
            return
        self.finish(self.watched(jobs))

    def watched(self, jobs: list[Callable[[], None]]) -> _Run:
        """A run of ``jobs`` this thread will settle with :meth:`finish`, watched from now on:
        if the thread is held up first (e.g. sending a message, when RPC runs a callback
        inline), the watcher hands the jobs to another thread after STUCK_S."""
        run = _Run(jobs)
        run.busy[threading.get_ident()] = _clock()
        with self._cond:
            self._runs.add(run)
        _watcher.tick_soon()
        return run

    def add(self, run: _Run, jobs: list[Callable[[], None]]) -> None:
        """More jobs for a watched run (settled after its others)."""
        with self._cond:
            run.jobs.extend(jobs)
            self._runs.add(run)  # again, if the watcher saw it empty and let it go

    def finish(self, run: _Run) -> None:
        """Settle what is left of a watched run on this thread."""
        run.busy[threading.get_ident()] = _clock()
        self._drain(run)

    def settle_elsewhere(self, jobs: list[Callable[[], None]]) -> None:
        """Run ``jobs`` in order on a settler thread (one more when the others are busy)."""
        if not jobs:
            return
        run = _Run(jobs)
        with self._cond:
            self._runs.add(run)
            self._hand_over_locked(run)
        _watcher.tick_soon()

    def active(self) -> bool:
        """True while some run has jobs left (the watcher then looks in every STUCK_S)."""
        return bool(self._runs)

    def rescue(self, now: float) -> None:
        """Watcher: another thread for every run whose threads all sit in one callback for
        longer than STUCK_S."""
        with self._cond:
            for run in list(self._runs):
                if not run.jobs:  # the last jobs are running or done: nothing left to hold up
                    self._runs.discard(run)
                elif not run.helper_queued and all(now - t > STUCK_S for t in tuple(run.busy.values())):
                    self._hand_over_locked(run)

    def _hand_over_locked(self, run: _Run) -> None:
        run.helper_queued = True
        self._waiting.append(run)
        if self._idle >= len(self._waiting):  # an idle thread per waiting run
            self._cond.notify()
        elif self._threads < MAX_THREADS:
            self._threads += 1
            threading.Thread(target=self._loop, name="remote_module-settle", daemon=True).start()

    def _drain(self, run: _Run) -> None:
        me = threading.get_ident()
        jobs, busy = run.jobs, run.busy
        while True:
            try:
                job = jobs.popleft()
            except IndexError:
                break
            busy[me] = _clock()
            _run_job(job)
        busy.pop(me, None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting:
                    self._idle += 1
                    woke = self._cond.wait(5.0)
                    self._idle -= 1
                    if not woke and not self._waiting:
                        self._threads -= 1
                        return
                run = self._waiting.popleft()
                run.helper_queued = False
                run.busy[threading.get_ident()] = _clock()
            self._drain(run)


class Watcher:
    """One daemon thread that calls ``target.expire(now)`` at scheduled times and rescues
    stuck settlement runs (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, weakref.ref]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._ticking = False  # waking every STUCK_S for the settlers

    def schedule(self, when: float, target: Any) -> None:
        """Call ``target.expire(now)`` at ``when`` (a ``time.monotonic()`` reading) or soon
        after; ``target`` is held weakly."""
        with self._cond:
            heapq.heappush(self._heap, (when, next(self._seq), weakref.ref(target)))
            if not self._start_locked() and self._heap[0][0] == when:
                self._cond.notify()

    def tick_soon(self) -> None:
        """Wake every STUCK_S while settlement runs are in progress (call it after adding
        the run: a watcher about to sleep sets ``_ticking`` to False before it looks again)."""
        if self._ticking:
            return
        with self._cond:
            if not self._ticking:
                self._ticking = True
                if not self._start_locked():
                    self._cond.notify()

    def _start_locked(self) -> bool:
        if self._thread is not None:
            return False
        self._thread = threading.Thread(target=self._loop, name="remote_module-deadlines", daemon=True)
        self._thread.start()
        return True

    def _loop(self) -> None:
        visited = rescued = -math.inf
        while True:
            with self._cond:
                while True:
                    now = _clock()
                    visit = max(self._heap[0][0], visited + WATCH_TICK_S) if self._heap else math.inf
                    if not _settlers.active():
                        self._ticking = False
                        # a run added just now saw _ticking still True and left it to us
                        self._ticking = _settlers.active()
                    else:
                        self._ticking = True
                    rescue = self._ticking and now >= rescued + STUCK_S
                    if visit <= now or rescue:
                        break
                    wake = min(visit, rescued + STUCK_S) if self._ticking else visit
                    self._cond.wait(None if wake == math.inf else wake - now)
                due = []
                if visit <= now:
                    visited = now
                    while self._heap and self._heap[0][0] <= now:
                        due.append(heapq.heappop(self._heap)[2])
            if rescue:
                rescued = now
                _settlers.rescue(now)
            for ref in due:
                target = ref()
                if target is not None:
                    try:
                        target.expire(now)
                    except Exception:
                        _log.exception("failing calls at their deadline")


_settlers = _Settlers()
_watcher = Watcher()

settle_here = _settlers.settle_here
settle_elsewhere = _settlers.settle_elsewhere
watched_run = _settlers.watched
add_to_run = _settlers.add
finish_run = _settlers.finish
schedule = _watcher.schedule
