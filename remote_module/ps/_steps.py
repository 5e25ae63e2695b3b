"""The step transport every owner of server-side parameters uses (a PSModel, a table, a
collection): a step's pushes as push plans, sent one message per server with the lookups
prefetched behind them, settled part by part, and held in flight until the next call on the
owner lands them.

Nothing here knows a table or a dense parameter: the tables install how their pushes to one
server travel packed together (:func:`set_push_packer`), and a prefetch handed to a
:class:`Flight` takes its answers itself (``take_answers``)."""

from __future__ import annotations

import threading
import warnings
import weakref
from functools import partial
from typing import Any, Callable, Iterable, Sequence

from remote_module._core import call_grouped_each_async, to_exception

# (host calls, done: () -> None, failed: () -> None[, answered: (answers) -> None[, partly: (oks) ->
# None]]), as a table's _push_plan() gives it; ``answered`` (optional, may be None) gets the calls'
# answers before ``done()`` (an ``answered`` marked ``settles_parts`` gets every call's outcome
# instead, settles the plan's parts itself and returns the first failure: a collection's tables
# pushed together, tables/_packed.py); ``partly`` (optional) gets, before ``failed()``, which of the
# calls succeeded (a geo push: the rows a server took are pushed, whatever the others did)
PushPlan = tuple


def nothing() -> None:
    """A push plan's part that has nothing to do (its ``done`` or ``failed``)."""


def run_push_plans(plans: Sequence[PushPlan], timeout: float | None) -> None:
    """Send the pushes of several plans (tables', a PSModel's dense part), the calls to one
    server in one message, and settle each plan by its own calls: ``done()`` when they all
    succeeded, ``failed()`` (keep the gradients for a retry) when one did not, as a plan sent
    alone would be. The first failure is raised once every call was answered; when nothing
    could be sent, every plan is failed."""
    send_push_plans(plans, timeout)()


def send_push_plans(plans: Sequence[PushPlan], timeout: float | None, reads: Sequence[tuple] = ()
                    ) -> Callable[[], list]:
    """:func:`run_push_plans` without waiting: send the pushes now, and after them ``reads``
    (lookups, in the same message as the pushes to their server: a server runs the calls of a
    message in order, so each read sees those pushes), and return ``settle()``, which waits,
    settles each plan as :func:`run_push_plans` does (raising the first push failure) and
    returns the reads' outcomes, ``(True, answer)`` or ``(False, exception)``. When nothing
    could be sent every plan is failed and this raises."""
    try:
        future, unpack = _send([call for plan in plans for call in plan[0]], list(reads), timeout)
    except BaseException:  # nothing was sent (a call that cannot be sent, RPC down)
        for plan in plans:
            plan[2]()
        raise

    def settle() -> list:
        outcomes, read_outcomes = unpack(future.wait())
        first: BaseException | None = None
        at = 0
        for plan in plans:
            calls, done, failed = plan[:3]
            mine = outcomes[at:at + len(calls)]
            at += len(calls)
            if len(plan) > 3 and getattr(plan[3], "settles_parts", False):
                # a plan of several parts (a collection's tables pushed together): it settles each
                # part by the outcomes of its calls, and returns the first part's failure
                failure = plan[3](mine)
                if failure is not None:
                    first = first if first is not None else failure
                continue
            failure = next((value for ok, value in mine if not ok), None)
            if failure is None:
                if len(plan) > 3 and plan[3] is not None:  # a plan that wants its calls' answers
                    plan[3]([value for _, value in mine])
                done()
            else:
                if len(plan) > 4 and plan[4] is not None:  # a plan that settles call by call
                    plan[4]([ok for ok, _ in mine])
                failed()
                first = first if first is not None else failure
        if first is not None:
            raise first
        return read_outcomes

    settle.failure = partial(_failure_of, future, unpack)  # type: ignore[attr-defined]  (Flight's)
    return settle


def _failure_of(future: Any, unpack: Callable[[list], tuple]) -> Any:
    """What went wrong with a step's message, once answered, without settling it: the first
    push's failure, or a sync push answered as not applied in time (``(None, message)``, see
    ``dense._server._push_applied``); None if all went through or no answer came yet."""
    if not future.done():
        return None
    try:
        outcomes, _ = unpack(future.value())
    except BaseException as exc:
        return exc
    for ok, value in outcomes:
        if not ok:
            return value
        if isinstance(value, tuple) and len(value) == 2 and value[0] is None and isinstance(value[1], str):
            return value[1]
        if isinstance(value, list):  # several tables' pushes in one call: each one's outcome
            failed = next((v for o, v in value if isinstance(o, bool) and not o), None) if all(
                isinstance(e, tuple) and len(e) == 2 for e in value) else None
            if failed is not None:
                return to_exception(failed, "in the push of a table")
    return None


def _report_unlanded(failure: Callable[[], Any]) -> None:
    """A step's pushes never waited for (the last call on a table or model was that step(),
    and the process is ending, or the object is gone): warn if they failed, as local torch
    would have raised at that step."""
    what = failure()
    if what is not None:
        warnings.warn(f"the pushes of a last step() failed and nothing waited for them (no call on the table or "
                      f"model came after that step; call flush() after the last step() to get its outcome): "
                      f"{what}", RuntimeWarning)


def report_unpushed(what: str, left: Callable[[], int]) -> None:
    """geo: a table or model gone (or the process ending) with local training never pushed
    (``left()``: how much, 0 for none): warn, as those steps are lost to the servers."""
    try:
        n = left()
    except Exception:  # noqa: BLE001 - a warning at exit must not raise
        return
    if n:
        warnings.warn(f"{what} (geo) ended with {n} never pushed: the local steps since its last push (every "
                      f"geo_push_every steps) did not reach the servers; call flush() after the last step() to "
                      f"push them", RuntimeWarning)


def settings_plans(owner: Any, settings: dict, servers: Sequence[str], handler: Callable) -> list:
    """The plan that tells ``servers`` the settings of ``owner``'s ``ps_optimizer`` (a table's
    or a PSModel's: ``handler``, its servers' ``_set_settings``), when they changed since the
    servers last took them (``owner._sent_settings``); sent ahead of the step's pushes, in the
    same message, so the servers apply them to those pushes."""
    if settings == owner.__dict__.get("_sent_settings") or not servers:
        return []
    calls = [(server, handler, (owner.name, owner._trainer, settings)) for server in servers]

    def done() -> None:
        owner.__dict__["_sent_settings"] = settings

    return [(calls, done, nothing)]


def finished(done: set, part: Any, finish: Callable[[], None]) -> None:
    """A part of a step (a table, a PSModel's dense part) whose pushes succeeded: ``finish()``,
    and remember it, so a retried ``step()`` does not push it again."""
    finish()
    done.add(part)


def fly(owner: Any, tables: Iterable, settle: Callable[[], list], done: set,
        prefetches: Sequence[Any] = ()) -> None:
    """A step of ``owner`` (a collection, a PSModel) with its pushes in flight: landed by the
    next call on ``owner`` or on one of its ``tables``; once its pushes succeeded, ``done`` (the
    parts stepped, see :func:`finished`) is cleared."""
    def landed() -> list:
        got = settle()
        done.clear()
        return got

    landed.failure = getattr(settle, "failure", None)  # type: ignore[attr-defined]
    flight = Flight(landed, prefetches)
    owner._flight = flight
    for table in tables:  # a table used on its own lands it first
        table._flight = flight


def land(owner: Any, tables: Iterable) -> None:
    """Wait for the pushes in flight of ``owner``'s last step (a collection's, a PSModel's)
    and of its ``tables``' own, raising a failure once."""
    # taken off only once landed: a second thread's call meanwhile waits for the landing (on
    # the flight's lock) instead of going on as if nothing were in flight (a sync forward would
    # pull at the step before this one and run on the values before it)
    flight = owner.__dict__.get("_flight")
    if flight is not None:
        try:
            flight.land()
        finally:
            if owner.__dict__.get("_flight") is flight:
                owner.__dict__.pop("_flight", None)
    for table in tables:
        table._wait_pushes()


def _each_alone(calls: list) -> tuple[list, Callable[[list], list]]:
    """No packing: every call travels as it is, and answers for itself."""
    return calls, list


#: how the pushes of a step travel: ``packer(calls) -> (calls sent, unpack)``, ``unpack(their
#: outcomes)`` giving each of ``calls``' outcome; the tables install theirs (several tables'
#: pushes to one server in one call, tables/_pushes.py)
_packer: list[Callable[[list], tuple[list, Callable[[list], list]]]] = [_each_alone]


def set_push_packer(packer: Callable[[list], tuple[list, Callable[[list], list]]]) -> None:
    """Send the pushes of every step through ``packer`` (see :data:`_packer`)."""
    _packer[0] = packer


def _send(calls: list, reads: list, timeout: float | None) -> tuple[Any, Callable[[list], tuple]]:
    """Send ``calls`` (pushes, packed by the installed packer) and then ``reads`` with
    :func:`call_grouped_each_async`: the calls to one server in one message, run in order
    there. Returns the future and ``unpack(answers) -> (each push's outcome, each read's
    outcome)``."""
    sent, unpack_pushes = _packer[0](calls)
    future = call_grouped_each_async(sent + reads, timeout=timeout)

    def unpack(got: list) -> tuple[list, list]:
        return unpack_pushes(got[:len(sent)]), list(got[len(sent):])

    return future, unpack


class Flight:
    """A step's pushes in flight (sent, not yet answered), and the prefetched lookups sent
    after them: :meth:`land` waits for them once, settles the step (its tables' gradients are
    kept for a retry where a push failed) and hands the lookups' answers to the prefetch; a
    push failure is raised by the first :meth:`land` only (a collection's step is landed by
    whichever of its tables is used first, and each failed table has kept its gradients)."""

    def __init__(self, settle: Callable[[], list], prefetches: Sequence[Any] = ()) -> None:
        # (prefetches: tables/_prefetch.py's Prefetch; their reads, in order, follow the pushes)
        self._settle, self.prefetches = settle, list(prefetches)
        self._lock = threading.RLock()  # (a landing that lands again, in its callbacks, returns at once)
        failure = getattr(settle, "failure", None)
        # never landed (the process ends, or the table is dropped, right after a step): a failed
        # push is still reported, as a warning
        self._unlanded = weakref.finalize(self, _report_unlanded, failure) if failure is not None else None

    def land(self) -> None:
        with self._lock:
            settle, self._settle = self._settle, None
            if settle is None:
                return
            if self._unlanded is not None:
                self._unlanded.detach()
            try:
                reads = settle()
            except BaseException:
                for prefetch in self.prefetches:
                    prefetch.failed = True
                raise
            at = 0
            for prefetch in self.prefetches:  # (each takes its reads' outcomes, in order)
                at = prefetch.take_answers(reads, at)


class SteppedTable:
    """The base of the modules whose rows live on table servers and whose pushes a step owner
    (a PSModel holding them) sends with its own: ``ShardedEmbedding`` and its subclasses. A
    PSModel finds its tables by this class, so that ``dense/`` imports no table module. What a
    table offers its owner is ``ShardedEmbedding``'s: ``name``, ``ps_mode``, ``num_trainers``,
    ``grad_marker``, ``ps_optimizer``, ``_step``, ``_row_settings()``, ``_settings_plans()``,
    ``_push_plan()``, ``_lookahead()``, ``_wait_pushes()``, ``zero_grad()`` and ``flush()``."""
