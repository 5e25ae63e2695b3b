"""Running N host calls at once and collecting their results: :func:`call_all` and
:func:`call_all_async` (and :func:`call_async` for one call).

Creating N shards, N pipeline stages or N parameter-server tables is N host calls; every call
is sent before any is awaited, so N calls cost about one round trip, not N. What each call
keeps:

- **its result, in order**: the results come back as a list in the order of ``calls``,
  whatever order the hosts answer in;
- **its own exception type**: a handler's exception is caught on the host (``BaseException``
  included, so a ``SystemExit`` cannot take the host's RPC thread down) and raised on the
  caller with its original type when that type is importable there (else a
  :class:`remote_module._core.errors.RemoteModuleError` named after it), naming the worker and the
  call's index (``calls[2] (make_shard)``), with the remote traceback;
- **a timeout**: each call fails within ``timeout`` seconds of being sent (``None``: the RPC
  agent's default), with a :class:`remote_module._core.errors.CallTimeout` naming the worker
  (and every other worker of the batch still silent then; the watcher visits deadlines
  every ``WATCH_TICK_S``; the calls of one ``call_all`` share a
  deadline counted from the last of them sent). The
  deadline is kept here, not by RPC: the message itself waits for its answer, so an answer that
  comes after the deadline is still received and dropped. (An RPC timed out by torch drops its
  late answer unread, and an RRef inside it, e.g. a module created on the host, is never
  confirmed to its owner, which then waits for it at graceful shutdown forever.)

The first call to fail (in time) fails the whole: the collected future carries its error at
once, without waiting for the others, which keep running on their hosts (bounded by their own
timeouts) and whose results are dropped. A call that cannot be sent (an argument that does not
pickle) raises at once from :func:`call_all_async`; calls are checked (shape, worker, handler)
before any is sent.

Handlers are module-level functions, as for ``rpc.rpc_async`` (pickled by reference); a handler
decorated with ``@rpc.functions.async_execution`` may return a ``Future`` and is answered when
it completes. Results travel as RPC sends them (tensors, RRefs created on the host, ...).

Example (a caller and two hosts that only serve)::

    # every worker: rpc.init_rpc(name, rank=..., world_size=3,
    # rpc_backend_options=rpc_backend.make_options()); workers 1 and 2 then only call
    # rpc.shutdown(). In an importable module, e.g. mylib/tables.py:
    def row_count(path: str) -> int:
        return len(torch.load(path))

    # worker0
    from remote_module._core import call_all
    counts = call_all([("worker1", row_count, ("/data/a.pt",)), ("worker2", row_count, ("/data/b.pt",))], timeout=10)
"""

from __future__ import annotations

import math
import time
from functools import partial
from types import FunctionType
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch.distributed.rpc as rpc
from torch.futures import Future, collect_all

from remote_module._core._torch_private import (
    current_rpc_agent,
    dist_autograd_contexts_exist,
    is_async_execution,
    is_rpc_initialized,
    worker_names,
)
from remote_module._core.answers import Batch, EachBatch, Outstanding, call_label, handler_name, rpc_failure
from remote_module._core.deadlines import timeout_seconds
from remote_module._core.errors import CallTimeout, capture, retyped, timeout_message, to_exception
from remote_module._core.settling import schedule
from remote_module._core.walk import parameters_as_views
from rpc_backend.builds import check_peer

#: torch.distributed.rpc's "no timeout": the deadline is kept by remote_module._core.settling's watcher.
_NO_RPC_TIMEOUT = 0

_clock = time.monotonic
_tuple_new = tuple.__new__


class HostCall(NamedTuple):
    """One call of ``handler(*args, **kwargs)`` on ``worker`` (a name, a rank or a ``WorkerInfo``).

    Plain tuples ``(worker, handler)``, ``(worker, handler, args)`` and
    ``(worker, handler, args, kwargs)`` are accepted wherever a HostCall is.
    """

    worker: Any
    handler: Callable[..., Any]
    args: tuple = ()
    kwargs: dict | None = None


# ---- host-side handlers ---------------------------------------------------------------------


def _run_handler(handler: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """``(True, result)``, or ``(False, RemoteFailure)`` for whatever the handler raised."""
    try:
        return True, handler(*args, **kwargs)
    except BaseException as exc:  # the call's own failure, whatever it is
        return False, capture(exc)


@rpc.functions.async_execution
def _run_async(handler: Callable[..., Any], args: tuple, kwargs: dict) -> Future:
    """:func:`_run_handler` for an ``async_execution`` handler: answered when its Future completes."""
    answer: Future = Future()
    try:
        pending = handler(*args, **kwargs)
    except BaseException as exc:
        answer.set_result((False, capture(exc)))
        return answer

    def settle(fut: Future) -> None:
        try:
            value: tuple[bool, Any] = (True, fut.value())
        except BaseException as exc:
            value = (False, capture(exc))
        answer.set_result(value)

    pending.add_done_callback(settle)
    return answer


@rpc.functions.async_execution
def _run_many(calls: list[tuple[Callable[..., Any], tuple, dict]]) -> Future:
    """Several calls that share one message, run in the order sent: each answered
    ``(True, result)`` or ``(False, RemoteFailure)`` on its own; ``async_execution`` handlers
    are started in turn and awaited together."""
    answers: list[Any] = [None] * len(calls)
    waiting: list[tuple[int, Future]] = []
    for i, (handler, args, kwargs) in enumerate(calls):
        if not is_async_execution(handler):
            answers[i] = _run_handler(handler, args, kwargs)
            continue
        try:
            waiting.append((i, handler(*args, **kwargs)))
        except BaseException as exc:
            answers[i] = (False, capture(exc))
    done: Future = Future()
    if not waiting:
        done.set_result(answers)
        return done

    def settle(_: Future) -> None:
        for i, fut in waiting:
            try:
                answers[i] = (True, fut.value())
            except BaseException as exc:
                answers[i] = (False, capture(exc))
        done.set_result(answers)

    collect_all([fut for _, fut in waiting]).add_done_callback(settle)  # once every one is done
    return done


# ---- caller side ----------------------------------------------------------------------------


def answer_margin(seconds: float) -> float:
    """Seconds a host keeps back, out of a call's ``seconds``, for the answer of a call it makes
    in turn: a failure deeper in a chain is then reported, naming its worker, before the outer
    call's own deadline (``math.inf``: none)."""
    return 0.0 if seconds == math.inf else min(1.0, 0.1 * seconds)


def nested_seconds(seconds: float) -> float:
    """The budget of a call made inside a call of ``seconds``: ``seconds`` less
    :func:`answer_margin` (at least 1 ms; ``math.inf`` stays ``math.inf``)."""
    return seconds if seconds == math.inf else max(0.001, seconds - answer_margin(seconds))


def send_and_forget(worker: Any, handler: Callable[..., Any], args: tuple = (), timeout: float = 30) -> None:
    """Send ``handler(*args)`` to ``worker`` and never look at the answer: for messages whose
    failure changes nothing (a release, a cancellation). Nothing is raised when RPC is down or
    shutting down, or the worker is gone."""
    if not is_rpc_initialized():
        return
    try:
        rpc.rpc_async(worker, handler, args, timeout=timeout).add_done_callback(_ignore_answer)
    except Exception:
        pass  # RPC shutting down, or the worker gone: nothing to do there any more


def _ignore_answer(fut: Future) -> None:
    try:
        fut.value()
    except Exception:
        pass


def _worker_name(worker: Any, label: str) -> str:
    return _worker_info(worker, lambda: label).name


def _worker_info(worker: Any, label: Callable[[], str]) -> rpc.WorkerInfo:
    """``worker`` as a WorkerInfo (sending to one spares RPC a lookup by name); ``ValueError``
    naming the call (``label()``, written only then) for one not in this world."""
    if isinstance(worker, rpc.WorkerInfo):
        return worker
    if isinstance(worker, (str, int)) and not isinstance(worker, bool):
        try:
            return rpc.get_worker_info(worker)
        except RuntimeError:
            pass
    raise ValueError(
        f"{label()}: worker {worker!r} is not in this RPC world (workers: {', '.join(worker_names())}); "
        "pass a worker name, a rank or a WorkerInfo"
    )


def _unsent(exc: Exception, label: str, name: str) -> BaseException:
    """The error for a call that could not be sent (an argument that does not pickle, RPC
    shut down meanwhile)."""
    if not is_rpc_initialized():
        return RuntimeError(f"{label} could not be sent to worker {name!r}: RPC was shut down meanwhile ({exc})")
    return retyped(
        exc,
        f"{label} could not be sent to worker {name!r}: {type(exc).__name__}: {exc}. Pass tensors, "
        "plain Python values or picklable objects, and module-level handlers.",
    )


def call_async(
    worker: Any,
    handler: Callable[..., Any],
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    timeout: float | None = None,
    label: str | None = None,
) -> Future:
    """Send one host call now; a Future of its result, or of its failure naming the worker.

    ``label`` names the call in errors (default: the handler's qualified name). Raises at once
    when the call cannot be sent (unknown worker, an argument that does not pickle).

    Example::

        fut = call_async("worker1", make_table, (100,), timeout=10)
        key = fut.wait()
    """
    if not is_rpc_initialized():
        raise RuntimeError(
            "call_async needs torch.distributed.rpc: call rpc.init_rpc(name, rank=..., world_size=...) first"
        )
    label = label if label is not None else handler_name(handler)
    if not callable(handler):
        raise TypeError(f"{label}: the handler must be a module-level function, got {handler!r}")
    seconds = timeout_seconds(timeout)
    made = _clock()
    name = _worker_name(worker, label)
    check_peer(name, seconds)  # once per peer: its build is this one (rpc_backend/builds.py)
    wire = _wire(handler, args, kwargs, dist_autograd_contexts_exist())
    try:
        sent = rpc.rpc_async(name, _body(handler), wire, timeout=_NO_RPC_TIMEOUT)
    except Exception as exc:  # nothing was sent
        raise _unsent(exc, label, name) from exc
    result: Future = Future()
    call = Outstanding(result, label, name, seconds)
    sent.add_done_callback(call.answered)  # holds ``call`` (the watcher only weakly) until answered
    if seconds != math.inf:
        schedule(made + seconds, call)
    return result


def _as_call(index: int, call: Any) -> HostCall:
    if type(call) is tuple and len(call) == 3 and isinstance(call[2], tuple) and type(call[1]) is FunctionType:
        return _tuple_new(HostCall, (*call, None))  # (the usual form, as HostCall(*call) makes it)
    if isinstance(call, HostCall):
        found = call
    elif isinstance(call, tuple) and 2 <= len(call) <= 4:
        found = HostCall(*call)
    else:
        raise TypeError(
            f"calls[{index}] must be a HostCall or a tuple (worker, handler[, args[, kwargs]]), got {call!r}"
        )
    if not isinstance(found.args, (tuple, list)):
        raise TypeError(f"calls[{index}]: args must be a tuple, got {type(found.args).__name__}: {found.args!r}")
    if found.kwargs is not None and not (
        isinstance(found.kwargs, dict) and all(isinstance(k, str) for k in found.kwargs)
    ):
        raise TypeError(f"calls[{index}]: kwargs must be a dict of str to values or None, got {found.kwargs!r}")
    if not callable(found.handler):
        raise TypeError(f"calls[{index}]: the handler must be a module-level function, got {found.handler!r}")
    return found


#: the WorkerInfo of each worker name called in the current RPC world: ``[agent, {name: info}]``
#: (a new world, a new agent: looked up again; ``None`` for a dynamic world, ``init_rpc`` without
#: ``world_size``, whose workers join and leave: looked up at each call)
_known_workers: list = [None, None]


def _checked_calls(calls: Iterable[HostCall | tuple], timeout: float | None
                   ) -> tuple[list[HostCall], list[rpc.WorkerInfo], float]:
    """``calls`` checked (shape, worker, handler), their ``WorkerInfo``s and the timeout in
    seconds; nothing is sent. RPC must be running when there is a call to send."""
    checked = [_as_call(i, call) for i, call in enumerate(calls)]
    n = len(checked)
    if not n:
        return checked, [], timeout_seconds(timeout)
    agent = current_rpc_agent()
    if agent is None:  # (as call_async: no world to look a worker up in, nor its default timeout)
        raise RuntimeError(
            "call_async needs torch.distributed.rpc: call rpc.init_rpc(name, rank=..., world_size=...) first"
        )
    seconds = timeout_seconds(timeout)
    seen, known = _known_workers  # (one read: another thread may start a new world's)
    if seen is not agent:
        known = {} if getattr(agent, "is_static_group", True) else None
        _known_workers[:] = [agent, known]
    infos = []
    for i, c in enumerate(checked):
        info = known.get(c.worker) if known is not None and type(c.worker) is str else None
        if info is None:
            info = _worker_info(c.worker, partial(call_label, i, n, c.handler))
            if known is not None and type(c.worker) is str:
                known[c.worker] = info
        infos.append(info)
    for info in infos:
        check_peer(info.name, seconds)  # once per peer: its build is this one (rpc_backend/builds.py)
    return checked, infos, seconds


def _wire(handler: Callable[..., Any], args: Any, kwargs: dict | None, recorded: bool) -> tuple:
    """``(handler, args, kwargs)`` as a host call travels: parameters as views of themselves
    where a dist autograd context records (torch RPC would send them detached)."""
    args, kwargs = tuple(args), dict(kwargs or {})
    if recorded:
        args, kwargs = parameters_as_views((args, kwargs))
    return handler, args, kwargs


def _body(handler: Callable[..., Any]) -> Callable[..., Any]:
    """The host-side wrapper that runs ``handler`` and answers ``(ok, value)``."""
    return _run_async if is_async_execution(handler) else _run_handler


def _watch(batch: Batch, seconds: float) -> None:
    """One deadline for the batch, counted from the last send (each call gets at least its
    ``timeout``; the watcher visits deadlines every WATCH_TICK_S anyway)."""
    if seconds != math.inf:
        schedule(_clock() + seconds, batch)


def wait_plain(future: Future) -> Any:
    """``future.wait()``, raising a failure without torch's ``wait`` frame: that frame's future
    holds the exception out of the cycle collector's sight, and the caller's frames would be
    kept with it for good (see :meth:`remote_module._core.answers.Batch._outcomes`)."""
    try:
        return future.wait()
    except BaseException as exc:
        del future  # this frame, in the traceback from here on, must not hold it either
        raise exc.with_traceback(None)


def call_all_async(calls: Iterable[HostCall | tuple], timeout: float | None = None) -> Future:
    """Send every call now; a Future of their results in order, or of the first failure.

    See the module docstring for what each call keeps. Raises at once (nothing sent) for a
    malformed call, an unknown worker or a bad ``timeout``.

    Example::

        fut = call_all_async([(f"worker{r}", make_table, (100,)) for r in (1, 2, 3)], timeout=10)
        keys = fut.wait()          # [key on worker1, key on worker2, key on worker3]
    """
    checked, infos, seconds = _checked_calls(calls, timeout)
    return _send(Future(), infos, [c.handler for c in checked], [(c.args, c.kwargs) for c in checked], seconds)


def _send(combined: Future, infos: Sequence[rpc.WorkerInfo], handlers: Sequence[Any],
          arguments: Sequence[tuple[Any, Any]], seconds: float) -> Future:
    """Send checked calls (``arguments``: ``(args, kwargs)`` per call) as one :class:`Batch`
    settling ``combined``."""
    if not infos:
        combined.set_result([])
        return combined
    batch = Batch(combined, [info.name for info in infos], handlers, seconds)
    recorded = dist_autograd_contexts_exist()  # parameters must travel as graph tensors there
    for index, (info, handler, (args, kwargs)) in enumerate(zip(infos, handlers, arguments)):
        try:
            sent = rpc.rpc_async(info, _body(handler), _wire(handler, args, kwargs, recorded),
                                 timeout=_NO_RPC_TIMEOUT)
        except Exception as exc:  # nothing was sent for this call (earlier ones were: dropped)
            batch.combined = None
            raise _unsent(exc, batch.label(index), info.name) from exc
        sent.add_done_callback(partial(batch.answered, index))  # holds ``batch`` until answered
    _watch(batch, seconds)
    return combined


def send_to_each(infos: Sequence[rpc.WorkerInfo], handler: Callable[..., Any], args: Sequence[tuple],
                 seconds: float) -> Future:
    """:func:`call_all_async` of ``handler(*args[i])`` on ``infos[i]`` for calls a layer has
    already checked: ``infos`` are this world's ``WorkerInfo``s, ``handler`` a module-level
    handler, ``seconds`` from :func:`timeout_seconds`. The same contract (one batch, results in
    order, each failure naming its worker and index), without re-checking per call what a
    layer checked once (per mesh, per module).

    Example::

        infos = [rpc.get_worker_info(w) for w in mesh]            # once
        fut = send_to_each(infos, handler, [(x,), (y,)], timeout_seconds(None))
    """
    for info in infos:
        check_peer(info.name, seconds)  # once per peer: its build is this one (rpc_backend/builds.py)
    return _send(Future(), infos, [handler] * len(infos), [(a, None) for a in args], seconds)


def call_grouped_async(calls: Iterable[HostCall | tuple], timeout: float | None = None) -> Future:
    """:func:`call_all_async` with the calls to one worker in one message: a worker runs its
    calls in the order given (``async_execution`` ones started in that order, awaited
    together), each succeeding or failing alone. Results come back in the order of ``calls``;
    a failure names its worker and index (a failure of the message itself, e.g. an answer
    that does not pickle, names every call it carried). The first failure to arrive fails the
    whole, but a message is answered only once all its calls are done, and ``timeout`` counts
    for all of them: a worker runs them one after another. For many small calls to few
    workers (the tables of a model on their servers): one message per worker instead of one
    per call.

    Example::

        fut = call_grouped_async([("ps0", lookup, ("items", ids0)), ("ps0", lookup, ("users", ids1)),
                                  ("ps1", lookup, ("items", ids2))], timeout=10)   # two messages
        items0, users, items1 = fut.wait()
    """
    return _send_grouped(calls, timeout, Batch)


def call_grouped_each(calls: Iterable[HostCall | tuple], timeout: float | None = None) -> list[tuple[bool, Any]]:
    """:func:`call_grouped_async`, waiting for every call (or ``timeout``): each call's
    outcome, ``(True, result)`` or ``(False, exception)`` (a ``CallTimeout`` naming the call
    for one not answered in time), in the order of ``calls``; for callers that act on each
    call's success (a step of several tables, each kept for a retry where it failed).

    Example::

        for ok, value in call_grouped_each(pushes, timeout=10):
            ...
    """
    return _send_grouped(calls, timeout, EachBatch).wait()


def call_grouped_each_async(calls: Iterable[HostCall | tuple], timeout: float | None = None) -> Future:
    """:func:`call_grouped_each` without waiting: a Future of each call's outcome, ``(True,
    result)`` or ``(False, exception)``, in the order of ``calls`` (it never fails as a whole
    once sent). Raises at once (nothing sent) as :func:`call_grouped_async` does. For callers
    that send now and settle later (a step whose pushes stay in flight)."""
    return _send_grouped(calls, timeout, EachBatch)


def _send_grouped(calls: Iterable[HostCall | tuple], timeout: float | None, batch_type: type) -> Future:
    checked, infos, seconds = _checked_calls(calls, timeout)
    combined: Future = Future()
    if not checked:
        combined.set_result([])
        return combined
    groups: dict[str, list[int]] = {}
    for index, info in enumerate(infos):
        groups.setdefault(info.name, []).append(index)
    batch = batch_type(combined, [info.name for info in infos], [c.handler for c in checked], seconds)
    recorded = dist_autograd_contexts_exist()  # parameters must travel as graph tensors there
    for indices in groups.values():
        sub = [_wire(checked[i].handler, checked[i].args, checked[i].kwargs, recorded) for i in indices]
        info = infos[indices[0]]
        try:
            if len(sub) == 1:
                sent = rpc.rpc_async(info, _body(sub[0][0]), sub[0], timeout=_NO_RPC_TIMEOUT)
                sent.add_done_callback(partial(batch.answered, indices[0]))
            else:
                sent = rpc.rpc_async(info, _run_many, (sub,), timeout=_NO_RPC_TIMEOUT)
                sent.add_done_callback(partial(batch.answered_group, indices))
        except Exception as exc:  # nothing was sent for these calls (earlier ones were: dropped)
            batch.combined = None
            raise _unsent(exc, batch.group_label(indices), info.name) from exc
    _watch(batch, seconds)
    return combined


def call_grouped(calls: Iterable[HostCall | tuple], timeout: float | None = None) -> list[Any]:
    """:func:`call_grouped_async`, waited for: the results in order, or the first failure
    with its original type, naming the worker and the call's index."""
    return wait_plain(call_grouped_async(calls, timeout))


def call_one(call: HostCall | tuple, timeout: float | None = None) -> Any:
    """``call_all([call], timeout)[0]``, waited for in the calling thread, for a handler whose
    answer holds no RRef (a lookup's tensors): the same checks, result, errors and timeout
    (:class:`CallTimeout` naming the worker, ``timeout`` after sending), with no future or
    callback of its own on the caller. RPC keeps the deadline here, and drops an answer that
    comes after it unread: harmless without an RRef in it (see the module docstring).

    Example::

        rows = call_one(("ps0", lookup_rows, (ids,)), timeout=5)
    """
    checked, infos, seconds = _checked_calls([call], timeout)
    (handler, args, kwargs), info = checked[0][1:], infos[0]
    try:
        sent = rpc.rpc_async(info, _body(handler), _wire(handler, args, kwargs, dist_autograd_contexts_exist()),
                             timeout=0 if seconds == math.inf else seconds)
    except Exception as exc:  # nothing was sent
        raise _unsent(exc, call_label(0, 1, handler), info.name) from exc
    try:
        ok, value = sent.wait()
    except BaseException as exc:  # the RPC itself failed (timed out, dead host, shutdown)
        del sent  # its frame in the traceback must not hold the future (see wait_plain)
        exc.__traceback__ = None
        label = call_label(0, 1, handler)
        if is_rpc_initialized() and _TORCH_TIMEOUT in str(exc):
            raise CallTimeout(f"{label} on worker {info.name!r} failed: {timeout_message(seconds, info.name)}") \
                from None
        raise rpc_failure(exc, label, info.name)  # noqa: B904 - its __cause__ is exc
    if not ok:
        raise to_exception(value, f"on worker {info.name!r} in {call_label(0, 1, handler)}")
    return value


#: how torch's RPC agent says that a call ran past its timeout
_TORCH_TIMEOUT = "RPC ran for more than set timeout"


def call_all(calls: Iterable[HostCall | tuple], timeout: float | None = None) -> list[Any]:
    """Run every call concurrently and return their results in order (see :func:`call_all_async`).

    Raises the first failure, with its original type, naming the worker and the call's index.

    Example::

        outs = call_all([("worker1", handler, (x,)), ("worker2", handler, (y,), {"scale": 2})], timeout=5)
    """
    return wait_plain(call_all_async(calls, timeout))
