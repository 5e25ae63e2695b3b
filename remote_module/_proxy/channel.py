"""A channel: calls to one host handler on one worker, many small ones sharing few messages,
each call keeping the contract of one call per message.

Each RPC message costs far more than a small call it carries (on a 2-core loopback machine a
no-op round trip is ~200 µs, a small ``Linear`` ~10 µs on the host), so a channel lets calls
made while messages are in flight share the next message. What a call keeps, whatever path
it takes:

- **its own result**: the host answers each call of a message separately (an ``Answer``),
  so one call's failure is that call's only;
- **its own deadline**, counted from when it was made: a process-wide watcher thread fails a
  call at its deadline (within ~50 ms), queued ("timed out after X s before it was sent") or
  sent ("sent to worker W, no answer within X s"); the RPC carrying a message keeps its own
  timeout (the longest remaining deadline in it);
- **no coalescing that could cost it its deadline**: a call is queued for a shared message
  only once the host has reported what such calls cost (seconds measured per call, kept as
  a running average), only when that is under ``HEAVY_CALL_S`` (slower calls get a message
  each, so a many-core host runs them in parallel), and a message never carries more
  estimated host time than ``DEADLINE_FRACTION`` of the shortest remaining deadline in it;
- **progress no callback can block**: when a message is answered, the next one leaves
  before any future is settled, and futures are settled outside every lock, in runs that
  move to another thread when a callback blocks (:mod:`remote_module._core.settling`), so a
  blocked callback delays no other call's result or deadline by more than a moment;
- **order**: calls that share a message run in the order they were made;
  :meth:`Channel.wait_for_thread` lets a blocking call wait until every earlier call of the
  same thread was answered (program order at synchronisation points);
- **a graceful shutdown answers it**: ``rpc.shutdown()`` waits (bounded by the calls' own
  deadlines) until every channel of the process is idle before RPC deletes this process's
  RRefs, and a channel holds ``keepalive`` (e.g. the module's RRef) while it lives.

A channel is one per (caller object, process) and is never pickled. Host handlers are
module-level functions ``one(context, item)`` and ``many(context, items)`` that return an
:class:`remote_module._proxy.call_records.Answer` in its wire form (``Answer(...).wire()``), one per item
for ``many``.

Example (an upper layer sending many small lookups to one server in few messages)::

    # host side, module level
    def _lookup_one(table_key, ids):
        start = time.perf_counter()
        rows = host_objects.get(table_key)[ids]
        return Answer(dumps(rows, inline=True), time.perf_counter() - start).wire()

    def _lookup_many(table_key, many_ids):
        return [_lookup_one(table_key, ids) for ids in many_ids]

    # caller side
    channel = Channel("ps0", _lookup_one, _lookup_many, table_key, finish=loads,
                      fail=lambda exc: exc, label="lookup on ps0")
    futures = [channel.submit(ids, timeout=5.0, batchable=True) for ids in batches]
    rows = [f.wait() for f in futures]
"""

from __future__ import annotations

import heapq
import math
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

import torch.distributed.rpc as rpc
from torch.futures import Future

from remote_module._core import (
    WATCH_TICK_S,
    CallTimeout,
    add_to_run,
    before_rref_deletion_at_shutdown,
    complete,
    finish_run,
    rpc_timeout_argument,
    schedule,
    settle_elsewhere,
    settle_here,
    timeout_message,
    watched_run,
)
from remote_module._proxy.call_records import Answer

#: At most this many shared messages of one channel are in flight; later calls queue.
MAX_IN_FLIGHT = 2
#: At most this many calls share one message.
MAX_BATCH = 32
#: Calls that take longer than this on the host (running average) get a message each.
HEAVY_CALL_S = 0.001
#: A message carries at most this fraction of the shortest remaining deadline in it, in
#: estimated host time.
DEADLINE_FRACTION = 0.25

_clock = time.monotonic
_QUEUED, _SENT, _SETTLED = 0, 1, 2


class _Pending:
    """One call, from when it was made until its future is settled."""

    __slots__ = ("item", "future", "deadline", "timeout", "thread", "seq", "state")

    def __init__(self, item: Any, future: Future, deadline: float, timeout: float, thread: int) -> None:
        self.item = item
        self.future = future
        self.deadline = deadline
        self.timeout = timeout
        self.thread = thread
        self.seq = 0
        self.state = _QUEUED


class Channel:
    """Calls to ``one``/``many`` on worker ``dest`` (see the module docstring).

    Args:
        dest: the worker (name or ``WorkerInfo``).
        one, many: host handlers for one call and for calls sharing a message.
        context: the handlers' first argument (what every call names on the host).
        finish: caller side, turns a call's ``Answer.result`` into its future's value (or
            raises the call's own error); runs outside every lock.
        fail: the exception a call's future carries when its RPC failed.
        label: names the calls in timeout errors ("<label> failed: timed out ...").
        devices: devices of the returned futures (CUDA stream ordering); None for CPU.
        keepalive: anything the host needs alive while calls are outstanding (an RRef).
    """

    def __init__(
        self,
        dest: Any,
        one: Callable[..., Any],
        many: Callable[..., Any],
        context: Any,
        *,
        finish: Callable[[Any], Any],
        fail: Callable[[BaseException], BaseException],
        label: str,
        devices: list | None = None,
        keepalive: Any = None,
    ) -> None:
        self.dest = dest
        self.dest_name = getattr(dest, "name", dest)
        self.one, self.many, self.context = one, many, context
        self._finish, self._fail, self.label = finish, fail, label
        self._devices = devices
        self.keepalive = keepalive
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)
        self._queue: deque[_Pending] = deque()
        self._pending: dict[int, _Pending] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, seq), lazily cleaned
        self._by_thread: dict[int, int] = {}  # thread ident -> calls not yet settled
        self._waiters = 0
        self._in_flight = 0
        self._seq = 0
        self._check_at = math.inf  # when the watcher next visits this channel
        #: running average of the host's seconds per call (None until the first answer)
        self.cost: float | None = None
        self.calls_sent = 0  # statistics
        self.messages_sent = 0
        self.shared_messages = 0  # messages that carried more than one call
        _channels.add(self)
        before_rref_deletion_at_shutdown(wait_until_all_idle)

    # ---- making calls --------------------------------------------------------------------

    def submit(self, item: Any, *, timeout: float, batchable: bool, made: float | None = None) -> Future:
        """Send ``item`` (now, or with the next message); its future settles with
        ``finish(result)``. ``timeout`` in seconds (``math.inf``: none), counted from
        ``made`` (a ``time.monotonic()`` reading; now by default). ``batchable``: the call
        may share a message (its item pickles without anything RPC must carry itself)."""
        now = _clock() if made is None else made
        deadline = now + timeout
        future = Future(devices=self._devices) if self._devices else Future()
        p = _Pending(item, future, deadline, timeout, threading.get_ident())
        shared = None
        with self.lock:
            self._seq += 1
            p.seq = seq = self._seq
            self._pending[seq] = p
            self._by_thread[p.thread] = self._by_thread.get(p.thread, 0) + 1
            watch = self._watch_locked(p)
            cost = self.cost
            if batchable and cost is not None and cost <= HEAVY_CALL_S:
                if self._in_flight >= MAX_IN_FLIGHT:
                    self._queue.append(p)
                    p = None
                else:
                    self._in_flight += 1
                    shared = True
            if p is not None:
                p.state = _SENT
        if watch:
            schedule(deadline, self)
        if p is not None:
            self._send([p], bool(shared), raise_now=True)
        return future

    def observe(self, seconds: float) -> None:
        """Count a call's host seconds measured elsewhere (e.g. a blocking call's answer)."""
        with self.lock:
            self._observe_locked(seconds)

    def wait_for_thread(self, deadline: float) -> bool:
        """Wait until every call this thread made on the channel is settled; False when
        ``deadline`` (a ``time.monotonic()`` reading) passed first."""
        tid = threading.get_ident()
        if not self._by_thread.get(tid):
            return True
        with self.lock:
            while self._by_thread.get(tid):
                remaining = deadline - _clock()
                if remaining <= 0:
                    return False
                self._waiters += 1
                try:
                    self._changed.wait(remaining if remaining != math.inf else None)
                finally:
                    self._waiters -= 1
        return True

    def wait_until_idle(self) -> None:
        """Wait until no call is outstanding, at most until the latest deadline among them."""
        with self.lock:
            while self._pending:
                latest = max(p.deadline for p in self._pending.values())
                remaining = latest + 1.0 - _clock()
                if remaining <= 0:
                    return
                self._waiters += 1
                try:
                    self._changed.wait(min(remaining, 1.0))
                finally:
                    self._waiters -= 1

    def outstanding(self) -> int:
        """Calls made and not yet settled."""
        return len(self._pending)

    # ---- sending and answers -------------------------------------------------------------

    def _send(self, batch: list[_Pending], shared: bool, raise_now: bool = False) -> BaseException | None:
        """Send ``batch`` as one message; the error when RPC refused it at once (then the
        caller of ``submit`` gets it raised when ``raise_now``, else the batch is failed by
        whoever sent it)."""
        latest = max(p.deadline for p in batch)
        rpc_timeout = rpc_timeout_argument(latest - _clock())
        try:
            if len(batch) == 1:
                fut = rpc.rpc_async(self.dest, self.one, (self.context, batch[0].item), timeout=rpc_timeout)
            else:
                fut = rpc.rpc_async(self.dest, self.many, (self.context, [p.item for p in batch]), timeout=rpc_timeout)
        except BaseException as exc:
            if raise_now:  # the call being made: its caller gets the error at once
                with self.lock:
                    if shared:
                        self._in_flight -= 1
                    self._forget_locked(batch[0])
                raise self._fail(exc) from exc
            return exc
        with self.lock:
            self.calls_sent += len(batch)
            self.messages_sent += 1
            self.shared_messages += len(batch) > 1
        fut.add_done_callback(lambda done: self._on_answer(done, batch, shared))
        return None

    def _on_answer(self, done: Any, batch: list[_Pending], shared: bool) -> None:
        try:
            value = done.wait()
        except BaseException as exc:
            self._answered(batch, shared, None, exc)
            return
        # answers arrive in their wire form (remote_module._proxy.call_records)
        answers = [Answer.from_wire(value)] if len(batch) == 1 else [Answer.from_wire(a) for a in value]
        self._answered(batch, shared, answers, None)

    def _answered(self, batch: list[_Pending], shared: bool, answers: list | None, exc: BaseException | None) -> None:
        """A message was answered (``answers``) or failed (``exc``): send what may leave now,
        then settle its calls' futures (and those of messages RPC refused to send)."""
        jobs: list[Callable[[], None]] = []
        run = None  # jobs, watched while this thread sends (a send may run a callback inline)
        done = [(batch, shared, answers, exc)]
        while done:
            batch, shared, answers, exc = done.pop()
            now = _clock()
            with self.lock:
                if shared:
                    self._in_flight -= 1
                if answers is not None:
                    for answer in answers:
                        self._observe_locked(answer.seconds)
                to_send = self._take_locked()
                settle = [(i, p) for i, p in enumerate(batch) if p.state != _SETTLED]  # else failed at its deadline
                for _, p in settle:
                    self._forget_locked(p)
            new_jobs: list[Callable[[], None]] = []
            for i, p in settle:
                if answers is not None:
                    new_jobs.append(lambda p=p, result=answers[i].result: self._settle_result(p, result))
                else:
                    new_jobs.append(lambda p=p, error=self._error(p, exc, now): self._settle(p, error))
            if run is not None:
                add_to_run(run, new_jobs)
            else:
                jobs.extend(new_jobs)
            if to_send and run is None:
                # torch runs a callback inline when a message's future is already done as it is
                # sent (e.g. one that timed out at once): that may block this thread
                run = watched_run(jobs)
            for next_batch, next_shared in to_send:  # the next messages leave first
                refused = self._send(next_batch, next_shared)
                if refused is not None:
                    done.append((next_batch, next_shared, None, refused))
        if run is None:
            settle_here(jobs)
        else:
            finish_run(run)

    def _take_locked(self) -> list[tuple[list[_Pending], bool]]:
        """Queued calls that may leave now: shared messages while fewer than MAX_IN_FLIGHT
        are in flight, or one message each for calls that became heavy."""
        out: list[tuple[list[_Pending], bool]] = []
        queue = self._queue
        while queue:
            if queue[0].state == _SETTLED:  # failed at its deadline while queued
                queue.popleft()
                continue
            cost = self.cost
            if cost is None or cost > HEAVY_CALL_S:
                p = queue.popleft()
                p.state = _SENT
                out.append(([p], False))
                continue
            if self._in_flight >= MAX_IN_FLIGHT:
                break
            now = _clock()
            batch: list[_Pending] = []
            shortest = math.inf
            while queue and len(batch) < MAX_BATCH:
                p = queue[0]
                if p.state == _SETTLED:
                    queue.popleft()
                    continue
                remaining = min(shortest, p.deadline - now)
                if batch and (len(batch) + 1) * cost > DEADLINE_FRACTION * remaining:
                    break
                queue.popleft()
                p.state = _SENT
                batch.append(p)
                shortest = remaining
            if batch:
                self._in_flight += 1
                out.append((batch, True))
        return out

    def _observe_locked(self, seconds: float) -> None:
        self.cost = seconds if self.cost is None else 0.8 * self.cost + 0.2 * seconds

    # ---- settling ------------------------------------------------------------------------

    def _forget_locked(self, p: _Pending) -> None:
        p.state = _SETTLED
        del self._pending[p.seq]
        left = self._by_thread[p.thread] - 1
        if left:
            self._by_thread[p.thread] = left
        else:
            del self._by_thread[p.thread]
        heap = self._deadlines
        while heap and heap[0][1] not in self._pending:  # keep the heap small
            heapq.heappop(heap)
        if self._waiters:
            self._changed.notify_all()

    def _settle_result(self, p: _Pending, result: Any) -> None:
        future, p.item, p.future = p.future, None, None
        try:
            value = self._finish(result)
        except BaseException as exc:
            complete(future, exc, True)
        else:
            complete(future, value, False)

    def _settle(self, p: _Pending, error: BaseException) -> None:
        future, p.item, p.future = p.future, None, None
        complete(future, error, True)

    def _error(self, p: _Pending, exc: BaseException, now: float) -> BaseException:
        """The error of sent call ``p`` whose message failed with ``exc`` at ``now``."""
        if now >= p.deadline - WATCH_TICK_S:  # RPC's own timeout: the call's deadline
            error: BaseException = self._timeout(p, sent=True)
            error.__cause__ = exc
            return error
        return self._fail(exc)

    def _timeout(self, p: _Pending, sent: bool) -> CallTimeout:
        return CallTimeout(f"{self.label} failed: {timeout_message(p.timeout, self.dest_name if sent else None)}")

    # ---- deadlines -----------------------------------------------------------------------

    def _watch_locked(self, p: _Pending) -> bool:
        """Record ``p``'s deadline; True when the watcher must be told of an earlier visit."""
        if p.deadline == math.inf:
            return False
        heap = self._deadlines
        heapq.heappush(heap, (p.deadline, p.seq))
        if len(heap) > 2 * len(self._pending) + 256:
            self._deadlines = heap = [(q.deadline, q.seq) for q in self._pending.values() if q.deadline != math.inf]
            heapq.heapify(heap)
        if p.deadline < self._check_at:
            self._check_at = p.deadline
            return True
        return False

    def expire(self, now: float) -> None:
        """Watcher: fail every call whose deadline passed; schedule the next visit."""
        expired = []
        with self.lock:
            heap = self._deadlines
            while heap and heap[0][0] <= now:
                _, seq = heapq.heappop(heap)
                p = self._pending.get(seq)
                if p is not None:
                    expired.append((p, p.state == _SENT))
                    self._forget_locked(p)
            self._check_at = heap[0][0] if heap else math.inf
            next_visit = self._check_at
        if next_visit != math.inf:
            schedule(next_visit, self)
        settle_elsewhere([lambda p=p, sent=sent: self._settle(p, self._timeout(p, sent)) for p, sent in expired])


_channels: weakref.WeakSet = weakref.WeakSet()


def wait_until_all_idle() -> None:
    """Wait until every channel of this process has no outstanding call (each bounded by its
    calls' deadlines). Runs inside a graceful ``rpc.shutdown`` before RRefs are deleted."""
    for channel in list(_channels):
        channel.wait_until_idle()
