"""The step transport every owner of server-side parameters uses (a PSModel, a table, a
collection): a step's pushes as push plans, sent one message per server with the lookups
prefetched behind them, settled part by part, and held in flight until the next call on the
owner lands them.

Nothing here knows a table or a dense parameter: the tables install how their pushes to one
server travel packed together (:func:`set_push_packer`), and a prefetch handed to a
:class:`Flight` takes its answers itself (``take_answers``)."""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from functools import partial
from typing import Any, Callable, Iterable, NamedTuple, Protocol, Sequence, runtime_checkable

import torch

from remote_module._core import CallTimeout, call_grouped_each_async, timeout_seconds, to_exception


def do_nothing(*_: Any) -> None:
    """A push plan's callback with nothing to do (its ``done`` or ``failed``, say)."""


class PushPlan(NamedTuple):
    """One part of a step (a table's pushes, a PSModel's dense part, its settings) as the step
    transport sends and settles it: ``calls`` (host calls), then ``done()`` when they all
    succeeded, or ``failed()`` (keep the gradients for a retry) when one did not.

    ``answered`` (optional) gets the calls' answers before ``done()``; ``partly`` (optional)
    gets, before ``failed()``, which of the calls succeeded (a geo push: the rows a server took
    are pushed, whatever the others did). A plan of several parts (a collection's tables pushed
    together, ``tables/_packed.py``) gives ``settle_parts`` instead: it gets every call's
    outcome ``(ok, value)``, settles each part itself and returns the first failure (None: all
    went through); ``done``, ``failed`` and the others are then left out, but ``failed()`` still
    runs when nothing could be sent."""

    calls: list
    done: Callable[[], None] = do_nothing
    failed: Callable[[], None] = do_nothing
    answered: Callable[[list], None] | None = None
    partly: Callable[[list], None] | None = None
    settle_parts: Callable[[list], BaseException | None] | None = None

    def settle(self, outcomes: list) -> BaseException | None:
        """Settle this plan by its calls' ``outcomes`` (``(ok, value)`` each); the first failure."""
        if self.settle_parts is not None:
            return self.settle_parts(outcomes)
        failure = next((value for ok, value in outcomes if not ok), None)
        if failure is None:
            if self.answered is not None:
                self.answered([value for _, value in outcomes])
            self.done()
        else:
            if self.partly is not None:
                self.partly([ok for ok, _ in outcomes])
            self.failed()
        return failure


def run_push_plans(plans: Sequence[PushPlan], timeout: float | None) -> None:
    """Send the pushes of several plans (tables', a PSModel's dense part), the calls to one
    server in one message, and settle each plan by its own calls: ``done()`` when they all
    succeeded, ``failed()`` (keep the gradients for a retry) when one did not, as a plan sent
    alone would be. The first failure is raised once every call was answered; when nothing
    could be sent, every plan is failed."""
    send_push_plans(plans, timeout).settle()


def send_push_plans(plans: Sequence[PushPlan], timeout: float | None, reads: Sequence[tuple] = ()) -> SentPushes:
    """:func:`run_push_plans` without waiting: send the pushes now, and after them ``reads``
    (lookups, in the same message as the pushes to their server: a server runs the calls of a
    message in order, so each read sees those pushes); the :class:`SentPushes` settles them.
    When nothing could be sent every plan is failed and this raises."""
    try:
        future, unpack = _send([call for plan in plans for call in plan.calls], list(reads), timeout)
    except BaseException:  # nothing was sent (a call that cannot be sent, RPC down)
        for plan in plans:
            plan.failed()
        raise
    return SentPushes(list(plans), future, unpack)


class SentPushes:
    """A step's pushes sent (:func:`send_push_plans`), and the reads sent after them."""

    def __init__(self, plans: list[PushPlan], future: Any, unpack: Callable[[list], tuple]) -> None:
        self.plans, self._future, self._unpack = plans, future, unpack

    def settle(self) -> list:
        """Wait, settle each plan as :func:`run_push_plans` does (raising the first push
        failure) and return the reads' outcomes, ``(True, answer)`` or ``(False, exception)``."""
        outcomes, read_outcomes = self._unpack(self._future.wait())
        first: BaseException | None = None
        at = 0
        for plan in self.plans:
            failure = plan.settle(outcomes[at:at + len(plan.calls)])
            at += len(plan.calls)
            if first is None:
                first = failure
        if first is not None:
            raise first
        return read_outcomes

    def failure_check(self) -> Callable[[], Any]:
        """What tells, once answered, what went wrong without settling anything
        (:func:`_failure_of`); it holds the message's answer only, not the plans (so a
        finalizer holding it keeps no table or model alive)."""
        return partial(_failure_of, self._future, self._unpack)


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


def _unlanded(failure: Callable[[], Any], names: Sequence[str], future: Any) -> None:
    """A step's :class:`Flight` dropped unlanded: :func:`_report_unlanded`, and its record of
    the message in flight kept as an event only (:func:`_orphaned`)."""
    _orphaned(names, future)
    _report_unlanded(failure)


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


def settings_plans(settings: dict, last_sent: dict | None, servers: Sequence[str], handler: Callable,
                   args: tuple, taken: Callable[[dict], None]) -> list[PushPlan]:
    """The plan that tells ``servers`` the settings of an object's ``ps_optimizer`` (a table's
    or a PSModel's: ``handler(*args, settings)``, its servers' ``_set_settings``), when they
    changed since the servers last took them (``last_sent``); sent ahead of the step's pushes,
    in the same message, so the servers apply them to those pushes. ``taken(settings)`` once
    they took them."""
    if settings == last_sent or not servers:
        return []
    return [PushPlan([(server, handler, (*args, settings)) for server in servers], partial(taken, settings))]


def finished(done: set, part: Any, finish: Callable[[], None]) -> None:
    """A part of a step (a table, a PSModel's dense part) whose pushes succeeded: ``finish()``,
    and remember it, so a retried ``step()`` does not push it again."""
    finish()
    done.add(part)


#: the last step's message in flight of each PSModel, table and collection of this process, by
#: name: an object built again under a name (a notebook cell run twice right after a step)
#: waits for it before it attaches, so that it starts at the step the servers then have
#: (:func:`wait_for_earlier`). The message's future while its :class:`Flight` lives (which holds
#: it anyway: a step pays a dict write, no callback), taken off when the flight lands; an event
#: set once the message is answered when the flight is dropped unlanded (its object gone right
#: after a step), so nothing of the answer (a sync PSModel's values) outlives the object
_last_sent: dict[str, Any] = {}
_last_sent_lock = threading.Lock()


def _sending(names: Sequence[str], future: Any) -> None:
    """A step's message ``future`` in flight for the objects ``names`` (see :data:`_last_sent`)."""
    with _last_sent_lock:
        for name in names:
            _last_sent[name] = future


def _landed(names: Sequence[str], record: Any) -> None:
    """The message of ``record`` (its future, or the event standing for it) needs no more
    waiting for: its record goes (a newer one stays)."""
    with _last_sent_lock:
        for name in names:
            if _last_sent.get(name) is record:
                del _last_sent[name]


def _orphaned(names: Sequence[str], future: Any) -> None:
    """The flight of ``future`` was dropped unlanded: its record becomes an event, set and
    taken off once the message is answered."""
    answered = threading.Event()
    with _last_sent_lock:
        mine = [name for name in names if _last_sent.get(name) is future]
        for name in mine:
            _last_sent[name] = answered
    if mine:
        future.add_done_callback(partial(_answered, mine, answered))


def _answered(names: list[str], answered: threading.Event, _: Any) -> None:
    _landed(names, answered)
    answered.set()


def wait_for_earlier(name: str, timeout: float | None, what: str) -> None:
    """Wait for the pushes in flight of an earlier object of this process named ``name``, if
    any, for ``timeout`` at most (the new object's, :func:`timeout_seconds`): past it, a
    ``CallTimeout`` (``what``: the object being built, for the message) and nothing attached.
    Their failure is not raised here: it is that object's (raised by its next call, or warned
    when it is gone)."""
    with _last_sent_lock:
        entry = _last_sent.get(name)
    if entry is None:
        return
    if isinstance(entry, threading.Event):
        answered = entry
    elif entry.done():
        _landed([name], entry)  # (answered: the record has done its part)
        return
    else:
        answered = threading.Event()
        entry.add_done_callback(lambda _: answered.set())
    seconds = timeout_seconds(timeout)
    if not answered.wait(None if seconds == math.inf else seconds):
        raise CallTimeout(
            f"{what}: an earlier object of this process named {name!r} has the pushes of its last step() in "
            f"flight, unanswered after {seconds:g} s (timeout={seconds:g} s); this one attaches after them, so "
            "that it starts at the step they make. A sync step is answered once every trainer pushed it; or a "
            "server is not answering. Call flush() on the earlier object to see, or build this one again later")


class InFlight:
    """A part of an object whose ``step()`` returns with its pushes in flight, landed by the next
    call on it or on one of its tables (a PSModel, a collection): ``_flight``, the last step's
    :class:`Flight` (None when nothing is in flight), which the object declares at construction
    and after unpickling (``_flight = None``)."""

    _flight: Flight | None

    def _keep_in_flight(self, tables: Iterable[Any], sent: SentPushes, done: set,
                        prefetches: Sequence[Any] = ()) -> None:
        """This step's pushes ``sent`` in flight: landed by the next call on this object or on
        one of its ``tables``; once its pushes succeeded, ``done`` (the parts stepped, see
        :func:`finished`) is cleared."""
        names = [getattr(self, "name", None)]
        names += [t.name for t in tables]
        flight = Flight(sent, prefetches, done.clear, [n for n in names if isinstance(n, str)])
        self._flight = flight
        for table in tables:  # a table used on its own lands it first
            table._join_flight(flight)

    def _land_in_flight(self, tables: Iterable[Any]) -> None:
        """Wait for the pushes in flight of this object's last step and of its ``tables``' own,
        raising a failure once."""
        # taken off only once landed: a second thread's call meanwhile waits for the landing (on
        # the flight's lock) instead of going on as if nothing were in flight (a sync forward would
        # pull at the step before this one and run on the values before it)
        flight = self._flight
        if flight is not None:
            try:
                flight.land()
            finally:
                if self._flight is flight:
                    self._flight = None
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
    kept for a retry where a push failed), hands the lookups' answers to the prefetch and, the
    pushes through, calls ``landed()``; a push failure is raised by the first :meth:`land`
    only (a collection's step is landed by whichever of its tables is used first, and each
    failed table has kept its gradients)."""

    def __init__(self, sent: SentPushes, prefetches: Sequence[Any] = (),
                 landed: Callable[[], None] = do_nothing, names: Sequence[str] = ()) -> None:
        # (prefetches: tables/_prefetch.py's Prefetch; their reads, in order, follow the pushes)
        self._sent: SentPushes | None = sent
        # (names: the objects whose step this is, see _last_sent)
        self._names = list(names)
        _sending(self._names, sent._future)
        self.prefetches, self._landed = list(prefetches), landed
        self._lock = threading.RLock()  # (a landing that lands again, in its callbacks, returns at once)
        # never landed (the process ends, or the table is dropped, right after a step): a failed
        # push is still reported, as a warning
        self._unlanded = weakref.finalize(self, _unlanded, sent.failure_check(), self._names, sent._future)

    def land(self) -> None:
        with self._lock:
            sent, self._sent = self._sent, None
            if sent is None:
                return
            self._unlanded.detach()
            try:
                reads = sent.settle()
            except BaseException:
                for prefetch in self.prefetches:
                    prefetch.failed = True
                raise
            finally:
                _landed(self._names, sent._future)
            self._landed()
            at = 0
            for prefetch in self.prefetches:  # (each takes its reads' outcomes, in order)
                at = prefetch.take_answers(reads, at)


@runtime_checkable
class SteppedTable(Protocol):
    """What a table (``ShardedEmbedding`` and its subclasses) offers its holders, the objects
    that step it with their own pushes (a PSModel holding it, which finds its tables by this
    protocol, so that ``dense/`` imports no table module; a collection) and ``prefetching``:
    they use these members only. (The table's own parts, in ``tables/``, use more.) The table
    classes subclass it, after ``nn.Module`` (whose ``__init__`` is the one that runs), and
    holders find them by it nominally (``SteppedTable in type(m).__mro__``: ``isinstance``
    would match any module forwarding attribute reads, as ``torch.compile``'s wrapper does)."""

    #: the job-wide name of the table (what its servers know it by)
    name: str
    #: the PS mode it trains in (a holder's must be the same)
    ps_mode: str
    #: the trainers of the table (a holder's must be the same)
    num_trainers: int
    #: the width of its rows
    embedding_dim: int
    #: its zero-size parameter, whose ``.grad`` backward sets (a PSModel leaves it out of its blocks)
    grad_marker: torch.Tensor
    #: the servers' row-wise optimizer as a torch.optim.Optimizer (a holder steps it at its step)
    ps_optimizer: torch.optim.Optimizer
    #: the table's step count, as this trainer has it (the step its next push is)
    _step: int
    #: its prefetched lookups (``tables/_prefetch.PrefetchQueue``): a holder's step sends the
    #: ones due with its pushes, and runs the plans ``prefetching`` queued after the step
    _prefetches: Any

    def _row_settings(self) -> dict:
        """Its ps_optimizer's settings for the next push, checked (``ValueError`` before any
        gradient is taken)."""

    def _settings_plans(self, settings: dict) -> list[PushPlan]:
        """The plans that send ``settings`` (:meth:`_row_settings`'s) ahead of its push, when
        its servers do not have them yet."""

    def _push_plan(self, taken: list | None = None) -> PushPlan | None:
        """Its step's push (of ``taken``, the gradients :meth:`_take_for_step` took, when
        given), or None when the step pushes nothing (geo, between pushes)."""

    def _take_for_step(self) -> list:
        """The gradients recorded since its last step, taken for a push."""

    def _take_packed_gradient(self) -> Any:
        """The last gradient recorded together with other tables' (a collection's lookup:
        ``tables/_recording.RecordedTogether``), taken; None when there is none."""

    def _geo_flush_plan(self) -> PushPlan | None:
        """geo: the push of the rows trained since the last push (None: nothing to push)."""

    def _wait_pushes(self) -> None:
        """Wait for its pushes in flight (a failure raises here, once)."""

    def _join_flight(self, flight: Flight) -> None:
        """A holder's step sent its pushes: the next call on the table lands ``flight`` first."""

    def _plan_state(self) -> tuple:
        """What a lookup's plan depends on besides its arguments (whether it records, its dtype)."""

    def _prefetch_input(self, value: Any, queued: bool = False, overlap: bool = False) -> Any:
        """``prefetching``: a prefetch of a batch's input for it."""

    def _check_optimizer_state(self, state: Any) -> None:
        """What loading ``state`` (its ``optimizer_state_dict()``) checks, before anything changes."""

    def _check_delta(self, delta: Any) -> None:
        """What loading ``delta`` (its ``delta_state_dict()``) checks, before anything changes."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients recorded since its last step."""

    def flush(self) -> None:
        """Push or apply what waits (geo's deltas, half_async's queue)."""

    def optimizer_state_dict(self) -> dict:
        """Its servers' optimizer state."""

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Load :meth:`optimizer_state_dict`'s state."""

    def table_stats(self) -> dict:
        """Its rows on its servers (held, admitted, evicted, bytes, merges)."""

    def delta_state_dict(self, token: str) -> dict:
        """What changed since this ``token``'s last call."""

    def load_delta_state_dict(self, delta: dict) -> None:
        """Load :meth:`delta_state_dict`'s delta."""


class PooledTable(SteppedTable, Protocol):
    """A :class:`SteppedTable` that pools bags (``ShardedEmbeddingBag``), as a collection's
    tables are: what the collection uses besides."""

    def _bag_args(self, input: Any, offsets: Any, per_sample_weights: Any) -> tuple:
        """A forward's arguments, checked and in the form its lookups take them."""

    def _lookup_plan(self, input: Any, offsets: Any, per_sample_weights: Any, wait_s: float | None = None) -> Any:
        """Its lookup of those arguments in two halves (``tables/_lookups.LookupPlan``)."""
