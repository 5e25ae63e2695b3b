"""The answers of sent host calls (``remote_module._core.fanout``): each call's, or each
batch's, result future settled by its answer or by its deadline, whichever comes first.

:class:`Outstanding` is one call (:func:`~remote_module._core.fanout.call_async`);
:class:`Batch` the calls of one ``call_all_async`` or ``call_grouped_async``, failing at the
first failure; :class:`EachBatch` one that waits for every call and settles with each one's
outcome (``call_grouped_each``). A deadline fails the future with a ``CallTimeout`` naming the
worker (and, for a batch, every other worker still silent then), on a settler thread, so a
callback that blocks on it delays no other deadline. Labels are written only for an error.
"""

from __future__ import annotations

import threading
from typing import Any

from torch.futures import Future

from remote_module._core._torch_private import is_rpc_initialized
from remote_module._core.errors import CallTimeout, on_machine, retyped, timeout_message, to_exception
from remote_module._core.settling import complete, settle_elsewhere


def handler_name(handler: Any) -> str:
    module = getattr(handler, "__module__", None)
    name = getattr(handler, "__qualname__", None) or repr(handler)
    return f"{module}.{name}" if module else name


def call_label(index: int, n: int, handler: Any) -> str:
    return f"calls[{index}] of {n} ({handler_name(handler)})"


def rpc_failure(exc: BaseException, label: str, name: str) -> BaseException:
    if not is_rpc_initialized():
        failure: BaseException = RuntimeError(f"{label} on worker {name!r} failed: RPC was shut down ({exc})")
    else:
        # a broken connection (EPIPE, EOF) to another machine: say which, as a lost peer is named
        failure = retyped(exc, f"{label} on worker {name!r}{on_machine(name)} failed: {exc}")
    failure.__cause__ = exc
    return failure


class Outstanding:
    """One sent call until its result future is settled, by its answer or by its deadline,
    whichever comes first; the future is dropped once settled (the deadline queue keeps this
    object until the deadline, not the result)."""

    __slots__ = ("future", "lock", "label", "name", "seconds", "__weakref__")

    def __init__(self, future: Future, label: str, name: str, seconds: float) -> None:
        self.future: Future | None = future
        self.lock = threading.Lock()
        self.label, self.name, self.seconds = label, name, seconds

    def _take(self) -> Future | None:
        with self.lock:
            future, self.future = self.future, None
            return future

    def answered(self, sent: Future) -> None:
        future = self._take()
        try:
            ok, value = sent.value()  # read even when late: RRefs in it are confirmed, then dropped
        except BaseException as exc:  # the RPC itself failed: dead host, shutdown
            # its traceback holds this frame, hence ``future``, which will hold the failure (and
            # so ``exc``, its cause) out of the cycle collector's sight: see fanout.wait_plain
            exc.__traceback__ = None
            if future is not None:
                future.set_exception(rpc_failure(exc, self.label, self.name))
            return
        if future is None:
            return  # timed out before
        if ok:
            future.set_result(value)
        else:
            future.set_exception(to_exception(value, f"on worker {self.name!r} in {self.label}"))

    def expire(self, now: float) -> None:
        """Called by the process's deadline watcher (remote_module._core.settling) at the deadline;
        the future is failed on a settler thread, so a callback that blocks on it delays no
        other deadline."""
        future = self._take()
        if future is not None:
            message = f"{self.label} on worker {self.name!r} failed: {timeout_message(self.seconds, self.name)}"
            settle_elsewhere([lambda: complete(future, CallTimeout(message), True)])


class Batch:
    """The calls of one :func:`~remote_module._core.fanout.call_all_async`, from their sending
    until the combined future is settled: each call's answer lands in its slot, the first
    failure (or the deadline) settles the combined future at once. One object, one deadline and one callback per call,
    instead of a future of its own per call; labels are written only for an error."""

    __slots__ = ("combined", "results", "left", "lock", "names", "handlers", "seconds", "__weakref__")

    def __init__(self, combined: Future, names: list[str], handlers: list[Any], seconds: float) -> None:
        self.combined: Future | None = combined
        self.results: list[Any] = [UNANSWERED] * len(names)
        self.left = len(names)
        self.lock = threading.Lock()
        self.names, self.handlers, self.seconds = names, handlers, seconds

    def label(self, index: int) -> str:
        return call_label(index, len(self.names), self.handlers[index])

    def group_label(self, indices: list[int]) -> str:
        """The calls that shared one message, for an error that concerns them all."""
        if len(indices) == 1:
            return self.label(indices[0])
        return " and ".join(self.label(i) for i in indices) + " (one message)"

    def answered(self, index: int, sent: Future) -> None:
        """The answer of one call's own message: ``(ok, value)``."""
        self._take(self._outcomes([index], sent, False))

    def answered_group(self, indices: list[int], sent: Future) -> None:
        """The answer of one message that carried the calls ``indices`` (see
        :func:`~remote_module._core.fanout.call_grouped_async`): a list of ``(ok, value)``, one
        per call."""
        self._take(self._outcomes(indices, sent, True))

    def _outcomes(self, indices: list[int], sent: Future, grouped: bool) -> list[tuple[int, bool, Any]]:
        """``(index, ok, result or exception)`` for each call a message carried."""
        try:
            answer = sent.value()  # read even when late: RRefs in it are confirmed, then dropped
        except BaseException as exc:  # the RPC itself failed (dead host, shutdown): every call in it did
            # its traceback holds this frame's ``sent``, which holds ``exc`` out of the cycle
            # collector's sight (see fanout.wait_plain)
            exc.__traceback__ = None
            failure = rpc_failure(exc, self.group_label(indices), self.names[indices[0]])
            return [(index, False, failure) for index in indices]
        answers = answer if grouped else [answer]
        return [(index, True, value) if ok else
                (index, False, to_exception(value, f"on worker {self.names[index]!r} in {self.label(index)}"))
                for index, (ok, value) in zip(indices, answers)]

    def _take(self, outcomes: list[tuple[int, bool, Any]]) -> None:
        """The first failure settles the combined future at once; results fill their slots."""
        for _, ok, value in outcomes:
            if not ok:
                self._fail(value)
                return
        with self.lock:
            if self.combined is None:
                return  # failed or timed out before: dropped
            for index, _, value in outcomes:
                self.results[index] = value
            self.left -= len(outcomes)
            if self.left:
                return
            combined, self.combined = self.combined, None
        combined.set_result(self.results)  # outside the lock: callbacks may run here

    def _fail(self, failure: BaseException) -> None:
        with self.lock:
            combined, self.combined = self.combined, None
        if combined is not None:
            combined.set_exception(failure)  # outside the lock: callbacks may run here

    def expire(self, now: float) -> None:
        """Called by the process's deadline watcher (remote_module._core.settling) at the
        deadline: fails the combined future naming the first call not answered, on a settler
        thread, so a callback that blocks on it delays no other deadline."""
        with self.lock:
            combined, self.combined = self.combined, None
            unanswered = [i for i, r in enumerate(self.results) if r is UNANSWERED] or [0]
        if combined is not None:
            index, others = unanswered[0], unanswered[1:]
            name = self.names[index]
            message = f"{self.label(index)} on worker {name!r} failed: {timeout_message(self.seconds, name)}"
            if others:
                # a call may wait on another host (a fetch worker to worker): the one not
                # answering may be any of them, so every worker still silent is named
                message += f"; also unanswered at the deadline: {calls_by_worker([self.names[i] for i in others])}"
            settle_elsewhere([lambda: complete(combined, CallTimeout(message), True)])


UNANSWERED = object()
#: how many other workers with unanswered calls a batch's timeout names besides the first
NAMED_AT_MOST = 8


def calls_by_worker(names: list[str]) -> str:
    """``"1 call on 'w2', 20 on 'w0'"``: the workers in order of their first call, each once,
    at most :data:`NAMED_AT_MOST` of them, then a count of the others."""
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    (first, n), *rest = list(counts.items())[:NAMED_AT_MOST]
    parts = [f"{n} call{'s' if n > 1 else ''} on {first!r}"] + [f"{k} on {name!r}" for name, k in rest]
    more = len(counts) - NAMED_AT_MOST
    return ", ".join(parts) + (f" and {more} other workers" if more > 0 else "")


class EachBatch(Batch):
    """A :class:`Batch` that waits for every call (or the deadline) and settles with each
    call's outcome, ``(True, result)`` or ``(False, exception)``, instead of failing at the
    first failure (:func:`~remote_module._core.fanout.call_grouped_each`)."""

    __slots__ = ()

    def _take(self, outcomes: list[tuple[int, bool, Any]]) -> None:
        """Every outcome fills its slot; the combined future settles once all are in."""
        with self.lock:
            if self.combined is None:
                return  # timed out before: dropped
            for index, ok, value in outcomes:
                if self.results[index] is UNANSWERED:
                    self.results[index] = (ok, value)
                    self.left -= 1
            if self.left:
                return
            combined, self.combined = self.combined, None
        combined.set_result(self.results)

    def expire(self, now: float) -> None:
        """At the deadline: every call not answered gets a ``CallTimeout`` naming it, and the
        outcomes are delivered on a settler thread (as :meth:`Batch.expire` does)."""
        with self.lock:
            combined, self.combined = self.combined, None
            if combined is None:
                return
            for index, r in enumerate(self.results):
                if r is UNANSWERED:
                    name = self.names[index]
                    message = f"{self.label(index)} on worker {name!r} failed: {timeout_message(self.seconds, name)}"
                    self.results[index] = (False, CallTimeout(message))
            results = self.results
        settle_elsewhere([lambda: complete(combined, results, False)])
