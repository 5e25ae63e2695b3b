"""ShardedEmbedding: an ``nn.Embedding`` whose rows live on parameter servers, sliced into row
blocks. Lookups fetch only the unique ids, from the servers that own them, concurrently;
``step()`` pushes only the touched rows' gradients, which the servers apply with a row-wise
optimizer (``_rowwise``). ``ShardedEmbeddingBag`` (``_embedding_bag``) builds on it, pooling
bags on the servers; the servers' side is ``_table_server``."""

from __future__ import annotations

import threading
import time
import uuid
import warnings
import weakref
from functools import partial
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from remote_module._core import (
    backward_accumulates,
    call_all,
    call_grouped_each_async,
    call_one,
    nested_seconds,
    positive_int,
    timeout_seconds,
    to_exception,
    user_stacklevel,
)
from remote_module.ps._dispatch import RoundRobin, check_servers
from remote_module.ps._modes import PS_MODES, StepRefusal, refusals_told
from remote_module.ps._optimizer import GroupedPSOptimizer, PSOptimizer, class_defaults
from remote_module.ps._placement import _index, block_name, slice_blocks
from remote_module.ps._rowwise import coalesce, row_gradients, row_optimizer
from remote_module.ps.tables._checkpoints import TableCheckpoints
from remote_module.ps.tables._geo_cache import GeoCache
from remote_module.ps.tables.lifetime._admission import DEFAULT_SKETCH_BYTES, counter_bits
from remote_module.ps.tables.server import _handlers as _table_server
from remote_module.ps.tables.server._rows import check_ids
from rpc_backend.options import positive_seconds
from rpc_backend.watch import add_status

#: backward passes a table records without a step() before it warns that its gradients are never
#: pushed, where no local optimizer step told it sooner (gradient accumulation stays below this)
UNPUSHED_BACKWARDS = 10

_live_tables: "weakref.WeakSet[ShardedEmbedding]" = weakref.WeakSet()
#: other owners of server-side parameters told of local optimizer steps (PSModels)
_live_watchers: "weakref.WeakSet[Any]" = weakref.WeakSet()
_hook_lock = threading.Lock()
_optimizer_hook: Any = None


def _on_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch.optim's global post-step hook: tell every table that a local optimizer stepped."""
    # (the servers' optimizer's stand-in, or a collection's group of them: its owner pushed, and a
    # scheduler on it is how the tables' lr is meant to change)
    if isinstance(optimizer, (PSOptimizer, GroupedPSOptimizer)):
        return
    thread = threading.get_ident()
    for table in list(_live_tables):
        table._local_optimizer_stepped(thread, optimizer)
    for owner in list(_live_watchers):
        owner._local_optimizer_stepped(thread, optimizer)


def _watch_optimizer_steps() -> None:
    """Register :func:`_on_optimizer_step` with torch.optim, once per process."""
    global _optimizer_hook
    with _hook_lock:
        if _optimizer_hook is None:
            _optimizer_hook = register_optimizer_step_post_hook(_on_optimizer_step)


def watch_local_optimizers(owner: Any) -> None:
    """Call ``owner._local_optimizer_stepped(thread, optimizer)`` after every local torch.optim
    step (not a PSOptimizer's) while ``owner`` lives (a PSModel, whose dense parameters, as a
    table's rows, step on the servers)."""
    _live_watchers.add(owner)
    _watch_optimizer_steps()


def changed_group_lr(seen: "weakref.WeakKeyDictionary", optimizer: torch.optim.Optimizer,
                     params: Any) -> tuple[float, float] | None:
    """``(first, now)`` when the lr of ``optimizer``'s param group holding any of ``params``
    (tensors) changed since ``optimizer``'s first step seen (``seen`` keeps the baselines; a
    group added later starts a new one), else None."""
    entry = seen.get(optimizer)
    if entry is None or entry[0] != len(optimizer.param_groups):
        ids = {id(p) for p in params}
        group = next((g for g in optimizer.param_groups if any(id(p) in ids for p in g["params"])), None)
        entry = (len(optimizer.param_groups), group, None if group is None else float(group["lr"]))
        seen[optimizer] = entry
    _, group, first = entry
    if group is None or float(group["lr"]) == first:
        return None
    return first, float(group["lr"])


class _Recorded(torch.autograd.Function):
    """``rows`` unchanged, recorded for :meth:`ShardedEmbedding.step`: backward hands their
    gradient to ``record`` and gives the table's zero-size ``grad_marker`` a (zero-size)
    gradient, so the marker's ``.grad`` says whether a gradient was recorded since the last
    ``zero_grad()``, as a parameter's does."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, marker: torch.Tensor, record: Callable, uniq: torch.Tensor,
                accumulator: Any) -> torch.Tensor:
        ctx.record, ctx.uniq, ctx.accumulator = record, uniq, accumulator
        ctx.marker = (marker.dtype, marker.device)  # (a model moved with .double() or .to(device))
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # as a parameter's .grad: only a backward that accumulates into the marker records (not
        # torch.autograd.grad(), nor backward(inputs=...) without the table)
        if backward_accumulates(ctx.accumulator):
            ctx.record(ctx.uniq, grad.to(torch.float32))  # the servers' rows are float32, whatever the model's dtype
        dtype, device = ctx.marker
        return None, torch.zeros(0, dtype=dtype, device=device), None, None, None


def lookup_calls(calls: list, timeout: float | None) -> list:
    """The answers of a lookup's host calls (:func:`call_all`; one call waited for in this
    thread, :func:`call_one`: a lookup's answer holds tensors only)."""
    if len(calls) == 1:
        return [call_one(calls[0], timeout)]
    return call_all(calls, timeout=timeout)


# (host calls, done: () -> None, failed: () -> None[, answered: (answers) -> None[, partly: (oks) ->
# None]]), as _push_plan() gives it; ``answered`` (optional, may be None) gets the calls' answers
# before ``done()`` (an ``answered`` marked ``settles_parts`` gets every call's outcome instead,
# settles the plan's parts itself and returns the first failure: _packed.push_together);
# ``partly`` (optional) gets, before ``failed()``, which of the calls succeeded (a geo push: the
# rows a server took are pushed, whatever the others did)
PushPlan = tuple


def nothing() -> None:
    """A push plan's part that has nothing to do (its ``done`` or ``failed``)."""


def table_push_failure(server: str, table: str, failure: Any) -> BaseException:
    """The failure of one table's push among several in one ``_push_tables`` call, as raised."""
    return to_exception(failure, f"on worker {server!r} in the push of table {table!r}")


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
        future, unpack = _send_packed([call for plan in plans for call in plan[0]], list(reads), timeout)
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
    ``_dense_server._push_applied``); None if all went through or no answer came yet."""
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
        prefetches: Sequence["Prefetch"] = ()) -> None:
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


def _send_packed(calls: list, reads: list, timeout: float | None) -> tuple[Any, Callable[[list], tuple]]:
    """Send ``calls`` (pushes) and then ``reads`` with :func:`call_grouped_each_async`, the
    tables' pushes (``_push_rows``) to one server packed into one call (``_push_tables``: their
    ids and gradient rows in one tensor each, per row width) that runs them in order and
    answers each one's outcome, as the grouped calls would be run and answered. Returns the
    future and ``unpack(answers) -> (each push's outcome, each read's outcome)``."""
    packs: dict[tuple, list[int]] = {}
    for i, (server, handler, args) in enumerate(calls):
        if handler is _table_server._push_rows and len(args) == 6 and args[3] is not None:
            packs.setdefault((server, args[4].shape[1], args[4].dtype, args[3].dtype), []).append(i)
    packs = {key: members for key, members in packs.items() if len(members) > 1}
    packed = {i for members in packs.values() for i in members}
    sent = [call for i, call in enumerate(calls) if i not in packed]
    alone = len(sent)
    for (server, _, _, _), members in packs.items():
        entries = [(calls[i][2][0], calls[i][2][1], calls[i][2][2], calls[i][2][3].numel(), calls[i][2][5])
                   for i in members]
        sent.append((server, _table_server._push_tables,
                     (entries, torch.cat([calls[i][2][3] for i in members]),
                      torch.cat([calls[i][2][4] for i in members]))))
    pushes = len(sent)
    future = call_grouped_each_async(sent + reads, timeout=timeout)

    def unpack(got: list) -> tuple[list, list]:
        outcomes: list[Any] = [None] * len(calls)
        single = iter(got[:alone])
        for i in range(len(calls)):
            if i not in packed:
                outcomes[i] = next(single)
        for ((server, _, _, _), members), (ok, value) in zip(packs.items(), got[alone:pushes]):
            for j, i in enumerate(members):
                if not ok:  # the message failed (a server down or late): every push it carried did
                    outcomes[i] = (False, value)
                elif value[j][0]:
                    outcomes[i] = (True, None)
                else:
                    outcomes[i] = (False, table_push_failure(server, calls[i][2][0], value[j][1]))
        return outcomes, list(got[pushes:])

    return future, unpack


class Flight:
    """A step's pushes in flight (sent, not yet answered), and the prefetched lookups sent
    after them: :meth:`land` waits for them once, settles the step (its tables' gradients are
    kept for a retry where a push failed) and hands the lookups' answers to the prefetch; a
    push failure is raised by the first :meth:`land` only (a collection's step is landed by
    whichever of its tables is used first, and each failed table has kept its gradients)."""

    def __init__(self, settle: Callable[[], list], prefetches: Sequence["Prefetch"] = ()) -> None:
        self._settle, self.prefetches = settle, list(prefetches)  # (their calls, in order, are the reads)
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
            for prefetch in self.prefetches:  # (each one's merge state reads, then its lookups)
                n = len(prefetch.merge_calls)
                prefetch.merge_state = reads[at:at + n]
                prefetch.got = reads[at + n:at + n + len(prefetch.calls)]
                at += n + len(prefetch.calls)


def _same_value(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return False


def _kept(value: Any) -> Any:
    """A prefetch's copy of an argument, compared by value with the forward's (the caller may
    change its tensor in place meanwhile)."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class Prefetch:
    """A lookup planned ahead by ``prefetch()``: the next forward with equal arguments (by
    value) consumes it; it is sent with the next ``step()``'s pushes (one message per server:
    the servers answer it once they applied them), or at that forward.

    With ``overlap`` (``prefetching(..., overlap=True)``, async mode) it may be sent one step
    earlier, with the step before the next forward's: it then misses that forward's last push.
    A prefetch not consumed by the forward it was planned for is dropped.

    half_async: the forward uses it only if it reflects every merge the servers finished before
    that forward began (:meth:`Ahead.claim`); each server answers, ahead of its lookups, its
    merge count and how long at least before its timer merges (:func:`_table_server._merge_state`)."""

    def __init__(self, key: tuple, records: Any, calls: list, finish: Callable[[list], Any],
                 replan: bool = False, tables: Sequence = (), overlap: bool = False) -> None:
        self.key = tuple(_kept(v) for v in key)
        # the tables it reads, and how often their rows changed on the servers other than by a
        # step (loads, half_async merges): a change after it was sent makes it stale
        self.tables = [(t, t.__dict__.get("_changes", 0)) for t in tables]
        # a forward whose arguments need a gradient (per_sample_weights) plans its own: the
        # output must be a function of its tensors, not of the prefetch's copies
        replan = replan or any(isinstance(v, torch.Tensor) and v.requires_grad for v in key)
        # (what the plan depends on besides the arguments: whether each table records, its dtype)
        self.records, self.calls, self.finish, self.replan = records, calls, finish, replan
        self.overlap = overlap
        self.sent = False  # with a step's pushes
        self.pushes_at: list[int] = []  # each table's pushes sent, once that step was sent
        self.planned = False  # by prefetching() (a forward of other arguments leaves it for its own)
        # the prefetching() loop that planned it (one nested in another keeps apart), and the
        # index of its batch in that loop
        self.loop: object = None
        self.batch = 0
        self.got: list | None = None  # the answers' outcomes, once that step landed
        self.failed = False  # that step's push failed: dropped
        # half_async: the merge state reads sent ahead of its lookups, (server, table names) each,
        # their outcomes once landed, when the step was sent, and what its forward checks on
        # each server ({server: [(name, merges read)]}; None: nothing to check)
        self.merge_calls: list[tuple[str, list[str]]] = []
        self.merge_state: list = []
        self.sent_at = 0.0
        self.checks: dict[str, list[tuple[str, int]]] | None = None

    def merging(self) -> list:
        """Its half_async tables (whose servers merge on their own: by count, or on a timer)."""
        return [t for t, _ in self.tables if t.ps_mode == "half_async"]

    def merge_reads(self) -> list:
        """The reads of each server's merge state to send ahead of its lookups (half_async),
        remembered as :attr:`merge_calls`."""
        merging = self.merging()
        self.merge_calls = []
        for server in dict.fromkeys(server for server, _, _ in self.calls):
            names = [t.name for t in merging if server in t._by_server]
            if names:
                self.merge_calls.append((server, names))
        return [(server, _table_server._merge_state, (names,)) for server, names in self.merge_calls]

    def merges_checked(self, began: float) -> bool:
        """(half_async, answered) Set :attr:`checks`: what the forward that began at ``began``
        (``time.monotonic()``) must ask the servers before using the answers, or None when it
        knows that no merge finished since they were read: every table has this trainer alone
        (``num_trainers=1``: no other pushes merge), none of their pushes came since, and no
        server's timer was due yet. False when a merge state read failed (not to be used)."""
        self.checks = None
        if not self.merge_calls or not self.sent:
            return True
        if not all(ok for ok, _ in self.merge_state):
            return False
        states = [(server, names, state) for (server, names), (_, state) in zip(self.merge_calls, self.merge_state)]
        alone = all(t.num_trainers == 1 for t in self.merging())
        pushed = any(_pushes(t) != n for (t, _), n in zip(self.tables, self.pushes_at))
        due = min(left for _, _, state in states for _, left in state)
        if alone and not pushed and began < self.sent_at + due:
            return True
        self.checks = {server: list(zip(names, (n for n, _ in state))) for server, names, state in states}
        return True

    def checked(self, got: list, send: Callable[[list], list]) -> list:
        """The answers ``got``, each replaced by a fresh lookup where its server merged since it
        was read (one message per server: :func:`_table_server._read_unless_merged`)."""
        calls = [(server, _table_server._read_unless_merged, (self.checks[server], handler, args))
                 for server, handler, args in self.calls]
        return [old if new is None else new for old, new in zip(got, send(calls))]

    def changed(self) -> bool:
        """Whether a table's rows changed since it was sent (a load, a half_async merge): what
        it read is gone."""
        return self.sent and any(t.__dict__.get("_changes", 0) != n for t, n in self.tables)

    def matches(self, key: tuple, records: Any) -> bool:
        """Whether a forward of ``key`` (``records``: as given at construction) may use it."""
        if self.changed():
            return False
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in key):
            return False
        return (records == self.records and len(key) == len(self.key)
                and all(_same_value(a, b) for a, b in zip(key, self.key)))

    def answers(self) -> list | None:
        """The answers of its calls; None if one failed (the step's pushes went through: the
        forward looks up again, so a lookup's failure is raised by a lookup, as without prefetch)."""
        if not all(ok for ok, _ in self.got):
            return None
        return [value for _, value in self.got]


def _trained_rows(geo: GeoCache) -> str | int:
    n = geo.trained()
    return f"{n} trained row(s)" if n else 0


def _pushes(table: Any) -> int:
    return table.__dict__.get("_pushes", 0)


class Ahead:
    """The prefetches of a table or collection, in the order of the forwards they are for. A
    prefetch sent with a step, consumed after later pushes of its tables (by any object: the
    table, a collection, a PSModel), would miss them: it is used only if at most ``overlap``
    (0, or 1) came since."""

    def __init__(self) -> None:
        self.handles: list[Prefetch] = []

    def add(self, handle: Prefetch, queued: bool) -> None:
        """A new prefetch: after the others when ``queued`` (``prefetching``'s later batches),
        else instead of them (``prefetch()``: one at a time)."""
        if queued:
            self.handles.append(handle)
        else:
            self.handles = [handle]

    def take(self, key: tuple, records: Any) -> Prefetch | None:
        """The prefetch for a forward of ``key``: the first that matches it, the ones before it
        dropped, except those another ``prefetching`` loop planned (an evaluation loop's inside
        the training loop's, or the other way round: each keeps its own). With none, a
        ``prefetch()`` is dropped (any other forward drops it), while ``prefetching``'s stay for
        the forwards they were planned for (an eval forward, say)."""
        for k, handle in enumerate(self.handles):
            if handle.matches(key, records):
                loop = handle.loop
                self.handles = [h for h in self.handles[:k] if loop is not None and h.loop is not None
                                and h.loop is not loop] + self.handles[k + 1:]
                return handle
        if self.handles and not self.handles[0].planned:
            self.handles.pop(0)
        # prefetching's that no forward can use any more (their step failed, or a push or a load
        # since made them stale) are dropped: else they hold up the sending of those after them
        # (to_send sends the first two) until a forward matches one of those
        self.handles = [h for h in self.handles if not h.sent or not (h.failed or h.changed() or not self.fresh(h))]
        return None

    def claim(self, key: tuple, records: Any, land: Callable[[], None]) -> Prefetch | None:
        """The prefetch a forward of ``key`` uses (:meth:`take`, :meth:`fresh`), or None; ``land()``
        (the pushes in flight) first, unless it was answered already (sent a step earlier, with
        overlap: used without waiting for them)."""
        began = time.monotonic()  # (half_async: the merges finished before now must be in what it uses)
        handle = self.take(key, records)
        use = handle is not None and not handle.failed and not handle.replan and self.fresh(handle)
        if not use or handle.got is None:
            land()  # (answers the prefetch sent with those pushes)
        if use and not handle.failed and handle.got is not None:
            use = handle.merges_checked(began)
        return handle if use and not handle.failed else None

    @staticmethod
    def output(handle: Prefetch | None, send: Callable[[list], list], plan: Callable[[], tuple]) -> Any:
        """A forward's output: of ``handle``'s answers, or of its calls sent now (``send`` reads
        the steps of now: :func:`at_step`); else, or if one of its lookups failed (looked up
        again, so a lookup's failure is raised by a lookup), of ``plan()``'s calls."""
        if handle is not None:
            if handle.got is not None:
                got = handle.answers()
                if got is not None:
                    return handle.finish(got if handle.checks is None else handle.checked(got, send))
            elif not handle.sent:
                return handle.finish(send(handle.calls))
        calls, finish = plan()
        return finish(send(calls))

    def send(self, plans: Sequence[PushPlan], timeout: float | None, sync: bool,
             step_after: Callable[[str], int]) -> tuple[Callable[[], list], list[Prefetch]]:
        """Send a step's ``plans`` (:func:`send_push_plans`) with the prefetches it carries
        (:meth:`to_send`, reading the steps ``step_after`` gives a table's name once these pushes
        are applied): ``(settle, those prefetches)``."""
        joined = self.to_send(sync)
        settle = send_push_plans(plans, timeout, self.reads(joined, step_after))
        self.stepped(joined)
        return settle, joined

    @staticmethod
    def reads(joined: Sequence[Prefetch], step_after: Callable[[str], int]) -> list:
        """The reads a step sends for the prefetches ``joined`` (:meth:`send`): each one's merge
        state reads (half_async) and lookups, reading the steps ``step_after`` gives."""
        now = time.monotonic()  # (before the message leaves: a server's timer runs out no sooner)
        reads = []
        for handle in joined:
            handle.sent_at = now
            reads += handle.merge_reads()
            reads += at_step(handle.calls, step_after)
        return reads

    @staticmethod
    def fresh(handle: Prefetch) -> bool:
        """Whether ``handle`` misses at most the pushes it may (none; with overlap, one)."""
        if not handle.sent:
            return True
        allowed = 1 if handle.overlap else 0
        return all(_pushes(t) - n <= allowed for (t, _), n in zip(handle.tables, handle.pushes_at))

    def to_send(self, sync: bool) -> list[Prefetch]:
        """What a step sends with its pushes: the next forward's prefetch, if not sent yet; with
        overlap (not in sync mode, nor half_async: the step in between may merge, which a read
        sent before it cannot reflect), the one after it too."""
        out = []
        for k, handle in enumerate(self.handles[:2]):
            if not handle.sent and not handle.replan and (
                    k == 0 or (handle.overlap and not sync and not handle.merging())):
                out.append(handle)
        return out

    @staticmethod
    def stepped(sent: Sequence[Prefetch]) -> None:
        """A step was sent (its tables' pushes counted), and ``sent`` with it."""
        for handle in sent:
            handle.sent, handle.pushes_at = True, [_pushes(t) for t, _ in handle.tables]
            # (what it reads is the rows as of now: a load or a merge before now does not make it stale)
            handle.tables = [(t, t.__dict__.get("_changes", 0)) for t, _ in handle.tables]


#: where a lookup handler takes the table's step (sync: the lookup waits for step - 1)
_STEP_AT = {_table_server._rows_for: 2, _table_server._rows_now: 2, _table_server._bags_when_applied: 5,
            _table_server._bags_now: 5}


#: where a sync lookup handler takes how many of the table's refused steps this trainer was told of
_SEEN_AT = {_table_server._rows_for: 5, _table_server._bags_when_applied: 7, _table_server._pool_tables: 7}

#: sync tables: how many of each table's refused steps (by name) this process was told of (the
#: count its servers gave when it attached, then the count each refusal raised here named)
_refusals_seen: dict[str, int] = {}


def told_refusals(error: BaseException, names: Iterable[str]) -> None:
    """``error``, raised by a lookup of tables ``names``, is the refusal of a sync step of some
    of them (:class:`StepRefusal`): this trainer was told of it, and its next lookups of those
    tables go on (each of their servers fails a lookup of a trainer not told of its last one)."""
    if not isinstance(error, StepRefusal):
        return
    for name in names:
        told = refusals_told(error, f"sharded table {name!r}")
        if told > _refusals_seen.get(name, 0):
            _refusals_seen[name] = told


def at_step(calls: list, step_of: Callable[[str], int]) -> list:
    """``calls`` (a lookup's) reading the steps ``step_of(table name)`` gives now (a lookup
    planned ahead is sent after a step, or at its forward), and, in sync mode, how many of the
    table's refused steps this trainer was told of now (:func:`told_refusals`)."""
    out = []
    for server, handler, args in calls:
        if handler is _table_server._pool_tables:
            args = (args[0], [step_of(n) for n in args[0]], *args[2:])
        elif handler in _STEP_AT:
            at = _STEP_AT[handler]
            args = (*args[:at], step_of(args[0]), *args[at + 1:])
        if handler in _SEEN_AT:
            names = args[0] if handler is _table_server._pool_tables else [args[0]]
            seen = [_refusals_seen.get(n, 0) for n in names]
            at = _SEEN_AT[handler]
            args = (*args[:at], seen if handler is _table_server._pool_tables else seen[0])
        out.append((server, handler, args))
    return out


def _step_line(table: ShardedEmbedding) -> str:
    """What this trainer's heartbeats say of ``table``: the step it is at."""
    return f"step {table._step} of {type(table).__name__} {table.name!r}"


class ShardedEmbedding(TableCheckpoints, nn.Module):
    """An ``nn.Embedding`` (``forward(input)``, same output) whose ``num_embeddings x
    embedding_dim`` rows are sliced into blocks of whole rows over ``servers`` by the same
    rules as a :class:`PSModel`'s parameters (``min_block_size``, ``split_method``).

    ``name`` is job-unique: trainers that pass the same name share one table (and must pass the
    same sizes, servers, mode, optimizer and ``padding_idx``). Sizes and other counts take any
    integer ``operator.index`` takes (``numpy.int64`` too), as torch's. The servers hold the
    rows: ``init="eager"`` creates them all at once; ``init="lazy"`` creates a row on its first
    touch, so a huge table costs memory only for the rows used. Either way a row starts as
    ``N(0, 1)`` drawn from a hash of (``seed``, ``name``, row id): the same rows eager or lazy,
    on any servers, in every run; other tables' and other seeds' rows independent.

    ``sparse`` is torch's keyword, taken so that a port keeps its calls: whatever its value,
    backward gives the looked-up rows' gradients only and the servers step those rows (SGD
    and Adagrad, as a table takes them, step a sparse gradient as torch steps a dense one).

    ``padding_idx`` as ``nn.Embedding``'s: the padding row is created as zeros, a lookup returns
    the row as stored (a checkpoint may set it), and it is never trained (no gradient is
    pushed for it, no optimizer state kept); a bag leaves it out of its pool and its mean.

    After ``loss.backward()``, :meth:`step` pushes ``(row ids, gradient rows)`` for the rows
    this trainer looked up since the last step, and the servers apply ``optimizer``
    (``torch.optim.SGD``, ``Adagrad`` or ``SparseAdam``, as torch steps a sparse gradient) to
    those rows only. ``ps_mode`` as in :class:`PSModel`: ``"sync"`` (each step averages all
    ``num_trainers`` trainers' gradients; lookups wait for the previous step), ``"async"``,
    ``"half_async"`` (pushes summed, applied every ``half_async_merge_every`` pushes or
    ``half_async_merge_s`` seconds), ``"geo"`` (this trainer steps the rows it touched
    locally and every ``geo_push_every`` steps pushes their deltas). Inside a PSModel, the
    PSModel's ``step()`` steps its tables (their mode must be the PSModel's).

    ``state_dict()`` has the local module's key ``weight`` (a lazy table: ``weight.ids`` and
    ``weight.rows``, the touched rows only, which a local module cannot load).

    Long-lived tables (see tutorials/embeddings.md): ``admit_after=k`` (lazy tables) stores an
    id's row only once the id was looked up in ``k`` distinct training steps (counted at the
    push; ``no_grad`` lookups do not count), reading it as its init and dropping its gradients
    until then, counted in a sketch of ``admit_sketch_bytes`` per server; ``evict_after_steps=n``
    drops a row and its optimizer state not stepped in ``n`` of the table's steps (a later
    lookup reads its init again). :meth:`table_stats` reports rows held, admitted, evicted and
    bytes; :meth:`delta_state_dict` / :meth:`load_delta_state_dict` checkpoint only what changed.

    Gradients as a parameter's: the table has one zero-size parameter, ``grad_marker`` (no
    values, never in ``state_dict()``), whose ``.grad`` backward sets. ``zero_grad()`` of any
    module holding the table, or of an optimizer built from its ``parameters()``, sets it to
    ``None``, and the table then drops the gradients recorded before (``zero_grad(
    set_to_none=False)`` zeroes it in place, which a zero-size tensor cannot show: call the
    table's own ``zero_grad()`` then). ``requires_grad_(False)`` freezes the table (nothing
    is recorded). A step without a recorded gradient is no optimizer step (torch skips a
    parameter without one: Adagrad's ``lr_decay`` and SparseAdam's bias correction count
    only steps with one).

    Gradients never pushed warn: the table's rows train only through :meth:`step` (a local
    optimizer of ``model.parameters()`` steps only the zero-size marker). A forward (grad
    enabled) of a table holding gradients recorded before a local ``torch.optim`` optimizer
    stepped (in the thread of the table's forward) and not pushed since, or after
    ``UNPUSHED_BACKWARDS`` (10) backward passes without a step, warns once (``UserWarning``).
    Accumulating gradients over several backward passes before one step is silent.
    The rows step with the lr given in ``optimizer``: a local LR scheduler does not reach it,
    and changing the lr of an optimizer group holding ``grad_marker`` (a scheduler over
    ``model.parameters()``) warns once (``UserWarning``).

    Example (ps0, ps1 only join RPC and wait)::

        emb = ShardedEmbedding(1_000_000, 16, ["ps0", "ps1"], name="user", ps_mode="async")
        out = emb(torch.tensor([[1, 5], [7, 1]]))     # (2, 2, 16)
        out.sum().backward()
        emb.step()                                    # pushes rows 1, 5, 7 only
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        servers: Sequence[str],
        *,
        name: str,
        padding_idx: int | None = None,
        sparse: bool = False,
        optimizer: tuple[type, dict] = (torch.optim.SGD, {"lr": 0.1}),
        init: str = "eager",
        timeout: float | None = None,
        ps_mode: str = "async",
        num_trainers: int = 1,
        split_method: Any = RoundRobin(),
        min_block_size: int = 8192,
        seed: int = 0,
        geo_push_every: int = 100,
        half_async_merge_every: int = 4,
        half_async_merge_s: float = 0.1,
        admit_after: int = 1,
        admit_sketch_bytes: int = DEFAULT_SKETCH_BYTES,
        evict_after_steps: int | None = None,
    ) -> None:
        super().__init__()
        #: zero-size: backward sets its ``.grad``, ``zero_grad()`` clears it (see the class docstring)
        self.grad_marker = nn.Parameter(torch.empty(0))
        # sizes as nn.Embedding takes them: any integer operator.index accepts (numpy.int64...)
        num_embeddings = positive_int(num_embeddings, "num_embeddings")
        embedding_dim = positive_int(embedding_dim, "embedding_dim")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str naming the table, got {name!r}")
        if init not in ("eager", "lazy"):
            raise ValueError(f"init must be 'eager' or 'lazy', got {init!r}")
        if ps_mode not in PS_MODES:
            raise ValueError(f"ps_mode must be one of {', '.join(PS_MODES)}, got {ps_mode!r}")
        num_trainers = positive_int(num_trainers, "num_trainers")
        geo_push_every = positive_int(geo_push_every, "geo_push_every")
        half_async_merge_every = positive_int(half_async_merge_every, "half_async_merge_every")
        min_block_size = positive_int(min_block_size, "min_block_size")
        merge_s = positive_seconds(half_async_merge_s, "half_async_merge_s")
        timeout = None if timeout is None else positive_seconds(timeout, "timeout")
        seed = _index(seed, "seed")
        if seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if not (isinstance(optimizer, tuple) and len(optimizer) == 2 and isinstance(optimizer[1], dict)):
            raise TypeError(f"optimizer must be (a torch.optim optimizer class, kwargs dict), got {optimizer!r}")
        if not isinstance(sparse, bool):
            raise TypeError(f"sparse must be a bool, as torch's, got {sparse!r}")
        #: torch's keyword, kept as given: the rows' gradients are per row either way
        self.sparse = sparse
        if padding_idx is not None:
            padding_idx = _index(padding_idx, "padding_idx")
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx must be within num_embeddings: in [-{num_embeddings}, "
                                 f"{num_embeddings}), got {padding_idx}")
        admit_after = positive_int(admit_after, "admit_after", message="admit_after must be a positive int "
                                   "(the steps an id is counted in before its row is stored), got {value!r}")
        admit_sketch_bytes = positive_int(admit_sketch_bytes, "admit_sketch_bytes")
        if admit_after > 1:
            if init != "lazy":
                raise ValueError(f"admit_after={admit_after} needs init='lazy' (an eager table stores every row "
                                 f"from the start), got init={init!r}")
            counter_bits(admit_after)  # (ValueError above the widest counters' limit)
        if evict_after_steps is not None:
            evict_after_steps = positive_int(evict_after_steps, "evict_after_steps", message=(
                "evict_after_steps must be None (never evict) or a positive int, got {value!r}"))
        if ps_mode == "geo" and (admit_after > 1 or evict_after_steps is not None):
            raise ValueError(f"admit_after={admit_after} and evict_after_steps={evict_after_steps!r} need a mode in "
                             "which the servers step the rows (sync, async, half_async); geo trainers train rows "
                             "locally and push deltas: leave them at 1 and None")
        #: an id's row is stored once the id was looked up in this many training steps (lazy tables)
        self.admit_after = admit_after
        self.admit_sketch_bytes = admit_sketch_bytes
        #: a row not stepped in this many of the table's steps is dropped (None: never)
        self.evict_after_steps = evict_after_steps
        self.geo_push_every = geo_push_every
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = None if padding_idx is None else padding_idx % num_embeddings
        self.name, self.timeout, self.ps_mode, self.init = name, timeout, ps_mode, init
        self.num_trainers = num_trainers
        self.servers = check_servers(servers)
        blocks = slice_blocks((num_embeddings, embedding_dim), len(self.servers), min_block_size)
        names = [block_name("weight", b.index) for b in blocks]
        chosen = list(split_method(names, self.servers))
        if len(chosen) != len(names) or any(c not in self.servers for c in chosen):
            raise ValueError(
                f"split_method {split_method!r} must return one of the servers {list(self.servers)} per block "
                f"({len(names)} blocks), got {chosen!r:.200}"
            )
        self._ranges = [(b.offset // embedding_dim, b.size // embedding_dim, s) for b, s in zip(blocks, chosen)]
        self._row_opt = row_optimizer(*optimizer)
        #: the servers' row-wise optimizer as a torch.optim.Optimizer (over grad_marker): LR
        #: schedulers drive it; the next push carries its lr (and SparseAdam's betas)
        self.ps_optimizer = PSOptimizer([self.grad_marker], class_defaults(*optimizer), f"table {name!r}")
        self._sent_settings: dict | None = None  # what the servers last took (None: send at the next step)
        spec = _table_server.TableSpec(num_embeddings, embedding_dim, torch.float32, init, seed, ps_mode, num_trainers,
                                 self._row_opt, half_async_merge_every, merge_s, self.padding_idx,
                                 admit_after, admit_sketch_bytes if admit_after > 1 else 0, evict_after_steps)
        # geo: the rows this trainer touched, trained locally: id -> [row, row when pulled, state]
        self._geo = GeoCache(embedding_dim, self._row_opt) if ps_mode == "geo" else None
        if self._geo is not None:  # (warns of rows trained here and never pushed: flush() pushes them)
            weakref.finalize(self, report_unpushed, f"table {self.name!r}", partial(_trained_rows, self._geo))
        by_server: dict[str, list[tuple[int, int]]] = {}
        for first, count, server in self._ranges:
            by_server.setdefault(server, []).append((first, count))
        self._by_server = by_server
        self._trainer = rpc.get_worker_info().name
        # which object of this trainer pushes (sync: the newest one attached; a retried push of
        # a step is recognised by it)
        self._token = uuid.uuid4().hex
        attached = call_all([(s, _table_server._attach_table, (name, spec, rs, self._trainer, self._token))
                             for s, rs in by_server.items()], timeout=timeout)
        steps = [step for step, _ in attached]
        self._step = min(steps) if steps else 0
        # a peer that loses this trainer names the step it was at (rpc_backend/watch.py)
        add_status(_step_line, owner=self)
        # (sync: the steps refused before it attached are not this trainer's to be told of)
        _refusals_seen[name] = max([_refusals_seen.get(name, 0), *(refused for _, refused in attached)])
        self._pending_lock = threading.Lock()
        self._marker_lock = threading.Lock()  # see _recorded
        self._flight_lock = threading.RLock()  # a step's pushes in flight (_flight) are landed once
        self._flight: Flight | None = None
        self._ahead = Ahead()
        self._reset_gradients()
        self._group_lrs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._warned_lr = False
        _live_tables.add(self)
        _watch_optimizer_steps()
        self._pushed_bytes = 0  # (pushed_bytes)
        starts = torch.tensor([first for first, _, _ in self._ranges])
        self.register_buffer("_starts", starts, persistent=False)
        self._server_names = list(by_server)
        # each block's server, as an index into _server_names
        self._block_server = torch.tensor([self._server_names.index(s) for _, _, s in self._ranges], dtype=torch.long)

    @property
    def pushed_bytes(self) -> int:
        """Tensor bytes (ids and gradient rows; a collection's push: the pooled bags' gradient,
        sent to each server, with the lookup's ids and bag starts, counted on its first table;
        geo: row deltas) this module has pushed to the servers so far (a push retried after a
        failure counts again; assignable, to reset it)."""
        return self._pushed_bytes

    @pushed_bytes.setter
    def pushed_bytes(self, value: int) -> None:
        self._pushed_bytes = value

    def extra_repr(self) -> str:
        """As torch's (sizes, ``padding_idx``), then where the rows live: ``print(model)``."""
        return ", ".join(self._repr_parts())

    def _repr_parts(self) -> list[str]:
        parts = [f"{self.num_embeddings}, {self.embedding_dim}"]
        if self.padding_idx is not None:
            parts.append(f"padding_idx={self.padding_idx}")
        if getattr(self, "sparse", False):  # (a table pickled before the keyword)
            parts.append("sparse=True")
        parts.append(f"name={self.name!r}, servers={list(self.servers)!r}, ps_mode={self.ps_mode!r}")
        if getattr(self, "admit_after", 1) > 1:
            parts.append(f"admit_after={self.admit_after}")
        if getattr(self, "evict_after_steps", None) is not None:
            parts.append(f"evict_after_steps={self.evict_after_steps}")
        return parts

    def table_stats(self) -> dict:
        """The table's rows on its servers: ``{"rows_held", "rows_admitted", "rows_evicted",
        "bytes", "merges", "longest_eviction_pause_s", "per_server": {server: the same of that
        server's share, with its "steps"}}``. Rows held: stored now (lazy: the rows created and
        not evicted, evicted ones until a sweep frees them; eager: all); admitted: rows created
        so far (a lazy table's first step of an id admitted, and each re-creation of an evicted
        row); evicted: rows dropped so far; bytes: the rows, their optimizer state, the
        bookkeeping and the admission sketch (storage grows by doubling: up to twice that may be
        allocated); merges: half_async merges applied so far (each server merges its share on
        its own: by count, by its ``half_async_merge_s`` timer, or at a ``flush()``)."""
        self._wait_pushes()
        got = call_all([(s, _table_server._table_stats, (self.name,)) for s in self._by_server], timeout=self.timeout)
        per_server = dict(zip(self._by_server, got))
        out: dict = {k: sum(g[k] for g in got)
                     for k in ("rows_held", "rows_admitted", "rows_evicted", "bytes", "merges")}
        out["longest_eviction_pause_s"] = max((g["longest_eviction_pause_s"] for g in got), default=0.0)
        out["per_server"] = per_server
        return out

    def _wait_s(self) -> float:
        """How long a sync lookup may wait on a server for the step: a little less than this
        call's timeout, so the server's answer (naming who has not pushed) arrives first."""
        return nested_seconds(timeout_seconds(self.timeout))

    def _owner_index(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self._starts, ids, right=True) - 1

    def _server_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Each of ``ids``' server, as an index into ``_server_names``."""
        if len(self._server_names) == 1:
            return torch.zeros_like(ids)
        return self._block_server[self._owner_index(ids)]

    def _by_owner(self, ids: torch.Tensor, keep: torch.Tensor | None = None,
                  server_of: torch.Tensor | None = None) -> list[tuple[int, str, torch.Tensor | slice]]:
        """For every server of this table, in order: its index, its name and which of ``ids``
        it owns (a mask, within ``keep`` when given; ``ALL`` when one server owns them all, so
        indexing with it copies nothing). ``server_of``: :meth:`_server_of` if computed already."""
        if len(self._server_names) == 1:
            return [(0, self._server_names[0], _table_server.ALL if keep is None else keep)]
        server_of = self._server_of(ids) if server_of is None else server_of
        return [(k, server, server_of == k if keep is None else (server_of == k) & keep)
                for k, server in enumerate(self._server_names)]

    def _dtype(self) -> torch.dtype:
        """The dtype of this module's outputs: its ``grad_marker``'s, as ``nn.Embedding``'s
        output is its weight's (``model.double()`` / ``.half()`` / ``.to(dtype)`` set it; the
        servers keep float32 rows)."""
        dtype = self.grad_marker.dtype
        return dtype if dtype.is_floating_point else torch.float32

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._looked_up((input,), self._forward_plan)

    def _forward_plan(self, input: torch.Tensor) -> tuple[list, Callable[[list], torch.Tensor]]:
        calls, finish = self._rows_plan(input)

        def output(got: list) -> torch.Tensor:
            _, inverse, rows = finish(got)
            return rows[inverse].reshape(*input.shape, self.embedding_dim)

        return calls, output

    def prefetch(self, input: torch.Tensor) -> Prefetch:
        """Plan the lookup of ``input`` now (checked as :meth:`forward` checks it) for the next
        forward: sent with the next :meth:`step`'s pushes, one message per server, whose
        servers answer it once they applied them (what a lookup right after the step would
        see: results are those without prefetch, in every mode), or sent by that forward when
        no step comes first. The next forward with an equal ``input`` (by value) consumes it;
        any other forward drops it; a new prefetch replaces it. Returns the handle."""
        return self._prefetch((input,), self._forward_plan)

    def _prefetch(self, key: tuple, plan: Callable, queued: bool = False, overlap: bool = False) -> Prefetch:
        """A prefetch of ``key``; ``queued`` (``prefetching``: a batch after the next, planned
        while a step's answer is awaited): after the others, for a later forward (the lookup
        planned here waits for no push: it is sent after them)."""
        records = self._plan_state()
        calls, finish = plan(*key)  # (the checks of the forward's arguments, now)
        # geo: the lookup depends on the rows this trainer caches, which its step changes
        handle = Prefetch(key, records, calls, finish, replan=self.ps_mode == "geo", tables=[self], overlap=overlap)
        with self._flight_lock:
            self._lookahead().add(handle, queued)
        return handle

    def _lookahead(self) -> Ahead:
        return self.__dict__.setdefault("_ahead", Ahead())  # (a table pickled before prefetch)

    def _prefetch_input(self, value: Any, queued: bool = False, overlap: bool = False) -> Prefetch:
        """(``prefetching``) a prefetch of a batch's input: the ids."""
        return self._prefetch((value,), self._forward_plan, queued, overlap)

    def _looked_up(self, key: tuple, plan: Callable) -> Any:
        """A forward's output: of the prefetch of ``key`` when there is one (any other is
        dropped), else of a lookup planned and sent now; after a step's pushes landed."""
        records = self._plan_state()
        with self._flight_lock:
            handle = self._lookahead().claim(key, records, self._wait_pushes)
        try:
            return Ahead.output(handle, lambda calls: lookup_calls(at_step(calls, self._step_of), self.timeout),
                                lambda: plan(*key))
        except StepRefusal as exc:  # (a sync step of the table refused: raised here once)
            told_refusals(exc, [self.name])
            raise

    def _plan_state(self) -> tuple:
        """What a lookup's plan depends on besides its arguments: whether it records gradients,
        and the output dtype."""
        return torch.is_grad_enabled() and self.grad_marker.requires_grad, self._dtype()

    def _reader(self) -> Callable:
        """The handler of this table's row and bag lookups: one that waits for the step in sync
        mode, else one answered at once (no Future on the server)."""
        return _table_server._rows_for if self.ps_mode == "sync" else _table_server._rows_now

    def _step_of(self, name: str) -> int:
        return self._step

    def _applied_or_told(self) -> None:
        """(sync) Wait until this trainer's last step is applied on every server (a lookup of no
        ids at that step); a step of the table the servers refused that this trainer was not
        told of raises here, once, as its next lookup would (:func:`told_refusals`): a job whose
        last step was refused hears of it at its checkpoint (``flush()`` waits for no other
        trainer: a sync step it pushed is told of at the next lookup or checkpoint)."""
        nothing = torch.empty(0, dtype=torch.long)
        calls = [(s, _table_server._rows_for, (self.name, nothing, self._step, None, self._wait_s()))
                 for s in self._by_server]
        try:
            call_all(at_step(calls, self._step_of), timeout=self.timeout)
        except StepRefusal as exc:
            told_refusals(exc, [self.name])
            raise

    def _wait_pushes(self) -> None:
        """Wait for this table's pushes in flight (its last step's, or a collection's step's),
        raising a failed push's error (once; the gradients are kept for a retry)."""
        if self.__dict__.get("_flight") is None:
            return
        with self._flight_lock:
            flight = self.__dict__.pop("_flight", None)
            if flight is not None:
                flight.land()

    def _unique(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``input`` flattened (checked: integer ids in range), its unique ids, and each
        position's index among them."""
        flat = self._checked_ids(input)
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        return flat, uniq, inverse

    def _check_id_tensor(self, input: Any) -> None:
        """``TypeError`` unless ``input`` is a tensor of integer ids (int32 or int64)."""
        if not isinstance(input, torch.Tensor) or input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{type(self).__name__} takes a tensor of integer ids, got "
                            f"{getattr(input, 'dtype', type(input).__name__)}")

    def _checked_ids(self, input: torch.Tensor) -> torch.Tensor:
        """``input`` flattened as int64 ids, checked: an integer tensor, ids in range."""
        self._check_id_tensor(input)
        flat = input.reshape(-1).long()
        check_ids(flat, self.num_embeddings)
        return flat

    def _rows_of(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Unique ids of ``input``, each id's index among them, and their rows (fetched from
        the owning servers concurrently; recorded for :meth:`step` when grad is on)."""
        calls, finish = self._rows_plan(input)
        return finish(lookup_calls(calls, self.timeout))

    def _rows_plan(self, input: torch.Tensor, wait_s: float | None = None) -> tuple[list, Callable[[list], tuple]]:
        """:meth:`_rows_of` in two halves: the host calls that fetch the rows, and what makes
        its result of their answers (so that a collection can send several tables' calls to a
        server in one message). ``wait_s``: how long a sync lookup may wait on a server for
        the step (default :meth:`_wait_s`; a collection's budget is its own)."""
        wait_s = self._wait_s() if wait_s is None else wait_s
        _, uniq, inverse = self._unique(input)
        # geo: cached rows are this trainer's; only the others are fetched
        wanted = None if self._geo is None else self._geo.missing(uniq)
        calls, taken = [], []
        for _, server, mine in self._by_owner(uniq, wanted):
            ids = uniq[mine]
            if ids.numel():
                calls.append((server, self._reader(), (self.name, ids, self._step, None, wait_s)))
                taken.append(mine)

        def finish(got: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            rows = torch.empty(uniq.numel(), self.embedding_dim)
            for mine, r in zip(taken, got):
                rows[mine] = r
                if self._geo is not None:
                    self._geo.add(uniq[mine], r)
            if self._geo is not None:
                rows = self._geo.values(uniq)
            if self._records():
                rows = self._recorded(uniq, rows)
            return uniq, inverse, rows.to(self._dtype())

        return calls, finish

    def _reset_gradients(self) -> None:
        """No gradients recorded (construction, and a copy)."""
        # (unique ids, gradient rows) of each lookup backward reached: ``_fresh`` in the backward
        # under way, ``_held`` in finished ones (dropped when the marker's grad was cleared since)
        self._fresh: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._hooked: Any = None  # a weak reference to the marker whose accumulation seals _fresh
        self._backwards = 0  # backward passes recorded since the last step()
        self._stepped_past = False  # a local optimizer stepped while _held waited
        self._forward_thread: int | None = None
        self._warned_unpushed = False

    #: bookkeeping set at every lookup, backward and step (never a tensor, parameter or module):
    #: stored without ``nn.Module.__setattr__``'s checks, which cost a collection of 8 tables
    #: about 100 calls per training step
    _PLAIN_ATTRIBUTES = frozenset({"_forward_thread", "_fresh", "_held", "_backwards", "_stepped_past", "_pushes",
                                   "_pushed_bytes", "_step", "_flight", "_changes"})

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ShardedEmbedding._PLAIN_ATTRIBUTES:
            self.__dict__[name] = value
        elif name == "weight":  # (a local parameter named so would be left out of every lookup, silently)
            raise AttributeError(self._no_weight(f"{type(self).__name__} takes no local 'weight'"))
        else:
            super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "weight":
                raise
        raise AttributeError(self._no_weight(f"'{type(self).__name__}' object has no attribute 'weight'"))

    def _no_weight(self, what: str) -> str:
        """The error for ``table.weight`` (``table.weight.data = W``, weight tying): where the rows
        are, and the calls that set and read them."""
        if self.__dict__.get("init") == "lazy":
            load = 'load_state_dict({"weight.ids": torch.arange(len(W)), "weight.rows": W})'
        else:
            load = 'load_state_dict({"weight": W})'
        return (f"{what}: table {self.__dict__.get('name', '?')!r} keeps its rows on the parameter servers, "
                f"not in a local tensor. To start it from given values W (as `table.weight.data = W` or "
                f"from_pretrained(W) starts a local {type(self).__name__.replace('Sharded', 'nn.')}), call "
                f"table.{load} once (one trainer: every trainer of the job shares the rows); to read them, "
                "table.state_dict() (lookups of ids read rows too)")

    def __getstate__(self) -> dict:
        """As nn.Module's, less the lock and the gradients not pushed yet (a copy, e.g.
        ``copy.deepcopy(model)`` for an averaged model, shares the servers' rows, not them)."""
        self._wait_pushes()
        state = self.__dict__.copy()
        for key in ("_pending_lock", "_marker_lock", "_fresh", "_held", "_hooked", "_group_lrs", "_flight_lock",
                    "_flight", "_ahead", "_after_step", "_together"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # a copy is another object of the table: in sync mode its pushes are refused (one trainer,
        # one object), never taken as retries of the original's (which would drop them silently)
        self._token = uuid.uuid4().hex
        self._pending_lock = threading.Lock()
        self._marker_lock = threading.Lock()
        self._flight_lock = threading.RLock()
        self._flight, self._ahead = None, Ahead()
        self._reset_gradients()
        self._group_lrs = weakref.WeakKeyDictionary()
        _live_tables.add(self)
        _watch_optimizer_steps()

    def _records(self) -> bool:
        """Whether this forward records gradients (grad enabled, the table not frozen); warns
        once if recorded gradients were never pushed (see the class docstring)."""
        if not (torch.is_grad_enabled() and self.grad_marker.requires_grad):
            return False
        self._forward_thread = threading.get_ident()
        with self._pending_lock:
            self._drop_discarded()
        if not self._warned_unpushed and (self._stepped_past or self._backwards >= UNPUSHED_BACKWARDS):
            self._warned_unpushed = True
            why = ("a local optimizer has stepped since they were recorded" if self._stepped_past
                   else f"{self._backwards} backward passes without a step()")
            warnings.warn(
                f"{type(self).__name__} {self.name!r}: gradients that backward recorded for its rows were never "
                f"pushed to the servers ({why}), so the table does not train: an optimizer of model.parameters() "
                "steps only its zero-size grad_marker. Call table.step() after loss.backward() (PSModel.step() "
                "does it for the tables inside a PSModel); to accumulate over backward passes, call it once after "
                "them; to freeze the table, table.requires_grad_(False)", UserWarning, stacklevel=user_stacklevel())
        return True

    def _recorded(self, uniq: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (standing for the rows of ``uniq``) recorded for :meth:`step`: their gradient
        is kept once backward reaches them. Nothing is held before that, as with a local
        module: a lookup that is never backpropagated (an eval loop without ``no_grad``) is
        gone with its output."""
        # one thread at a time: torch takes a leaf's autograd lock, then the GIL, to find its
        # AccumulateGrad in an op (view_as, which runs without the GIL), but the GIL, then
        # that lock, in a Function's apply; two threads of one table doing both at once
        # deadlocked (waiting on this lock releases the GIL)
        with self._marker_lock:
            marker, accumulator = self._recorder()
            return _Recorded.apply(rows, marker, self._record, uniq, accumulator)

    def _recorder(self) -> tuple[torch.Tensor, Any]:
        """(``_marker_lock`` held) the grad marker, hooked to seal what backward records, and its
        ``AccumulateGrad`` node."""
        marker = self.grad_marker
        if self._hooked is None or self._hooked() is not marker:  # (a copy, or the marker replaced)
            marker.register_post_accumulate_grad_hook(self._seal)
            self._hooked = weakref.ref(marker)
        return marker, marker.view_as(marker).grad_fn.next_functions[0][0]  # the marker's AccumulateGrad

    def _record(self, uniq: torch.Tensor, grad: torch.Tensor) -> None:
        """In backward, before the marker accumulates: keep ``grad``; gradients of finished
        backward passes are dropped if ``zero_grad()`` cleared the marker since."""
        self._keep((uniq, grad))

    def _keep(self, entry: Any) -> None:
        """:meth:`_record` of a gradient ``entry``: ``(ids, rows)``, or an object whose
        ``rows()`` gives them (a collection's: ``_packed.TogetherGradient``)."""
        with self._pending_lock:
            self._drop_discarded()
            self._fresh.append(entry)

    def _seal(self, marker: torch.Tensor) -> None:
        """After the marker accumulated (once per backward through the table): this backward's
        gradients count until the marker's ``.grad`` is cleared."""
        with self._pending_lock:
            if not self._fresh:
                return
            self._held.extend(self._fresh)
            self._fresh = []
            self._backwards += 1
            # a gradient since a failed step: its retry is a step for every server again (those
            # that applied the failed one get the new rows, or an empty push: a step counted)
            self.__dict__.pop("_took", None)

    def _local_optimizer_stepped(self, thread: int, optimizer: torch.optim.Optimizer) -> None:
        """A local torch.optim optimizer stepped in ``thread``: note it if this table holds
        gradients recorded by a forward of that thread (see :meth:`_records`), and warn once if
        the lr of its group holding this table's ``grad_marker`` changed since its first step
        (see :meth:`_check_group_lr`)."""
        if thread == self._forward_thread and self._held and self.grad_marker.grad is not None:
            self._stepped_past = True
        if not getattr(self, "_warned_lr", True):
            self._check_group_lr(optimizer)

    def _check_group_lr(self, optimizer: torch.optim.Optimizer) -> None:
        """The rows step with the lr the table was built with, on the servers: an LR scheduler
        (or a hand-set ``group["lr"]``) changing the lr of the group that holds ``grad_marker``
        (an optimizer over ``model.parameters()``, as facebookresearch/dlrm schedules it) does
        not reach them, so warn once. A group's lr at the optimizer's first step seen is the
        baseline; a group added later starts a new one."""
        changed = changed_group_lr(self._group_lrs, optimizer, [self.grad_marker])
        if changed is None:
            return
        first, now = changed
        self._warned_lr = True
        warnings.warn(
            f"{type(self).__name__} {self.name!r}: the lr of the {type(optimizer).__name__} param group holding its "
            f"grad_marker changed from {first:g} to {now:g} (an LR scheduler?), but the table's rows "
            "step on the servers with its ps_optimizer's lr, which local optimizers do not change: schedule "
            "table.ps_optimizer (a PSModel: its tables' ps_optimizer) for the rows; to silence this, build the "
            "scheduled optimizer over the local parameters only (a PSModel's own step on the servers too: schedule "
            "its ps_optimizer)", UserWarning, stacklevel=user_stacklevel())

    def _drop_discarded(self) -> None:
        """(Lock held.) If ``zero_grad()`` (of the table, a container or an optimizer) cleared the
        marker's ``.grad`` since the held backward passes, forget them: their gradients are not
        pushed and they do not count towards the unpushed warning (a local optimizer step while
        they were held still does: their gradients were never pushed)."""
        if self.grad_marker.grad is None:
            self._held, self._backwards = [], 0

    def _take_gradients(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The gradients recorded and not discarded since the last step, now forgotten (lock held)."""
        self._drop_discarded()
        taken = self._held + self._fresh
        self._held, self._fresh = [], []
        return taken

    def flush(self) -> None:
        """Wait for this table's pushes in flight; half_async: have the servers apply the queued
        pushes now; geo: push the deltas of the rows trained since the last push now (the end
        of training: the local steps after the last ``geo_push_every`` boundary), as a push
        every ``geo_push_every`` steps does."""
        self._wait_pushes()
        if self._geo is not None and self._geo.trained():
            self._geo_push()
        if self.ps_mode == "half_async":
            call_all([(s, _table_server._flush_table, (self.name,)) for s in self._by_server], timeout=self.timeout)
            self._changes = self.__dict__.get("_changes", 0) + 1  # a prefetch sent before reads stale rows

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients accumulated since the last :meth:`step` (nothing is pushed); as
        torch's ``zero_grad``, a backward after it (of a forward before it) counts. Waits for
        the pushes in flight first (a failed one raises here, as at any call on the table)."""
        self._wait_pushes()
        super().zero_grad(set_to_none)
        self.__dict__.pop("_together", None)
        self.__dict__.pop("_took", None)  # (a failed step dropped: the next one is whole)
        with self._pending_lock:
            self._held, self._fresh = [], []
            self._backwards, self._stepped_past = 0, False

    def _geo_step(self, ids: torch.Tensor, grad: torch.Tensor, has_grad: bool) -> PushPlan | None:
        """geo: step the cached rows locally (an optimizer step only with a gradient:
        ``has_grad``); every ``geo_push_every`` calls push ``row - row when fetched`` for the
        rows cached since the last push, and drop them: a later lookup fetches the merged rows,
        so a push carries only the rows touched in its interval. Each row's local optimizer
        state stays (as a local sparse optimizer keeps it). Returns the push's plan
        (:meth:`_geo_push_plan`) when this call pushes, else None."""
        geo = self._geo
        geo.calls += 1
        if has_grad:
            uniq, summed = coalesce(ids, grad)
            evicted = geo.missing(uniq)
            if bool(evicted.any()):  # looked up before a push dropped them (a step() between forward and backward)
                with torch.no_grad():
                    self._rows_of(uniq[evicted])
            geo.step(uniq, summed)
        if geo.calls % self.geo_push_every == 0:
            return self._geo_push_plan()
        return None

    def _geo_push(self) -> None:
        """geo: push the deltas of every cached row now and drop them (their next lookup
        fetches the merged rows)."""
        plan = self._geo_push_plan()
        if plan is not None:
            run_push_plans([plan], self.timeout)

    def _geo_push_plan(self) -> PushPlan | None:
        """geo: the push of every cached row's delta (None with none cached), which drops those
        rows once the servers took it; a failed push keeps them (the next push carries their
        deltas again), server by server: the rows of a server that took its push are dropped
        (their deltas were added there: pushing them again would add them twice)."""
        geo = self._geo
        ids, deltas = geo.deltas()
        if not ids.numel():
            return None
        calls = []
        for _, server, mine in self._by_owner(ids):
            part = ids[mine]
            if part.numel():
                calls.append((server, _table_server._push_row_deltas, (self.name, part, deltas[mine])))
        self._pushed_bytes += sum(i.numel() * i.element_size() + d.numel() * d.element_size()
                                 for _, _, (_, i, d) in calls)

        def partly(oks: list[bool]) -> None:
            taken = [args[1] for (_, _, args), ok in zip(calls, oks) if ok]
            if taken:
                geo.drop(torch.cat(taken))

        return calls, lambda: geo.drop(ids), nothing, None, partly

    def _settings_plans(self, settings: dict | None = None) -> list:
        """:attr:`ps_optimizer`'s settings for this step (``settings``: :meth:`_row_settings`,
        when the caller checked them already): geo, set in the local optimizer; else the plan
        that tells every server, when they changed (:func:`settings_plans`)."""
        settings = self._row_settings() if settings is None else settings
        if self._geo is not None:
            self._geo.optimizer = self._geo.optimizer._replace(**settings)
            return []
        return settings_plans(self, settings, self._server_names, _table_server._set_settings)

    def _row_settings(self) -> dict:
        """The settings of :attr:`ps_optimizer` a row-wise optimizer takes (``lr``, and
        SparseAdam's ``betas``); ``ValueError`` for a momentum or weight decay a scheduler set,
        which the rows' optimizer cannot apply (as construction refuses them)."""
        settings = self.ps_optimizer.settings()
        for key in ("momentum", "weight_decay"):
            if settings.get(key, 0.0) != 0.0:
                raise ValueError(f"table {self.name!r}: its ps_optimizer has {key}={settings[key]!r}, which a "
                                 f"sparse table's row-wise optimizer cannot apply; keep it 0 (OneCycleLR: "
                                 "cycle_momentum=False, or SparseAdam, whose betas cycle)")
        return {key: settings[key] for key in ("lr", "betas") if key in settings}

    def step(self) -> None:
        """Push the touched rows' gradients (only those rows) and forget them (geo: step the
        cached rows locally, push their deltas every ``geo_push_every`` steps).

        Without a gradient recorded since the last step (or since ``zero_grad()``) this is no
        optimizer step, as torch's optimizers skip a parameter whose ``.grad`` is ``None``
        (sync: the trainer still tells the servers, which wait for every trainer's step).

        A step that fails (a server did not answer in time) keeps the gradients, as a failed
        ``optimizer.step()`` keeps ``.grad``: call ``step()`` again to retry it (in sync mode a
        server that already has this step's push takes the retry as a no-op; in async and
        half_async the retry leaves out a server that answered that it applied its rows, unless
        a backward since recorded gradients: then it is a step there too, of the new rows or
        an empty one), or ``zero_grad()`` to drop them.

        In async, half_async and geo modes (and in sync mode after a :meth:`prefetch`) the
        pushes are sent and ``step()`` returns with them in flight (geo: the deltas' pushes,
        whose rows are dropped from the cache once they land); the next call on the table waits for
        them first (a lookup is sent once they were applied), and a push that failed raises
        there, naming its server, keeping the gradients for a retry as above."""
        with self._flight_lock:
            self._wait_pushes()  # the last step's (a failure raises here: call step() again to retry)
            settings = self._settings_plans()
            plan = self._push_plan()
            self.ps_optimizer.step()  # (as a local loop's optimizer.step(): what LR schedulers count)
            if plan is None:
                return
            sync = self.ps_mode == "sync"
            settle, joined = self._lookahead().send([*settings, plan], self.timeout, sync,
                                                    lambda name: self._step + 1)
            if joined or not sync:
                self._flight = Flight(settle, joined)
            after = self.__dict__.pop("_after_step", [])
        for planned in after:  # (prefetching: later batches, planned while the servers work)
            planned()
        if not joined and sync:
            settle()  # (sync waits for its push to be taken; a prefetch's lookup waits for the step)

    def _push_plan(self, taken: list | None = None) -> tuple[list, Callable[[], None], Callable[[], None]] | None:
        """:meth:`step` in parts: the host calls that push this step's gradients, what to do
        once they all succeeded, and what to do when they failed (keep the gradients for a
        retry); in geo mode it steps the cached rows here, and is the plan of their deltas'
        push every ``geo_push_every`` calls (:meth:`_geo_push_plan`), None otherwise. ``taken``:
        the gradients, taken already (:meth:`_take_for_step`)."""
        self._wait_pushes()
        if taken is None:
            taken = self._take_for_step()
        ids_parts, grad_parts = [], []
        for uniq, g in map(row_gradients, taken):
            if self.padding_idx is None:
                ids_parts.append(uniq)
                grad_parts.append(g)
            else:
                keep = uniq != self.padding_idx
                ids_parts.append(uniq[keep])
                grad_parts.append(g[keep])
        has_grad = bool(taken)
        ids = torch.cat(ids_parts) if ids_parts else torch.empty(0, dtype=torch.long)
        grad = torch.cat(grad_parts) if grad_parts else torch.empty(0, self.embedding_dim)
        if self.ps_mode == "geo":  # (a plan only when this step pushes the deltas)
            return self._geo_step(ids, grad, has_grad)
        calls = []
        took = self.__dict__.get("_took", ())  # (the retry of a step these servers applied already)
        for _, server, mine in self._by_owner(ids):
            # every server hears of a step with a gradient (an empty push where it holds none of
            # its rows): it is one optimizer step of the whole table, as torch counts steps per
            # parameter (Adagrad's lr_decay, SparseAdam's bias correction); sync: every step,
            # without a gradient as None (the servers' step waits for every trainer)
            if server in took and not (has_grad and ids[mine].numel()):
                continue  # it applied this step: nothing to push there again (no step twice)
            if has_grad:
                calls.append((server, _table_server._push_rows,
                              (self.name, self._trainer, self._step, ids[mine], grad[mine], self._token)))
            elif self.ps_mode == "sync":
                calls.append((server, _table_server._push_rows, (self.name, self._trainer, self._step, None, None,
                                                           self._token)))
        pushing = bool(calls) and (self.ps_mode == "sync" or any(i is not None for _, _, (_, _, _, i, _, _) in calls))
        # counted as sent (a push retried after a failure is counted again)
        sent = sum(i.numel() * i.element_size() + g.numel() * g.element_size()
                   for _, _, (_, _, _, i, g, _) in calls if i is not None)
        done, failed = self._pushed(taken, pushing, sent)
        took: list[str] = []

        def partly(oks: list[bool]) -> None:  # (before failed(): the servers that applied theirs)
            took[:] = [server for (server, _, _), ok in zip(calls, oks) if ok]

        return calls, done, lambda: failed(took), None, partly

    def _take_for_step(self) -> list:
        """The gradients recorded since the last step, taken for a push (the warnings' counts
        restart)."""
        with self._pending_lock:
            taken = self._take_gradients()
            self._backwards, self._stepped_past = 0, False
        return taken

    def _pushed(self, taken: list, pushing: bool, sent: int) -> tuple[Callable[[], None], Callable[..., None]]:
        """A push of ``taken`` planned (``pushing``: it is a step of the table; ``sent``: its
        bytes): what to do once it succeeded (count the step) and when it failed, ``failed(took)``
        (keep the gradients for a retry; ``took``: the servers that answered that they applied
        their part, whose rows are not kept and which the retry leaves out: their step is done,
        so it is not applied there twice)."""
        def failed(took: Any = ()) -> None:
            kept = taken
            if took:
                owner = [self._server_names.index(s) for s in took]
                kept = []
                for uniq, rows in map(row_gradients, taken):
                    stay = ~torch.isin(self._server_of(uniq), torch.tensor(owner))
                    kept.append((uniq[stay], rows[stay]))
            with self._pending_lock:  # kept for a retry (or zero_grad), with any recorded meanwhile
                if took and not self._held:  # (a backward since makes the retry a step everywhere)
                    self.__dict__["_took"] = set(self.__dict__.get("_took", ())) | set(took)
                self._held = kept + self._held
                # back "on the parameter", as PSModel puts them: a zero_grad() that ran while the
                # push was in flight (a local optimizer's, which does not wait for it) came before
                # the failure was known, and must not drop them; a later one does
                if taken and self.grad_marker.grad is None:
                    self.grad_marker.grad = torch.zeros_like(self.grad_marker)

        if pushing:
            self._pushes = self.__dict__.get("_pushes", 0) + 1  # (a prefetch sent before misses it: Ahead.fresh)
        self._pushed_bytes += sent

        def done() -> None:
            self._step += 1
            self.__dict__.pop("_took", None)

        return done, failed
