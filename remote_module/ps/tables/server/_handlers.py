"""The RPC handlers of a sharded table's servers: a trainer attaches (creating the table on
its first attach, idempotently, as a dense job, see ``dense._server``), looks rows and bags up,
pushes gradients (several tables' in one call), sends its optimizer settings, and reads what
half_async merged. A table's state is ``_table.Table``; the handlers of checkpoints are
``_checkpoint_handlers``.

Rows are sliced into blocks by the same rule as dense parameters (whole rows, see
``ps._placement``) and placed by the same dispatchers; a block's storage, eager or lazy, is
``_rows.RowBlock``.

The modes are ``ps._modes``', shared with dense parameters: ``sync`` (a step's pushes summed in
trainer-name order, divided by the number of trainers, applied once; lookups for the next step
wait for it; a trainer's push for the step after its last one may arrive first and waits),
``async`` (applied on arrival), ``half_async`` (queued, the sum applied every ``merge_every``
pushes or ``merge_s`` seconds), ``geo`` (trainers push row deltas, added divided by the number
of trainers). Bags can be pooled here (``_pooling``), so only pooled rows travel.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from remote_module._core import HostStore, capture, followed
from remote_module.ps._modes import (
    StepNotApplied,
    StepRefusal,
    StepRefused,
    merge_now,
    read_when_applied,
    take_settings,
)
from remote_module.ps._rowwise import bag_ends, bag_index, coalesce
from remote_module.ps.tables.server._rows import TableSpec
from remote_module.ps.tables.server._table import Table

#: This server's tables by name (created by the first trainer to attach).
_tables = HostStore()


def _table(name: str) -> Table:
    table = _tables.get(name)
    if table is None:
        raise LookupError(f"no sharded table {name!r} on this worker: create it first")
    return table


#: TableSpec fields by the ShardedEmbedding arguments that set them (for errors)
_SPEC_ARGUMENTS = {"dim": "embedding_dim", "mode": "ps_mode", "merge_every": "half_async_merge_every",
                   "merge_s": "half_async_merge_s"}


def _attach_table(name: str, spec: TableSpec, blocks: list[tuple[int, int]], trainer: str,
                  token: str | None = None) -> tuple[int, int]:
    """Create table ``name`` with ``blocks`` (row ranges) here, or attach ``trainer`` (its
    object ``token``, from now on the one that pushes for it) to it (the same spec and blocks,
    else ``ValueError``); the table's step count and how many of its sync steps were refused
    (a trainer attaching now is told of none of them)."""
    table, _ = _tables.setdefault(name, lambda: Table(name, spec, blocks))
    if table.spec != spec:
        differ = "; ".join(f"{_SPEC_ARGUMENTS.get(f, f)}={getattr(table.spec, f)!r}, this trainer asks for "
                           f"{getattr(spec, f)!r}" for f in spec._fields if getattr(table.spec, f) != getattr(spec, f))
        raise ValueError(f"sharded table {name!r} on server {rpc.get_worker_info().name!r} exists with {differ}: "
                         "every trainer of a table must build it with the same arguments")
    held = table.layout()
    if held != list(blocks):
        raise ValueError(
            f"sharded table {name!r}: server {rpc.get_worker_info().name!r} holds its rows (first, count) {held}, this "
            f"trainer expects {list(blocks)} there: every trainer must pass the same servers, in the same order, "
            "with the same min_block_size and split_method")
    with table.lock:
        if trainer not in table.trainers and len(table.trainers) >= spec.num_trainers:
            raise ValueError(
                f"sharded table {name!r} already has num_trainers={spec.num_trainers} trainers "
                f"({sorted(table.trainers)}); trainer {trainer!r} would be one more"
            )
        table.trainers.add(trainer)
        table.tokens[trainer] = token
        return table.sync.resumes_at(trainer), table.sync.refusals


@rpc.functions.async_execution
def _rows_for(name: str, ids: torch.Tensor, step: int = 0, pool: tuple | None = None,
              seconds: float = math.inf, seen: int | None = None) -> Future:
    """The rows of ``ids`` (or, with ``pool``, those rows pooled into bags: see
    :func:`pool_rows`); in sync mode once step ``step - 1`` is applied (a lookup still waiting
    after ``seconds`` fails naming the trainers that have not pushed). ``seen``: how many of
    the table's refused steps the trainer was told of; a lookup of a trainer not told of the
    last one fails with it (:meth:`SyncSteps.check_told`)."""
    table = _table(name)
    return read_when_applied(table, step, seconds, table.answer, ids, pool, seen=seen)


def _unwaiting(name: str, waiting: str) -> Table:
    """Table ``name``, for a read answered without a Future: ``ValueError`` for a sync table,
    whose lookups wait for the step (through handler ``waiting``)."""
    table = _table(name)
    if table.spec.mode == "sync":
        raise ValueError(f"table {name!r} is in sync mode: its lookups wait for the step ({waiting})")
    return table


def _rows_now(name: str, ids: torch.Tensor, step: int = 0, pool: tuple | None = None,
              seconds: float = math.inf, seen: int | None = None) -> object:
    """:func:`_rows_for` of a table that never waits (not sync), answered without a Future:
    the same read, under the table's lock."""
    table = _unwaiting(name, "_rows_for")
    with table.lock:
        return table.answer(ids, pool)


@rpc.functions.async_execution
def _bags_when_applied(name: str, input: torch.Tensor, offsets: torch.Tensor | None, weights: torch.Tensor | None,
                       mode: str, step: int = 0, seconds: float = math.inf, seen: int | None = None) -> Future:
    """:meth:`Table.bags` of a table this server holds whole; in sync mode once step ``step -
    1`` is applied (as :func:`_rows_for`)."""
    table = _table(name)
    return read_when_applied(table, step, seconds, table.bags, input, offsets, weights, mode, seen=seen)


def _bags_now(name: str, input: torch.Tensor, offsets: torch.Tensor | None, weights: torch.Tensor | None,
              mode: str, step: int = 0, seconds: float = math.inf, seen: int | None = None) -> torch.Tensor:
    """:func:`_bags_when_applied` for a table that never waits (not sync), answered without a
    Future: the same read, under the table's lock."""
    table = _unwaiting(name, "_bags_when_applied")
    with table.lock:
        return table.bags(input, offsets, weights, mode)


@rpc.functions.async_execution
def _pool_tables(names: list[str], steps: list[int], ids: torch.Tensor, first: torch.Tensor, bag_base: list[int],
                 bag_counts: list[int], seconds: float = math.inf, seen: list[int] | None = None) -> Future:
    """A collection's sum-pooled lookups of several tables in one call (``tables._packed``): ``ids``
    holds this server's ids of every table, table after table, and ``first`` every bag of the
    whole batch's first id at or after it in ``ids``; table ``names[j]``'s bags are the batch's
    ``bag_base[j]`` to ``bag_base[j] + bag_counts[j]``. The answer is their pooled bags, packed
    in the same order (zeros for a bag with no row here); sync: each table's once its step
    ``steps[j] - 1`` is applied (as :func:`_rows_for`; ``seen``: each table's count of refused
    steps the trainer was told of: the tables' refusals it was not told of fail it, in one
    error naming them all)."""
    if seen is not None:
        refused = []
        for name, told in zip(names, seen):
            table = _table(name)
            if told is not None and told < table.sync.refusals:  # (else nothing to tell: no lock taken)
                with table.lock:
                    try:
                        table.sync.check_told(told)
                    except StepRefusal as exc:
                        refused.append(exc)
        if refused:
            raise _refusals(refused)
    layout = _packed_layout(bag_base, bag_counts, first.numel())
    if layout is None:  # (bags as sent, read as such: what they do not fit fails as it would)
        # each table's ids: ids[lo:hi], from its first bag's first id to the next table's
        ends = bag_ends(first, ids.numel())[[b for base, count in zip(bag_base, bag_counts)
                                             for b in (base, base + count)]]
        spans, relative = ends.tolist(), None
    else:
        spans, relative = layout.spans(first, ids.numel()), layout.relative(first)
    ids = ids.long()  # (once for every table's read, which takes int64 ids)
    answers: list = []  # per table: its pooled bags, or (sync) a Future of them
    for j, (name, step, base, count) in enumerate(zip(names, steps, bag_base, bag_counts)):
        table = _table(name)
        lo, hi = (spans[2 * j], spans[2 * j + 1]) if count else (0, 0)
        if lo == hi:  # none of its ids here: zeros, without waiting (its own lookup sends nothing here)
            answers.append(torch.zeros(count, table.spec.dim))
            continue
        # each bag's first position among the table's ids
        pool = (first[base:base + count] - lo if relative is None else relative[base:base + count], None, "sum")
        if table.spec.mode == "sync":
            answers.append(read_when_applied(table, step, seconds, table.answer, ids[lo:hi], pool,
                                             seen=None if seen is None else seen[j]))
        else:  # (a read that never waits: answered now, as read_when_applied would)
            with table.lock:
                answers.append(table.answer(ids[lo:hi], pool))
    return _pooled(answers)


class _PackedLayout(NamedTuple):
    """Where a packed lookup's tables' bags are (:func:`_packed_layout`)."""

    #: each table's first bag and the bag after its last, as indices into the bags' first ids
    #: (an end past the last bag clamped to it: ``at_end``)
    points: torch.Tensor
    #: which of ``points`` are the end of every bag: the number of ids there
    at_end: list[bool]
    #: each bag's table's first bag (a bag of no table: itself)
    own: torch.Tensor

    def spans(self, first: torch.Tensor, n: int) -> list[int]:
        """Each table's first and end position among the ``n`` ids, bags starting at ``first``
        (``bag_ends(first, n)`` at each table's first and end bag)."""
        return [n if end else at for at, end in zip(first.index_select(0, self.points).tolist(), self.at_end)]

    def relative(self, first: torch.Tensor) -> torch.Tensor:
        """Each bag's first position among its table's ids (``first`` less its table's first
        bag's), for every table at once."""
        return first - first.index_select(0, self.own)


#: :func:`_packed_layout`'s answers by ``(bag_base, bag_counts, bags)``: a trainer's packed
#: lookups keep one layout from step to step (a few at most: cleared beyond 16)
_packed_layouts: dict[tuple, _PackedLayout | None] = {}
_UNKNOWN = object()  # (a layout not in _packed_layouts: None is a layout read as sent)


def _packed_layout(bag_base: list[int], bag_counts: list[int], bags: int) -> _PackedLayout | None:
    """The layout of :func:`_pool_tables`' tables' bags (``bag_base``, ``bag_counts``, of
    ``bags`` in all), made once per layout; None unless each table's bags are within the bags,
    none in two tables (then they are read as sent, one table after another)."""
    key = (tuple(bag_base), tuple(bag_counts), bags)
    # (one read: another handler thread may clear the cache between a check and a read)
    known = _packed_layouts.get(key, _UNKNOWN)
    if known is not _UNKNOWN:
        return known
    ranges = sorted(zip(bag_base, bag_counts))
    fits = bags > 0 and all(base >= 0 and count >= 0 and base + count <= bags for base, count in ranges) and all(
        a + n <= b for (a, n), (b, _) in zip(ranges, ranges[1:]))
    layout = None
    if fits:
        ends = [b for base, count in zip(bag_base, bag_counts) for b in (base, base + count)]
        own = torch.arange(bags)
        for base, count in zip(bag_base, bag_counts):
            own[base:base + count] = base
        layout = _PackedLayout(torch.tensor([min(b, bags - 1) for b in ends]), [b == bags for b in ends], own)
    if len(_packed_layouts) >= 16:
        _packed_layouts.clear()
    _packed_layouts[key] = layout
    return layout


def _pooled(answers: list) -> Future:
    """:func:`_pool_tables`' answer of the tables' ``answers`` (each its pooled bags or a
    Future of them): packed in one tensor at once when none waits, else once all are done."""
    if not any(isinstance(a, Future) for a in answers):
        return _done(answers[0] if len(answers) == 1 else torch.cat(answers))
    pending = [a if isinstance(a, Future) else _done(a) for a in answers]
    if len(pending) == 1:
        return pending[0]
    # once every table's is done: every table's answer, or the first table's error as it was raised
    # (the refusals of several tables' steps as one error naming them all)
    return followed(torch.futures.collect_all(pending), partial(_pooled_answers, pending))


def _done(value: object) -> Future:
    """A Future already set to ``value``."""
    done: Future = Future()
    done.set_result(value)
    return done


def _pooled_answers(pending: list[Future], _: Future) -> torch.Tensor:
    failures = []
    for future in pending:
        try:
            future.wait()
        except BaseException as exc:
            failures.append(exc)
    refused = [exc for exc in failures if isinstance(exc, StepRefusal)]
    if refused:
        raise _refusals(refused)
    if failures:
        raise failures[0]
    return torch.cat([f.wait() for f in pending])


def _refusals(errors: list[BaseException]) -> BaseException:
    """Several tables' refused steps as one error (a ``ValueError`` if one of them is)."""
    if len(errors) == 1:
        return errors[0]
    cls = StepRefused if any(isinstance(e, ValueError) for e in errors) else StepNotApplied
    return cls("\n".join(str(e) for e in errors))


def _push_rows(name: str, trainer: str, step: int, ids: torch.Tensor, grad: torch.Tensor,
               token: str | None = None) -> None:
    _table(name).push(trainer, step, ids, grad, token)


def _push_bags(name: str, trainer: str, step: int, ids: torch.Tensor, first: torch.Tensor, grads: torch.Tensor,
               token: str | None = None) -> None:
    """:func:`_push_rows` of one table's lookup from the gradient of its pooled bags
    (:class:`~remote_module.ps.tables.server._requests.BagsPush`): each position's gradient is
    its bag's, as torch's ``embedding_bag`` backward gives it; they are summed per row in
    position order (the trainer's sums bit for bit), or, for SGD, added in that order as
    torch's sparse SGD does (:func:`_push_positions`)."""
    _check_bags(ids, first, grads)
    _push_positions(name, trainer, step, ids.long(), grads.index_select(0, _bag_of_positions(name, first, ids.numel())),
                    token)


#: each table's last bags pushed in the bags' form: ``(starts, positions, each position's bag)``
#: (a trainer's batches usually keep one layout from step to step; :func:`_bag_of_positions`)
_pushed_bags: dict[str, tuple[torch.Tensor, int, torch.Tensor]] = {}


def _bag_of_positions(name: str, first: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`bag_index` of ``n`` positions in bags starting at ``first`` (checked there), the
    last push's when its starts were the same (a function of them alone: any table's push
    may use it)."""
    last = _pushed_bags.get(name)
    if (last is not None and last[1] == n and last[0].dtype == first.dtype and last[0].shape == first.shape
            and torch.equal(last[0], first)):
        return last[2]
    index = bag_index(first, n)
    _pushed_bags[name] = (first, n, index)
    return index


def _push_positions(name: str, trainer: str, step: int, ids: torch.Tensor, grad: torch.Tensor,
                    token: str | None = None) -> None:
    """:func:`_push_rows` of each position's gradient: summed per row here first (in position
    order, the trainer's sums bit for bit), outside the table's lock, unless the table adds
    them as they come (SGD, ``Table._adds_positions``): a push that sync or half_async holds
    until its step is then its rows, not all of its positions."""
    table = _table(name)
    if not table._adds_positions():
        ids, grad = coalesce(ids, grad)
    table.push(trainer, step, ids, grad, token)


def _check_bags(ids: torch.Tensor, first: torch.Tensor, grads: torch.Tensor) -> None:
    """``ValueError`` unless ``grads`` has a row per bag of ``first`` (one bag's gradient each:
    a row more or less would be read as another bag's, or left out)."""
    if ids.dim() != 1 or grads.dim() != 2 or first.dim() != 1 or grads.shape[0] != first.numel():
        raise ValueError(f"a pooled gradient of shape {tuple(grads.shape)} does not fit ids of shape "
                         f"{tuple(ids.shape)} in {first.numel()} bags")


def _push_tables(entries: list[tuple], ids: torch.Tensor, grads: torch.Tensor) -> list[tuple[bool, object]]:
    """Several tables' :func:`_push_rows` in one call (a collection's or a PSModel's step):
    ``entries`` are ``(name, trainer, step, rows, token)`` in order, their ids and gradient
    rows packed in ``ids`` and ``grads``. Each runs as its own call would, in order, and its
    outcome is answered alone: ``(True, None)``, or ``(False, RemoteFailure)``."""
    outcomes: list[tuple[bool, object]] = []
    at = 0
    for name, trainer, step, rows, token in entries:
        try:
            _push_rows(name, trainer, step, ids[at:at + rows], grads[at:at + rows], token)
            outcomes.append((True, None))
        except BaseException as exc:  # that push's own failure, answered alone
            outcomes.append((False, capture(exc)))
        at += rows
    return outcomes


def _push_bag_tables(entries: list[tuple], ids: torch.Tensor | None, first: torch.Tensor | None,
                     grads: torch.Tensor) -> list[tuple[bool, object]]:
    """:func:`_push_rows` of several tables looked up together (a collection's packed lookup,
    :func:`_pool_tables`) from the gradient of their pooled bags, as the trainer's backward
    left it, in one call: ``ids`` as that lookup sent them (None: it had none of the batch's
    ids here), ``grads`` the gradient of each bag holding ids here, in batch order, and
    ``first`` each such bag's first position in ``ids``; ``entries`` are ``(name, trainer,
    step, lo, hi, token)``, each table's ids ``ids[lo:hi]``. Each position's gradient is its
    bag's (as torch's ``embedding_bag`` backward gives it); each table's push then runs as its
    own call would (:func:`_push_positions`: summed per row in position order, the trainer's
    sums bit for bit, or added position by position for SGD, as :func:`_push_bags` does for a
    table alone), in order, and its outcome is answered alone, as :func:`_push_tables`'s."""
    n = 0 if ids is None else ids.numel()
    try:
        if n:
            _check_bags(ids, first, grads)
            flat, per_position = ids.long(), grads.index_select(0, bag_index(first, n))
            if any(not 0 <= lo <= hi <= n for _, _, _, lo, hi, _ in entries):
                raise ValueError(f"table ranges {[(lo, hi) for _, _, _, lo, hi, _ in entries]} do not fit {n} ids")
    except BaseException as exc:  # (arguments that do not fit: every table's push fails)
        return [(False, capture(exc))] * len(entries)
    outcomes: list[tuple[bool, object]] = []
    for name, trainer, step, lo, hi, token in entries:
        try:
            # (none of its ids here: an empty push, a step of the table all the same)
            uniq, grad = (flat[lo:hi], per_position[lo:hi]) if n else (torch.empty(0, dtype=torch.long),
                                                                        torch.zeros(0, grads.shape[1]))
            _push_positions(name, trainer, step, uniq, grad, token)
            outcomes.append((True, None))
        except BaseException as exc:  # that push's own failure, answered alone
            outcomes.append((False, capture(exc)))
    return outcomes


def _push_row_deltas(name: str, ids: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    return _table(name).add_deltas(ids, deltas)


def _set_settings(name: str, trainer: str, settings: dict) -> None:
    """``trainer``'s row-wise optimizer settings (its ``ps_optimizer``'s ``lr``, ``betas``) for
    table ``name`` (:func:`take_settings`)."""
    take_settings(_table(name), trainer, settings)


def _flush_table(name: str) -> None:
    """half_async: table ``name`` applies what is queued now (:func:`merge_now`)."""
    merge_now(_table(name))


def _merge_state(names: list[str]) -> list[tuple[int, float]]:
    """Each half_async table of ``names``: the merges applied here so far, and the seconds at
    least before its timer merges what is queued now (``inf``: nothing queued). A prefetch reads
    it ahead of its lookups, in the same message: what they read reflects those merges (or
    later ones), and no timer merges before those seconds pass unless more pushes come."""
    out = []
    for name in names:
        table = _table(name)
        with table.lock:
            out.append((table.merged, table.merges.left()))
    return out


@rpc.functions.async_execution
def _read_unless_merged(merged: list[tuple[str, int]], handler: object, args: tuple) -> Future:
    """A prefetched lookup's check at its forward (half_async): None when no table of
    ``merged`` (``(name, merges read with the prefetch)``) merged since, so the prefetch's
    answer holds; else the lookup ``handler(*args)`` again (its answer, or its Future)."""
    if all(_table(name).merged == n for name, n in merged):
        done: Future = Future()
        done.set_result(None)
        return done
    got = handler(*args)  # type: ignore[operator]
    if isinstance(got, Future):
        return got
    answered: Future = Future()
    answered.set_result(got)
    return answered


def _table_stats(name: str) -> dict:
    """This server's rows of the table: held, created (admitted) and evicted so far, bytes."""
    return _table(name).stats()
