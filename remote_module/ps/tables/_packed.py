"""A collection's lookups planned together: for the tables of a
:class:`ShardedEmbeddingBagCollection` that pool by sum or mean, the trainer checks the ids
and splits them (and their bags) by server for all those tables at once, in a few
whole-batch array ops (NumPy's, on the tensors' memory: see :func:`plan`), and sends each
server one call carrying every table's share packed into two tensors; the server answers
every table's pooled bags packed into one.

The outputs, gradients and pushes are those of each table's own lookup, bit for bit: every
server pools its rows of a bag in position order, as alone, and the trainer adds the servers'
partial sums in each table's own server order. The float32 tables that record gradients are
recorded by one autograd node (:class:`_RecordPacked`), whose backward keeps the gradient
of the batch's pooled bags as it is and hands each table its part; the collection's next step
sends each server, in one call, the server's share of the lookup as it was sent with the
gradient of the bags it holds ids of (:func:`push_together`), and the server computes each table's rows' gradients, each
table's push and outcome its own. Inputs outside the plain forms (int32 ids,
``per_sample_weights``, ``padding_idx``, max pooling, geo mode, bags given wrongly) take each
table's own path, which checks and refuses them as the table does.
"""

from __future__ import annotations

from functools import partial
from operator import is_, itemgetter
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from remote_module._core import backward_accumulates
from remote_module.ps._rowwise import bag_ends, bag_index, coalesce, pooled_rows
from remote_module.ps._steps import PushPlan, finished
from remote_module.ps.tables._embedding_bag import ShardedEmbeddingBag, _BagRows
from remote_module.ps.tables._lookups import LookupPlan
from remote_module.ps.tables._pushes import table_push_failure
from remote_module.ps.tables.server import _handlers
from remote_module.ps.tables.server._requests import BagEntry, BagTablesPush, PooledRead


class _RecordPacked(torch.autograd.Function):
    """The pooled bags of several float32 tables (given as one tensor, the tables' bags in
    turn; one output per table), recorded for their ``step()`` in one autograd node. Backward
    puts the tables' gradients into one gradient of every bag of the batch (divided by the
    bag's size for mean) and hands each table whose output it reached its part, as its own
    ``_RowsForStep`` would, but as a :class:`TablePackedGradient` (the rows' gradients are computed
    by the servers at the push, or here by ``rows()`` for another path), with a zero-size
    gradient for its grad marker."""

    @staticmethod
    def forward(ctx: Any, pooled: torch.Tensor, divisor: torch.Tensor | None, together: "PackedGradient", parts: list,
                *markers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # per table: (table, its index in the layout, its AccumulateGrad, its first bag, its bags' end)
        ctx.together, ctx.parts, ctx.divisor = together, parts, divisor
        ctx.markers = [(m.dtype, m.device) for m in markers]
        ctx.shape = pooled.shape
        # every table's bags, in the batch's order (the usual case): one split here, one cat in backward
        ctx.in_turn = _in_turn(parts, pooled.shape[0])
        # one output per table: a table whose output backward never reaches gets None in backward
        # and records nothing, as its own node would not run (torch: its .grad stays None)
        ctx.set_materialize_grads(False)
        if ctx.in_turn:
            return tuple([part.clone() for part in pooled.split([b1 - b0 for _, _, _, b0, b1 in parts])])
        return tuple([pooled[b0:b1].clone() for _, _, _, b0, b1 in parts])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        reached = [g is not None for g in grads]
        markers = tuple([torch.zeros(0, dtype=d, device=v) if r else None for (d, v), r in zip(ctx.markers, reached)])
        if not any(reached):
            return (None,) * 4 + markers
        if ctx.in_turn and all(reached):
            grad = torch.cat([g.to(torch.float32) for g in grads])
        else:
            grad = torch.zeros(ctx.shape, dtype=torch.float32)
            for (_, _, _, b0, b1), g in zip(ctx.parts, grads):
                if g is not None:
                    grad[b0:b1] = g
        if ctx.divisor is not None:
            grad = grad / ctx.divisor
        layout, shares, _ = ctx.together
        together = PackedGradient(layout, shares, grad)  # (as its _replace(grad=grad))
        for (table, index, accumulator, _, _), r in zip(ctx.parts, reached):
            # as a parameter's .grad: only a backward that reaches the table's output and
            # accumulates into its marker records
            if r and backward_accumulates(accumulator):
                # (a collection's step pushes it with the others recorded here: push_together)
                table._keep_gradient(TablePackedGradient(together, index), together)
        return (None,) * 4 + markers


def _in_turn(parts: list, bags: int) -> bool:
    """Whether ``parts`` (:class:`_RecordPacked`'s) hold all ``bags`` bags of the batch, in turn."""
    return parts[0][3] == 0 and parts[-1][4] == bags and all(a[4] == b[3] for a, b in zip(parts, parts[1:]))


class PackedGradient(NamedTuple):
    """Gradients that tables planned together recorded in one backward: the plan's
    :class:`Layout`, each called server's share of the lookup as it was sent (``(server
    index, ids, first)``, the arrays of its ``_pool_tables`` call), and the gradient of every
    bag of the batch."""

    layout: "Layout"
    shares: list
    grad: torch.Tensor | None


class TablePackedGradient:
    """One table's gradient recorded in a :class:`PackedGradient`: ``rows()`` computes its rows'
    gradients, as the servers would (``_push_bag_tables``), for the paths that need them here."""

    __slots__ = ("together", "index")

    def __init__(self, together: PackedGradient, index: int) -> None:
        self.together, self.index = together, index

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        layout, shares, grad = self.together
        i = self.index
        b0, b1 = layout.bag_base[i], layout.bag_base[i + 1]
        ids_parts, rows_parts = [torch.empty(0, dtype=torch.long)], [torch.zeros(0, grad.shape[1], dtype=grad.dtype)]
        for k, ids, first in shares:
            if i not in layout.served[k]:
                continue
            lo, hi = bag_ends(first, ids.numel())[[b0, b1]].tolist()
            if hi > lo:  # (an id's positions are all on its server: each row's sum as the server's)
                uniq, rows = pooled_rows(ids[lo:hi], bag_index(first[b0:b1] - lo, hi - lo), grad[b0:b1])
                ids_parts.append(uniq)
                rows_parts.append(rows)
        return coalesce(torch.cat(ids_parts), torch.cat(rows_parts))


def push_together(together: PackedGradient, members: list, done: set) -> PushPlan:
    """One push plan for tables whose gradients since their last step are exactly what they
    recorded in ``together`` (``members``: ``(name, table, taken)``, taken by
    ``_take_for_step``): one ``_push_bag_tables`` call per server, carrying that server's share
    of the lookup as it was sent and the gradient of the bags with ids there (the starts of
    those bags in its ids: its traffic does not grow with the number of servers), with one
    entry per table it serves (an empty push where it has none of the table's ids: a step all the same,
    as alone). The server computes each table's rows' gradients, the same rows and bits as the
    table's own push. The plan settles each table by its entries' outcomes, as alone: done (in
    ``done``) or its gradients kept for a retry; the first failure is raised."""
    layout, shares, grad = together
    index = layout.index
    mine = sorted([(index[id(table)], name, table, taken) for name, table, taken in members], key=itemgetter(0))
    by_server = {k: (ids, first) for k, ids, first in shares}
    calls, at, sent = [], [], 0
    for k, server in enumerate(layout.servers):
        served = [j for j, (_, _, table, _) in enumerate(mine) if server in table._server_names]
        if not served:
            continue
        ids, first = by_server.get(k, (None, None))
        if ids is None:  # none of the batch's ids here: empty pushes
            spans, starts, part = [0] * len(layout.bag_base), None, grad[:0]
        else:  # the gradient of the bags with ids here only, and each table's positions in ids
            # (index arithmetic in NumPy, on the plan's arrays: see plan)
            first_np = first.numpy()
            ends = np.empty(first_np.size + 1, dtype=np.int64)
            ends[:-1], ends[-1] = first_np, ids.shape[0]
            spans = ends[layout.bag_base].tolist()
            has = (ends[1:] > first_np).nonzero()[0]
            starts, part = torch.from_numpy(first_np[has]), grad.index_select(0, torch.from_numpy(has))
            sent += ids.nbytes + starts.nbytes  # (nbytes: numel() * element_size())
        entries = [BagEntry(t.name, t._trainer, t._step, spans[i], spans[i + 1], t._token)
                   for i, _, t, _ in map(mine.__getitem__, served)]
        calls.append((server, _handlers._push_bag_tables, BagTablesPush(entries, ids, starts, part)))
        at.append(served)
        sent += part.nbytes
    # (the calls' bytes, counted once, on its first table)
    parts = [(name, table, *table._pushed(taken, True, sent if j == 0 else 0))
             for j, (_, name, table, taken) in enumerate(mine)]

    def failed() -> None:  # the message failed (a server down or late): every table keeps its gradients
        for _, _, _, table_failed in parts:
            table_failed()

    def answered(got: list) -> BaseException | None:
        """Each call's outcome: a call that failed (its server down or late) fails the tables it
        carried, as their own pushes to that server would have; else each entry's own."""
        failures = _failures(calls, at, got, parts)
        took = _applied(calls, at, got) if failures else {}
        for j, (name, _, table_done, table_failed) in enumerate(parts):
            if j in failures:  # (kept for the retry: its rows on the servers that did not apply them)
                table_failed(took.get(j, ()))
            else:
                finished(done, name, table_done)
        return next(iter(failures.values())) if failures else None

    return PushPlan(calls, failed=failed, settle_parts=answered)


def _entry_outcomes(served: list, ok_sent: bool, value: Any) -> list:
    """Each entry's ``(ok, outcome)`` of a call of :func:`push_together` carrying the tables
    ``served`` (``(ok_sent, value)``: the call's outcome): its answer's, or, the call failed
    (its server down or late), its error for every entry."""
    return value if ok_sent else [(False, value)] * len(served)


def _failures(calls: list, at: list, got: list, parts: list) -> dict[int, BaseException]:
    """Per table (its index in ``parts``) whose entry failed on some server: the first failure
    (of :func:`push_together`'s ``calls``, ``at`` the tables each carried, ``got`` their outcomes)."""
    failures: dict[int, BaseException] = {}
    for (server, _, _), served, (ok_sent, value) in zip(calls, at, got):
        for j, (ok, outcome) in zip(served, _entry_outcomes(served, ok_sent, value)):
            if not ok and j not in failures:
                failures[j] = table_push_failure(server, parts[j][1].name, outcome) if ok_sent else outcome
    return failures


def _applied(calls: list, at: list, got: list) -> dict[int, list[str]]:
    """Per table (its index in ``parts``): the servers that applied its entry, in call order
    (only asked when some entry failed: a retry pushes to the others)."""
    took: dict[int, list[str]] = {}
    for (server, _, _), served, (ok_sent, value) in zip(calls, at, got):
        for j, (ok, _) in zip(served, _entry_outcomes(served, ok_sent, value)):
            if ok:
                took.setdefault(j, []).append(server)
    return took


def _record_packed(layout: "Layout", tables: list, indices: list[int], pooled: torch.Tensor,
                     divisor: torch.Tensor | None, shares: list) -> tuple[torch.Tensor, ...]:
    """``pooled`` recorded for ``tables`` (``indices``: theirs in ``layout``) by one
    :class:`_RecordPacked` node, under every table's marker lock (see
    ``GradientRecording._rows_recorded``), taken in one order (by ``id``; the layout's when they
    are all its tables): each table's pooled bags."""
    locks = layout.lock_order if len(tables) == len(layout.tables) else _lock_order(tables)
    for t in locks:
        t._marker_lock.acquire()
    try:
        hooked = [t._hooked_marker() for t in tables]
        base = layout.bag_base
        parts = [(t, i, accumulator, base[i], base[i + 1]) for t, i, (_, accumulator) in zip(tables, indices, hooked)]
        markers = [marker for marker, _ in hooked]
        out = _RecordPacked.apply(pooled, divisor, PackedGradient(layout, shares, None), parts, *markers)
        return out if isinstance(out, tuple) else (out,)
    finally:
        for t in locks:
            t._marker_lock.release()


def _lock_order(tables: Sequence[Any]) -> list:
    """``tables`` each once, in the order their marker locks are taken (by ``id``: every lookup
    takes them in one order)."""
    return sorted({id(t): t for t in tables}.values(), key=id)


def packable(table: Any, input: Any, offsets: Any, per_sample_weights: Any, records: bool) -> bool:
    """Whether a lookup of ``table`` can be planned with the others (plain Python checks):
    a sum or mean bag, not geo, no padding row, no ``per_sample_weights``, int64 ids as a
    2-d tensor, or 1-d with 1-d int64 offsets of at least one bag; and it records its
    gradients (``records``: grad enabled and the table's ``grad_marker`` requiring it, read by
    the caller once for all its tables) or needs more than one server (else the table's own
    path sends nothing but the arguments)."""
    if not (isinstance(table, ShardedEmbeddingBag) and table.bag_mode in ("sum", "mean")
            and table.ps_mode != "geo" and table.padding_idx is None and per_sample_weights is None
            and isinstance(input, torch.Tensor) and input.dtype == torch.int64):
        return False
    dims = input.ndim  # (as dim(), without a call)
    if dims == 2:
        if offsets is not None or input.shape[1] == 0:  # (torch refuses 0 columns: "step must be nonzero")
            return False
    elif not (dims == 1 and isinstance(offsets, torch.Tensor) and offsets.ndim == 1
              and offsets.dtype == torch.int64 and offsets.shape[0] > 0):
        return False
    return records or not table._sent_as_given(None)  # (a lookup that records is never sent as given)


class Layout:
    """What a set of tables and their numbers of bags fix (kept while they stay the same): where
    each table's bags sit in the batch, the id range each table takes in one global id space,
    every block's start in it and its server. The arrays a plan's checks and split by server
    read are NumPy's (:func:`plan`)."""

    def __init__(self, tables: Sequence[ShardedEmbeddingBag], bags: Sequence[int]) -> None:
        self.tables = list(tables)
        self.index = {id(t): i for i, t in enumerate(tables)}  # each table's index, by id (the last of a repeated one)
        # the order a lookup takes the tables' marker locks in (_record_packed): by id, each once
        self.lock_order = _lock_order(tables)
        self.servers: list[str] = []
        for t in tables:
            self.servers += [s for s in t._server_names if s not in self.servers]
        # every table's servers in the order of self.servers: then adding the servers' parts in
        # that order adds each table's in its own order, as its own lookup does
        self.in_order = all([s for s in self.servers if s in t._server_names] == t._server_names for t in tables)
        self.bags = list(bags)
        self.bag_base, self.id_base = [0], [0]
        for t, b in zip(tables, bags):
            self.bag_base.append(self.bag_base[-1] + b)
            self.id_base.append(self.id_base[-1] + t.num_embeddings)
        self.num_embeddings = np.array([t.num_embeddings for t in tables], dtype=np.int64)
        self.id_bases = np.array(self.id_base[:-1], dtype=np.int64)
        # each bag's table; each table's first and last bag (of the tables with bags: a 2-d input of
        # 0 rows has none, and no ids); whether bag b + 1 is of bag b's table
        self.bag_table = np.repeat(np.arange(len(tables)), self.bags)
        self.has = np.array([i for i, b in enumerate(bags) if b], dtype=np.int64)
        self.first_bag = np.array([self.bag_base[i] for i in self.has], dtype=np.int64)
        self.last_bag = np.array([self.bag_base[i + 1] - 1 for i in self.has], dtype=np.int64)
        self.inner = self.bag_table[1:] == self.bag_table[:-1]
        starts, servers = [], []
        for t, base in zip(tables, self.id_base):
            for first, _, server in t._ranges:
                starts.append(base + first)
                servers.append(self.servers.index(server))
        self.block_starts, self.block_server = np.array(starts, dtype=np.int64), np.array(servers, dtype=np.int64)
        self.mean_bags = torch.repeat_interleave(torch.tensor([t.bag_mode == "mean" for t in tables]),
                                                 torch.tensor(list(bags)))
        self.any_mean = any(t.bag_mode == "mean" for t in tables)
        # per server: its tables (index in ``tables``), their first bags and numbers of bags (a
        # lookup's call sends copies) and, packed, the rows of their bags: None for every bag, a
        # slice when its tables follow one another, else their indices
        self.served: list[list[int]] = []
        self.served_bases: list[list[int]] = []
        self.served_bags: list[list[int]] = []
        self.rows: list[torch.Tensor | slice | None] = []
        for server in self.servers:
            mine = [i for i, t in enumerate(tables) if server in t._server_names]
            self.served.append(mine)
            self.served_bases.append([self.bag_base[i] for i in mine])
            self.served_bags.append([self.bags[i] for i in mine])
            if len(mine) == len(tables):
                self.rows.append(None)
            elif mine and mine == list(range(mine[0], mine[-1] + 1)):
                self.rows.append(slice(self.bag_base[mine[0]], self.bag_base[mine[-1] + 1]))
            else:
                rows = [torch.arange(self.bag_base[i], self.bag_base[i + 1]) for i in mine]
                self.rows.append(torch.cat(rows) if rows else torch.empty(0, dtype=torch.long))
        # ids travel as int32 when every table's fit (as a torch dtype, and NumPy's: plan casts with it)
        self.wire = torch.int32 if all(t.num_embeddings <= 2**31 for t in tables) else torch.int64
        self.wire_np = np.int32 if self.wire == torch.int32 else np.int64


class _Batch(NamedTuple):
    """A batch planned by :func:`plan`: what making its outputs of the servers' answers needs."""

    tables: list  # the tables, in the entries' order
    bags: list[int]  # each table's number of bags
    layout: Layout
    counts: np.ndarray  # each table's number of ids
    flat: torch.Tensor  # every table's ids, in turn
    starts: torch.Tensor  # every bag's first position in the batch
    records: list[bool]  # which tables record gradients (as at the plan: a prefetch's at its forward)
    called: list[int]  # the servers called (indices into layout.servers), in call order
    shares: list[tuple]  # each call's (server index, ids, each bag's first id there)


def plan(layouts: dict, entries: Sequence[tuple[ShardedEmbeddingBag, torch.Tensor, torch.Tensor | None]],
         wait_s: float) -> LookupPlan | None:
    """The host calls (one per server) of the lookups ``entries`` (``(table, input, offsets)``,
    each :func:`packable`), and what makes the tables' outputs of their answers; None when the
    batch does not pass the checks (ids out of range, bags given wrongly): each table's own
    path then refuses it as the table does. ``layouts`` keeps the last :class:`Layout`.

    The checks and the split by server are index arithmetic on a few thousand ids, done with
    NumPy on the tensors' memory: the same values as torch's ops, at a fraction of their
    per-call cost (measured in a DLRM step: tutorials/performance.md)."""
    tables = [t for t, _, _ in entries]
    arrays = _inputs(entries)
    if arrays is None:
        return None
    flat, raw, counts, bags = arrays
    layout = _layout_of(layouts, tables, bags)
    if _refused(layout, flat, raw, counts):
        return None
    # which tables record gradients (recorded when the outputs are made: a prefetch's at its forward)
    grad = torch.is_grad_enabled()
    records = [grad and t.grad_marker.requires_grad for t in tables]
    # every bag's first position in the batch (the starts passed the checks: from 0, never back,
    # none past the end)
    pos_base = np.zeros(len(tables) + 1, dtype=np.int64)
    np.cumsum(counts, out=pos_base[1:])
    starts = raw + pos_base[layout.bag_table]
    calls, called, shares = [], [], []
    alone = len(layout.servers) == 1
    if not alone:  # each position's server, found in one id space (table k's ids from id_base[k])
        gid = flat + np.repeat(layout.id_bases, counts)
        server_of = layout.block_server[np.searchsorted(layout.block_starts, gid, side="right") - 1]
    # (before: how many of the positions before each bag's start the servers so far hold)
    last, before = len(layout.servers) - 1, None
    for k, server in enumerate(layout.servers):
        if alone:  # (every id here, each bag's first where it starts)
            ids, first = flat, starts
        else:
            on = server_of == k
            ids = flat[on]
            if k < last:
                first = _firsts_on(on, starts)
                before = first if before is None else before + first
            else:  # (the positions before a bag's start that no other server holds)
                first = starts if before is None else starts - before
        if not ids.size:
            # none of the batch's ids here: no call, as no table alone calls a server without
            # its ids (so a server down or waiting for a sync step holds up only what needs it)
            continue
        called.append(k)
        served = layout.served[k]
        wire, first = torch.from_numpy(ids.astype(layout.wire_np)), torch.from_numpy(first)  # (astype: a copy)
        calls.append((server, _handlers._pool_tables,
                      PooledRead([tables[i].name for i in served], [tables[i]._step for i in served], wire,
                                 first, list(layout.served_bases[k]), list(layout.served_bags[k]), wait_s)))
        shares.append((k, wire, first))
    batch = _Batch(tables, bags, layout, counts, torch.from_numpy(flat), torch.from_numpy(starts), records, called,
                   shares)
    return LookupPlan(calls, partial(_outputs, batch))


def _firsts_on(on: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Each bag's first id at a server, among that server's ids in batch order: how many of the
    positions before the bag's start are there (``on``: whether each position's id is)."""
    before = np.zeros(on.size + 1, dtype=np.int64)
    np.cumsum(on, out=before[1:])
    return before[starts]


def _inputs(entries: Sequence[tuple[Any, torch.Tensor, torch.Tensor | None]]
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]] | None:
    """Every entry's ids flat, in turn; every bag's offset within its table's ids (a 2-d input:
    a bag per row); each table's number of ids; each table's number of bags. None for tensors
    whose memory NumPy cannot read (not on the CPU, sparse, a negative view, a wrapper subclass
    without storage): each table's own path then looks them up (and refuses them as alone). A
    plain subclass's memory is read as a tensor's: the calls carry plain tensors."""
    try:
        flats = [(x.reshape(-1) if x.ndim == 2 else x).numpy() for _, x, _ in entries]
        offsets = [np.arange(x.shape[0], dtype=np.int64) * x.shape[1] if x.ndim == 2 else off.numpy()
                   for _, x, off in entries]
    except (TypeError, RuntimeError, ValueError):
        return None
    counts = np.array([f.shape[0] for f in flats], dtype=np.int64)
    # (concatenate copies: the caller may change its tensors before the step pushes by these ids)
    return np.concatenate(flats), np.concatenate(offsets), counts, [off.shape[0] for off in offsets]


def _layout_of(layouts: dict, tables: list, bags: list[int]) -> Layout:
    """The :class:`Layout` of ``tables`` with ``bags``: the last one of ``layouts`` (by bags)
    while they stay the same, else a new one, which ``layouts`` keeps."""
    key = tuple(bags)
    layout = layouts.get(key)
    # (the same bags: as many tables as the layout's, one number of bags each)
    if layout is None or not all(map(is_, layout.tables, tables)):
        layout = Layout(tables, bags)
        layouts.clear()
        layouts[key] = layout
    return layout


def _refused(layout: Layout, flat: np.ndarray, raw: np.ndarray, counts: np.ndarray) -> bool:
    """Whether the batch fails the checks: a table's bags that do not start at its first id, go
    back, or end past its last id; ids out of range (``raw``: each bag's offset in its table's
    ids). Bags of the next table start at its first id, so the batch's starts never go back."""
    if raw.size and (raw[layout.first_bag].any() or (raw[layout.last_bag] > counts[layout.has]).any()
                     or (raw[1:] < raw[:-1])[layout.inner].any()):
        return True
    return bool(flat.size) and bool(flat.min() < 0 or (flat >= np.repeat(layout.num_embeddings, counts)).any())


def _summed(batch: _Batch, got: list) -> torch.Tensor:
    """Every bag's sum of the servers' partial sums ``got``, in each table's own server order
    (a server not called has no id of the batch: its part is zeros, which adding leaves as is),
    in float32, as the servers pool and a table's own lookup adds, whatever the default dtype."""
    layout, tables, bags = batch.layout, batch.tables, batch.bags
    shape = (layout.bag_base[-1], tables[0].embedding_dim)
    if layout.in_order:
        total = None
        for k, part in zip(batch.called, got):
            rows = layout.rows[k]
            if total is None:
                if rows is None:  # (zeros + part, in one op: the same bits, -0.0 made 0.0)
                    total = part + 0.0
                    continue
                total = torch.zeros(shape, dtype=torch.float32)
            if rows is None:
                total = total + part
            elif isinstance(rows, slice):  # (total is this function's own: added in place, as index_add adds)
                total[rows] += part
            else:
                total = total.index_add(0, rows, part)
        return torch.zeros(shape, dtype=torch.float32) if total is None else total
    total = torch.zeros(shape, dtype=torch.float32)
    parts = dict(zip(batch.called, got))  # each table's parts in its own server order
    for i, t in enumerate(tables):
        lo, hi = layout.bag_base[i], layout.bag_base[i + 1]
        for server in t._server_names:
            k = layout.servers.index(server)
            if k not in parts:
                continue
            at = sum(bags[j] for j in layout.served[k] if j < i)
            total[lo:hi] = total[lo:hi] + parts[k][at:at + hi - lo]
    return total


def _outputs(batch: _Batch, got: list) -> list[torch.Tensor]:
    """The tables' outputs of the servers' answers ``got`` (means divided by their bags' sizes),
    recorded for the tables' steps: the float32 tables together (:func:`_record_packed`),
    a table of another dtype by its own rows' node, as alone."""
    layout, tables = batch.layout, batch.tables
    total = _summed(batch, got)
    sizes_all = None
    if layout.any_mean:
        sizes_all = torch.diff(bag_ends(batch.starts, batch.flat.numel())).clamp(min=1).unsqueeze(1).to(total.dtype)
        total = torch.where(layout.mean_bags.unsqueeze(1), total / sizes_all, total)
    # (warns, as a table's own lookup does, of gradients never pushed)
    recording = [i for i, t in enumerate(tables) if batch.records[i] and t._records_gradients()]
    dtypes = [t._dtype() for t in tables]  # (each table's output dtype, read once)
    together: dict[int, torch.Tensor] = {}  # per table recorded together: its pooled bags
    if recording and all([dtypes[i] == torch.float32 for i in recording]):
        divisor = torch.where(layout.mean_bags.unsqueeze(1), sizes_all, 1.0) if layout.any_mean else None
        made = _record_packed(layout, [tables[i] for i in recording], recording, total, divisor, batch.shares)
        together = dict(zip(recording, made))
        recording = []
    elif recording:  # (a table of another dtype: each its own rows' node, as alone)
        counts = torch.from_numpy(batch.counts)
        gid = batch.flat + torch.repeat_interleave(torch.from_numpy(layout.id_bases), counts)
        uniq, inverse = torch.unique(gid, sorted=True, return_inverse=True)
        cuts = torch.searchsorted(uniq, torch.tensor(layout.id_base)).tolist()
        pos_base = [0, *torch.cumsum(counts, 0).tolist()]
        bag_of = bag_index(batch.starts, batch.flat.numel(), check=False)
    out = []
    for i, t in enumerate(tables):
        lo, hi = layout.bag_base[i], layout.bag_base[i + 1]
        value = together[i] if i in together else total[lo:hi]
        if value.dtype != dtypes[i]:  # (to() of its own dtype gives the tensor itself)
            value = value.to(dtypes[i])
        if i in recording:  # (a table of another dtype: its own rows' node, as alone)
            p0, p1 = pos_base[i], pos_base[i + 1]
            t_uniq = uniq[cuts[i]:cuts[i + 1]] - layout.id_base[i]
            holder = t._rows_recorded(t_uniq, torch.zeros(t_uniq.numel(), tables[0].embedding_dim, dtype=dtypes[i]))
            value = _BagRows.apply(holder, value, inverse[p0:p1] - cuts[i], bag_of[p0:p1] - lo, None,
                                   sizes_all[lo:hi] if t.bag_mode == "mean" else None)
        out.append(value)
    return out
