"""The server side of a sharded embedding table: the rows a server owns, row-wise optimizer
state for the rows ever touched, lookups and sparse updates. Trainers create a table by a
job-unique name, idempotently, as for dense parameters (see ``_dense_server``).

Rows are sliced into blocks by the same rule as dense parameters (whole rows, see
:func:`slice_blocks`) and placed by the same dispatchers; a block's storage, eager or lazy, is
``_rows._Rows``.

The modes are ``_modes``'s, shared with dense parameters: ``sync`` (a step's pushes summed in
trainer-name order, divided by the number of trainers, applied once; lookups for the next step
wait for it; a trainer's push for the step after its last one may arrive first and waits),
``async`` (applied on arrival), ``half_async`` (queued, the sum applied every ``merge_every``
pushes or ``merge_s`` seconds), ``geo`` (trainers push row deltas, added divided by the number
of trainers). Bags can be pooled here (:func:`pool_rows`), so only pooled rows travel.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import threading
import time
from functools import partial

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.futures import Future

from remote_module._core import HostStore, capture, embedding_bag_parts, followed
from remote_module.ps._modes import (
    STEPS_FROM_0,
    HalfAsyncMerges,
    StepNotApplied,
    StepRefusal,
    StepRefused,
    SyncSteps,
    TrainerSettings,
    read_when_applied,
    settle,
)
from remote_module.ps._rowwise import bag_index, coalesce, pooled_rows_of_ranges
from remote_module.ps.tables.lifetime._admission import CountingSketch
from remote_module.ps.tables.server._rows import (
    AT_INIT,
    Clocks,
    TableSpec,
    _Rows,
    check_ids,
    check_offsets,
    pool_rows,
    row_key,
    with_padding_row,
)

ALL = slice(None)  # "every position": indexes a tensor without a copy


class Table:
    """A table's blocks on one server, its step counter and (sync) the pushes of the step."""

    def __init__(self, name: str, spec: TableSpec, blocks: list[tuple[int, int]]) -> None:
        self.name, self.spec = name, spec
        if spec.init == "lazy":
            _fix_mmap_threshold()
        key = row_key(spec.seed, name)
        self.clocks = Clocks()
        self.blocks = [_Rows(spec, first, count, key, self.clocks) for first, count in sorted(blocks)]
        # admission: how many steps each id not stored yet was counted in (admit_after > 1)
        self.sketch = CountingSketch(spec.sketch_bytes, spec.admit_after, key) if spec.admit_after > 1 else None
        # eviction: the table's step of the last sweep, the longest sweep (seconds)
        self.swept_at, self.longest_sweep_s = 0, 0.0
        # delta checkpoints: each caller's baseline by (token, trainer) (the version its last
        # delta reached), the ids evicted after each version (tombstones), and the version before
        # which none are kept
        self.baselines: dict[tuple[str, str | None], int] = {}
        self.tombstones: list[tuple[int, torch.Tensor]] = []
        self.tombstones_from = 0
        # a lazy table's rows that a weights-only load kept for their optimizer state alone (the
        # checkpoint had no such row: they are back at their first values); an optimizer state
        # load that gives them none drops them, so a full load leaves the checkpoint's rows only
        self.kept_for_state = torch.empty(0, dtype=torch.long)
        self.starts = torch.tensor([r.first for r in self.blocks], dtype=torch.long)
        self.ends = torch.tensor([r.first + r.count for r in self.blocks], dtype=torch.long)
        self.lock = threading.Condition()
        # optimizer steps of the table (torch's per-parameter ``step``: Adagrad's lr_decay,
        # SparseAdam's bias correction): steps in which a trainer had a gradient for it
        self.optimizer_steps = 0
        self.trainers: set[str] = set()  # attached
        self.label, self.noun = f"sharded table {name!r}", "table"
        # sync: a trainer that looked nothing up since its last step did not wait for that step
        # to complete, so its push for the next one may arrive first: it waits for its step
        # a step the servers refuse (the trainers' settings disagree) is skipped, and each trainer
        # is told at its next lookup
        self.sync = SyncSteps(self, spec.num_trainers, allow_ahead=True, skip_refused=True)
        # each trainer's newest object of this table (sync: the one that pushes)
        self.tokens: dict[str, str | None] = {}
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []  # half_async pushes not applied yet
        self.merges = HalfAsyncMerges(self.lock, spec.merge_every, spec.merge_s, self._apply_queued)
        # half_async merges applied so far (by count, timer or flush): a prefetched lookup read
        # before one is stale (:func:`_merge_state`, :func:`_read_unless_merged`)
        self.merged = 0
        # the trainers' row-wise optimizer settings (their ps_optimizer's lr, betas)
        self.settings = TrainerSettings(f"table {name!r}")

    def _owner(self, ids: torch.Tensor) -> torch.Tensor:
        """For each id, the index of the block that holds it (``ValueError`` for an id no block here holds)."""
        owner = torch.searchsorted(self.starts, ids, right=True) - 1
        inside = owner >= 0
        if bool(inside.all()):
            ends = self.ends[owner]
            inside = ids < ends
        else:
            inside &= ids < self.ends[owner.clamp(min=0)]
        if not bool(inside.all()):
            bad = ids[~inside][:5].tolist()
            raise ValueError(f"table {self.name!r}: rows {bad} are not held on this server")
        return owner

    def _split(self, ids: torch.Tensor) -> list[tuple[_Rows, torch.Tensor | slice]]:
        """The blocks holding ``ids`` (checked), each with the positions of its ids (``ALL``:
        all of them, the common case of one block per server, taken without a copy)."""
        if len(self.blocks) == 1:
            rows = self.blocks[0]
            if ids.numel():
                low, high = torch.aminmax(ids)
                if int(low) < rows.first or int(high) >= rows.first + rows.count:
                    self._owner(ids)  # raises, naming the ids
            return [(rows, ALL)]
        owner = self._owner(ids)
        out = []
        for b, rows in enumerate(self.blocks):
            mine = (owner == b).nonzero().reshape(-1)
            if mine.numel():
                out.append((rows, mine))
        return out

    def lookup(self, ids: torch.Tensor, parts: list | None = None) -> torch.Tensor:
        """The rows of ``ids`` (any order, repeats allowed), as stored now (``parts``:
        :meth:`_split` of ``ids``, when the caller has it)."""
        parts = self._split(ids) if parts is None else parts
        if len(parts) == 1 and parts[0][1] is ALL:
            return parts[0][0].read(ids)
        out = torch.empty(ids.numel(), self.spec.dim, dtype=self.spec.dtype)
        for rows, mine in parts:
            out[mine] = rows.read(ids[mine])
        return out

    def answer(self, ids: torch.Tensor, pool: tuple | None) -> object:
        """A lookup's answer: the rows of ``ids``, or with ``pool`` = ``(offsets, weights,
        kind)`` those rows pooled (:func:`pool_rows`)."""
        ids = ids.long()
        parts = self._split(ids)
        if pool is not None and pool[2] == "sum" and len(parts) == 1 and parts[0][1] is ALL \
                and parts[0][0].slot_of is None and parts[0][0].last is None:
            # one eager block holds every id: pool straight from it (the same sums, in the same
            # order, as pooling the rows read out first), without copying them out
            block = parts[0][0]
            offsets, weights, _ = pool
            with block.lock:
                return embedding_bag_parts(block.values, ids - block.first, offsets.long(), "sum",
                                           None if weights is None else weights.to(block.values.dtype))[0]
        rows = self.lookup(ids, parts)
        return rows if pool is None else pool_rows(rows, ids, *pool)

    def bags(self, input: torch.Tensor, offsets: torch.Tensor | None, weights: torch.Tensor | None,
             mode: str) -> torch.Tensor:
        """``nn.EmbeddingBag(mode=mode)``'s forward on this table's rows, for a server that holds
        the whole table: the same checks (ids in range, offsets that do not decrease, then
        torch's own), errors and sums, bit for bit. ``weights``: ``per_sample_weights``."""
        flat = input.reshape(-1).long()
        check_ids(flat, self.spec.num_embeddings)
        check_offsets(offsets)
        if weights is not None:
            weights = weights.to(self.spec.dtype)
        if len(self.blocks) == 1 and self.blocks[0].slot_of is None and self.blocks[0].last is None:
            # one eager block holds every row: pool straight from it, as the local module does
            block = self.blocks[0]
            with block.lock:
                return nn.functional.embedding_bag(input, block.values, offsets, mode=mode,
                                                   per_sample_weights=weights, padding_idx=self.spec.padding_idx)
        # lazy (or several blocks): pool the rows of the unique ids, read out first
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        rows, pad = with_padding_row(uniq, self.lookup(uniq), self.spec.padding_idx)
        return nn.functional.embedding_bag(inverse.reshape(input.shape), rows, offsets, mode=mode,
                                           per_sample_weights=weights, padding_idx=pad)

    def apply(self, ids: torch.Tensor, grad: torch.Tensor, scale: float = 1.0, settings: dict | None = None,
              admit: bool = True) -> None:
        """One optimizer step of the table with the sparse gradient ``(ids, grad)`` (lock held),
        with ``settings`` (default: the latest push's) in the row-wise optimizer; ``admit``: the
        ids are counted for admission (half_async counts each push as it arrives instead)."""
        settings = self.settings.latest if settings is None else settings
        opt = self.spec.optimizer._replace(**settings) if settings else None
        uniq, summed = self._coalesced(ids, grad)
        parts = self._split(uniq)  # checked before anything changes
        self.clocks.bump()
        if admit and self.sketch is not None:
            uniq, summed = self.admitted(uniq, summed)
            parts = self._split(uniq)
        self.optimizer_steps += 1
        for rows, mine in parts:
            rows.step(uniq[mine], summed[mine], self.optimizer_steps, scale, opt)
        if self.kept_for_state.numel():  # (stepped: trained rows now, whatever a load did before)
            self.kept_for_state = self.kept_for_state[~torch.isin(self.kept_for_state, uniq)]
        self.ticked()

    def _coalesced(self, ids: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A push's gradient summed per id (ids unique, ascending), without the padding row's
        (never trained: trainers leave it out; so does the server)."""
        uniq, summed = coalesce(ids, grad)
        if self.spec.padding_idx is not None:
            keep = uniq != self.spec.padding_idx
            uniq, summed = uniq[keep], summed[keep]
        return uniq, summed

    def admitted(self, uniq: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Count this step's ids (unique, held here) that have no stored row, and keep the
        gradient of the ids with one or counted in ``admit_after`` steps by now (lock held)."""
        stored = torch.zeros(uniq.numel(), dtype=torch.bool)
        for rows, mine in self._split(uniq):
            with rows.lock:
                stored[mine] = rows.slots(uniq[mine], create=False) >= 0  # (an evicted row: -1)
        counted = ~stored
        keep = stored.clone()
        if bool(counted.any()):
            keep[counted] = self.sketch.count(uniq[counted], self.clocks.version) >= self.spec.admit_after
        return uniq[keep], grad[keep]

    def ticked(self) -> None:
        """One of the table's steps is done here (lock held): eviction counts it, and sweeps the
        evicted rows every ``evict_after / 4`` steps (they read as absent meanwhile)."""
        self.clocks.step += 1
        if self.spec.init == "lazy":
            _release_freed_memory()
        n = self.spec.evict_after
        if n is not None and self.clocks.step - self.swept_at >= max(1, n // 4):
            self.sweep(force=False)

    def sweep(self, force: bool = True) -> None:
        """Drop the evicted rows now (lock held); their ids are kept as tombstones for deltas.
        Not ``force``: only in blocks where they are at least an eighth of the rows (compacting
        costs a pass over all the rows; evicted rows read as absent until then)."""
        if self.spec.evict_after is None:
            return
        began = time.perf_counter()
        self.swept_at = self.clocks.step
        gone = []
        for rows in self.blocks:
            with rows.lock:
                gone.append(rows.sweep(force))
        gone_ids = torch.cat(gone)
        if gone_ids.numel():
            self.tombstones.append((self.clocks.bump(), gone_ids))
            self._trim_tombstones()
        self.longest_sweep_s = max(self.longest_sweep_s, time.perf_counter() - began)

    #: tombstones kept per table per server at most (ids); callers whose baseline is older get a
    #: whole table instead of a delta
    TOMBSTONES_KEPT = 1 << 22

    def _trim_tombstones(self) -> None:
        """Drop tombstones no caller needs (older than every baseline), and the oldest beyond
        ``TOMBSTONES_KEPT``."""
        oldest = min(self.baselines.values(), default=self.clocks.version)
        while self.tombstones and (self.tombstones[0][0] <= oldest or
                                   sum(t.numel() for _, t in self.tombstones) > self.TOMBSTONES_KEPT):
            self.tombstones_from = self.tombstones.pop(0)[0]

    def push(self, trainer: str, step: int, ids: torch.Tensor | None, grad: torch.Tensor | None,
             token: str | None = None) -> None:
        """A trainer's sparse gradient, applied by the table's mode (async: now; sync: once every
        trainer has pushed step ``step``, summed in trainer-name order / num_trainers).

        ``ids`` and ``grad`` ``None``: the trainer had no gradient for the table this step (sync
        trainers push every step; a step in which no trainer had one is not an optimizer step,
        as torch skips a parameter without a gradient).

        Sync: ``token`` names the trainer's object of the table that pushes; only the newest
        attached may (``ValueError`` otherwise: one trainer, one object); pushing the step it
        pushed last again (the retry of a ``step()`` that failed on another server after this
        push arrived) is a no-op."""
        answers: list = []
        error: BaseException | None = None
        with self.lock:
            if ids is None and self.spec.mode != "sync":
                return
            if self.spec.mode == "async":
                self.settings.pushed(trainer)
                self.apply(ids, grad)
                return
            if self.spec.mode == "half_async":
                self._check_push(trainer, ids, grad)  # before it is queued: it would fail the merge
                self.settings.pushed(trainer)
                if self.sketch is not None:  # (each push is a trainer's step: counted as it arrives)
                    ids, grad = self._coalesced(ids, grad)
                    self.clocks.bump()
                    ids, grad = self.admitted(ids, grad)
                self.queued.append((ids, grad))
                self.merges.queued()
                return
            if self.spec.mode == "geo":
                raise ValueError(f"table {self.name!r} is in geo mode: trainers push row deltas, not gradients")
            if token != self.tokens.get(trainer, token):
                raise ValueError(
                    f"table {self.name!r}: trainer {trainer!r} has created another ShardedEmbedding of this table "
                    "since this one, or this one is a copy (copy.deepcopy, pickle); in sync mode a trainer steps a "
                    "table through one object (the newest created): use the same module wherever the table is used"
                )
            if ids is not None:
                self._check_push(trainer, ids, grad)  # before it counts: it would fail its step forever
            try:
                self.sync.push(trainer, step, (ids, grad), token, self._apply_step, lambda: RuntimeError(
                    f"table {self.name!r}: trainer {trainer!r} pushed step {step}, the table is at step "
                    f"{self.sync.done} ({STEPS_FROM_0})"))
            except BaseException as exc:  # (reads failed by a step not applied are answered all the same)
                error = exc
            answers = self.sync.ready()
        settle(answers)
        if error is not None:
            raise error

    def _check_push(self, trainer: str, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """``ValueError`` unless ``grad`` has one row of ``dim`` values per id and every id
        (but the padding row) is held here: what :meth:`apply` would refuse later, when the push
        is counted in a step or queued with others."""
        if ids.dim() != 1 or tuple(grad.shape) != (ids.numel(), self.spec.dim):
            raise ValueError(
                f"table {self.name!r}: trainer {trainer!r} pushed a gradient of shape {tuple(grad.shape)} for ids "
                f"of shape {tuple(ids.shape)}; expected ({ids.numel()}, {self.spec.dim}) for 1-d ids"
            )
        if self.spec.padding_idx is not None:
            ids = ids[ids != self.spec.padding_idx]
        self._split(ids)

    def _apply_step(self, pushes: list[tuple[str, tuple]]) -> None:
        """sync: one step's pushes (in trainer-name order) as one optimizer step of their sum /
        num_trainers; none when no trainer had a gradient (lock held)."""
        settings = self.settings.agreed([t for t, _ in pushes])
        pushes = [(ids, grad) for _, (ids, grad) in pushes if ids is not None]
        if pushes:
            self.apply(torch.cat([i for i, _ in pushes]), torch.cat([g for _, g in pushes]),
                       1.0 / self.spec.num_trainers, settings)

    def _apply_queued(self) -> None:
        queued, self.queued = self.queued, []
        self.merged += 1
        self.apply(torch.cat([i for i, _ in queued]), torch.cat([g for _, g in queued]), admit=False)

    def add_deltas(self, ids: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """geo: add ``deltas / num_trainers`` to rows ``ids`` (unique; the padding row is left
        as it is); their merged values."""
        moved = ids
        if self.spec.padding_idx is not None:
            keep = ids != self.spec.padding_idx
            moved, deltas = ids[keep], deltas[keep]
        with self.lock:
            version = self.clocks.bump()
            for rows, mine in self._split(moved):
                with rows.lock:
                    slots = rows.slots(moved[mine], create=True)
                    rows.values[slots] += deltas[mine].to(rows.values.dtype) / self.spec.num_trainers
                    rows.changed[slots] = version
                    if rows.last is not None:
                        rows.last[slots] = self.clocks.step + 1
            self.ticked()
            return self.lookup(ids)

    def memory_bytes(self) -> int:
        return sum(rows.memory_bytes() for rows in self.blocks)

    def layout(self) -> list[tuple[int, int]]:
        """The blocks held here, ``(first row, count)`` each."""
        return [(r.first, r.count) for r in self.blocks]

    def stats(self) -> dict:
        """:func:`_table_stats`'s answer for this server (evicted rows swept first)."""
        with self.lock:
            self.sweep()
            return {"rows_held": sum(r.held() for r in self.blocks),
                    "rows_admitted": sum(r.created for r in self.blocks),
                    "rows_evicted": sum(r.evicted for r in self.blocks),
                    "bytes": self.memory_bytes() + sum(r.bookkeeping_bytes() for r in self.blocks)
                    + (0 if self.sketch is None else self.sketch.nbytes()), "steps": self.clocks.step,
                    "merges": self.merged, "longest_eviction_pause_s": self.longest_sweep_s}

    def block(self, first: int) -> _Rows:
        """The block starting at row ``first`` (``LookupError`` if this server has none)."""
        for rows in self.blocks:
            if rows.first == first:
                return rows
        raise LookupError(f"table {self.name!r} has no block starting at row {first} here")


def _glibc(name: str) -> object:
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):  # (not glibc)
        return None


_trim = _glibc("malloc_trim")
_mallopt = _glibc("mallopt")
#: glibc's mallopt parameter: allocations of at least this many bytes are mapped on their own
#: and unmapped when freed
_M_MMAP_THRESHOLD = -3
_fixed_threshold = False


def _fix_mmap_threshold() -> None:
    """Once a lazy table lives here: allocations of 1 MiB or more are mapped on their own (and
    returned to the system when freed), always. glibc's default threshold moves up to each
    large block freed (up to 32 MiB), after which the blocks a lazy table grows into and drops
    stay in its heap, fragmented."""
    global _fixed_threshold
    if _mallopt is not None and not _fixed_threshold:
        _fixed_threshold = True
        _mallopt(_M_MMAP_THRESHOLD, 1 << 20)


#: lazy tables' steps on this server between two returns of freed memory to the system
TRIM_EVERY = 64
_lazy_steps = itertools.count(1)


def _release_freed_memory() -> None:
    """Every ``TRIM_EVERY`` steps of lazy tables here, hand the memory malloc holds freed back
    to the system (glibc's ``malloc_trim``): a server's lookups and pushes free temporaries of
    every size, which glibc otherwise keeps per arena, so a long-lived server's memory would
    grow by far more than its rows."""
    if _trim is not None and next(_lazy_steps) % TRIM_EVERY == 0:
        _trim(0)


# ---- handlers ------------------------------------------------------------------------------

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
        return table.sync.done, table.sync.refusals


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
    """A collection's sum-pooled lookups of several tables in one call (``_packed``): ``ids``
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
            with table.lock:
                try:
                    table.sync.check_told(told)
                except StepRefusal as exc:
                    refused.append(exc)
        if refused:
            raise _refusals(refused)
    pending = []
    for name, step, base, count in zip(names, steps, bag_base, bag_counts):
        table = _table(name)
        lo = int(first[base]) if count else 0
        hi = lo if not count else int(first[base + count]) if base + count < first.numel() else ids.numel()
        if lo == hi:  # none of its ids here: zeros, without waiting (its own lookup sends nothing here)
            done: Future = Future()
            done.set_result(torch.zeros(count, table.spec.dim))
            pending.append(done)
            continue
        pool = (first[base:base + count] - lo, None, "sum")
        pending.append(read_when_applied(table, step, seconds, table.answer, ids[lo:hi], pool,
                                         seen=None if seen is None else seen[len(pending)]))
    if len(pending) == 1:
        return pending[0]
    # once every table's is done: every table's answer, or the first table's error as it was raised
    # (the refusals of several tables' steps as one error naming them all)
    return followed(torch.futures.collect_all(pending), partial(_pooled_answers, pending))


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
    step, lo, hi, token)``, each table's ids ``ids[lo:hi]``. The rows' gradients of every
    table are computed here at once (:func:`pooled_rows_of_ranges`: the sums the trainer
    would compute, in position order, bit for bit); then each table's push runs as its own
    call would, in order, and its outcome is answered alone, as :func:`_push_tables`'s."""
    n = 0 if ids is None else ids.numel()
    ranges = [(lo, hi) if n else (0, 0) for _, _, _, lo, hi, _ in entries]
    try:
        rows = pooled_rows_of_ranges(ids, bag_index(first, n), grads, ranges) if n else None
    except BaseException as exc:  # (arguments that do not fit: every table's push fails)
        return [(False, capture(exc))] * len(entries)
    outcomes: list[tuple[bool, object]] = []
    for j, (name, trainer, step, _, _, token) in enumerate(entries):
        try:
            # (none of its ids here: an empty push, a step of the table all the same)
            uniq, grad = rows[j] if rows is not None else (torch.empty(0, dtype=torch.long),
                                                            torch.zeros(0, grads.shape[1]))
            _push_rows(name, trainer, step, uniq, grad, token)
            outcomes.append((True, None))
        except BaseException as exc:  # that push's own failure, answered alone
            outcomes.append((False, capture(exc)))
    return outcomes


def _push_row_deltas(name: str, ids: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    return _table(name).add_deltas(ids, deltas)


def _set_settings(name: str, trainer: str, settings: dict) -> None:
    """``trainer``'s row-wise optimizer settings (its ``ps_optimizer``'s ``lr``, ``betas``) for its
    pushes from now on: async and half_async apply each push with its trainer's (a half_async
    merge with the latest push's), another trainer's never; sync, those every trainer of the
    step sent, which must agree."""
    table = _table(name)
    with table.lock:
        table.settings.sent(trainer, settings)  # (its next push makes them the latest: async)


def _flush_table(name: str) -> None:
    table = _table(name)
    with table.lock:
        table.merges.merge()


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


def _block_rows(name: str, first: int, clocks: bool = False, version: bool = False) -> tuple:
    """``(ids, rows)`` the block starting at row ``first`` stores: every row of an eager block,
    the touched rows of a lazy one (sorted by id; evicted rows swept first); with ``clocks``
    also each row's eviction clock (its step when last stepped, or None without eviction) and
    the table's step here; with ``version`` last the table's version here (what a delta taken
    now would reach: a checkpoint's place in the delta chains)."""
    table = _table(name)
    with table.lock:
        table.sweep()
        rows = table.block(first)
        with rows.lock:
            ids, slots = rows.stored()
            out = (ids, rows.values.index_select(0, slots))
            if clocks:
                last = None if rows.last is None else rows.last.index_select(0, slots)
                out += (last, table.clocks.step)
            if version:
                out += (table.clocks.version,)
            return out


def _set_rows(name: str, ids: torch.Tensor, values: torch.Tensor, last: torch.Tensor | None = None,
              clock: int | None = None, replace: tuple[tuple[int, int], ...] = ()) -> None:
    """Overwrite rows ``ids`` (lazy rows are created); optimizer state is kept. ``replace``:
    row ranges ``(first, count)`` loaded whole (a lazy table's checkpoint holds all its rows):
    the rows stored here in them and not in ``ids`` go back to their first values first
    (:func:`_unloaded_rows_reset`). With eviction, ``last`` are the rows' clocks and ``clock``
    the table's step."""
    table = _table(name)
    with table.lock:
        version = table.clocks.bump()
        step = table.clocks.step if clock is None else int(clock)
        if replace:
            _unloaded_rows_reset(table, replace, ids, version, step)
        for rows, mine in table._split(ids):
            with rows.lock:
                _write_rows(rows, ids[mine], values[mine], version, step, None if last is None else last[mine])
        if clock is not None:  # (after the rows: rows held here are judged stale by this server's clock, not
            # the checkpoint's, so the optimizer state loaded before them is kept)
            table.clocks.step = table.swept_at = int(clock)


def _unloaded_rows_reset(table: Table, ranges: tuple[tuple[int, int], ...], loaded: torch.Tensor, version: int,
                         step: int) -> None:
    """A lazy table's weights load of the row ``ranges`` (the rows ``loaded``): each row stored
    here in them and not loaded reads as its first value from now on, as a local module's whole
    weight is replaced. One with optimizer state stays stored, at its first value, and keeps
    that state, as a torch optimizer keeps its state over ``load_state_dict`` of the weights
    (its clock restarts at ``step``); the others are dropped (lock held; rows evicted by now are
    swept first)."""
    table.sweep()
    gone_ids, kept = [], []
    for rows in table.blocks:
        with rows.lock:
            held, slots = rows.stored()
            out = _in_ranges(held, ranges) & ~torch.isin(held, loaded)
            if not bool(out.any()):
                continue
            with_state = rows.state_slot.index_select(0, slots) >= 0
            keep = out & with_state
            if bool(keep.any()):
                again = slots[keep]
                rows.values[again] = rows.initial(held[keep])
                rows.changed[again] = version
                if rows.last is not None:
                    rows.last[again] = step
                kept.append(held[keep])
            if bool((out & ~with_state).any()):
                gone_ids.append(rows.drop(held, slots, out & ~with_state))
    if gone_ids:
        table.tombstones.append((table.clocks.bump(), torch.cat(gone_ids)))
        table._trim_tombstones()
    table.kept_for_state = torch.cat(kept) if kept else torch.empty(0, dtype=torch.long)


def _write_rows(rows: _Rows, ids: torch.Tensor, values: torch.Tensor, version: int, step: int,
                last: torch.Tensor | None) -> torch.Tensor:
    """Set loaded rows ``ids`` of block ``rows`` (lazy ones created) to ``values``, changed at
    ``version``; with eviction their clocks ``last`` as loaded (a lazy block's rows are never at
    their first value, ``AT_INIT``: they start at ``step``), or ``step`` without them (lock
    held); their slots."""
    slots = rows.slots(ids, create=True)
    rows.values[slots] = values.to(rows.values.dtype)
    rows.changed[slots] = version
    if rows.last is not None:
        if last is None:
            rows.last[slots] = step
        else:
            last = last.long()
            rows.last[slots] = last if rows.slot_of is None else torch.where(last == AT_INIT, step, last)
    return slots


def _in_ranges(ids: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    inside = torch.zeros(ids.shape, dtype=torch.bool)
    for first, count in ranges:
        inside |= (ids >= first) & (ids < first + count)
    return inside


def _drop_where(table: Table, which: object) -> None:
    """Drop the stored rows whose ids ``which(ids)`` selects (lock held; tombstones kept)."""
    gone_ids = []
    for rows in table.blocks:
        with rows.lock:
            ids, slots = rows.stored()
            gone = which(ids)
            if bool(gone.any()):
                gone_ids.append(rows.drop(ids, slots, gone))
    if gone_ids:
        table.tombstones.append((table.clocks.bump(), torch.cat(gone_ids)))
        table._trim_tombstones()


def _table_stats(name: str) -> dict:
    """This server's rows of the table: held, created (admitted) and evicted so far, bytes."""
    return _table(name).stats()


def _admission_state(name: str) -> tuple[list[tuple[int, int]], torch.Tensor] | None:
    """The blocks held here and the admission sketch's counters (None without admission)."""
    table = _table(name)
    with table.lock:
        if table.sketch is None:
            return None
        return table.layout(), table.sketch.data.clone()


def _set_admission(name: str, parts: list[tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor | None]]) -> None:
    """Load admission sketches ``(blocks, counters, chunks)``: one saved by a server that held
    the same blocks is taken as it is (``chunks``: only those chunks, a delta's; None: all);
    others (another number of servers) are merged (:meth:`CountingSketch.merge`)."""
    table = _table(name)
    with table.lock:
        if table.sketch is None:
            return
        mine = table.layout()
        version = table.clocks.bump()
        exact = [p for p in parts if [tuple(b) for b in p[0]] == mine]
        if not exact and all(chunks is None for _, _, chunks in parts):
            # whole sketches saved by other servers replace this one's counts (merged from zero):
            # counts kept from before the load would admit ids earlier than the saved table does
            table.sketch.data.zero_()
        for blocks, data, chunks in (exact or parts):
            if tuple(data.shape) != (table.sketch.data.numel(),) and chunks is None:
                raise ValueError(f"table {name!r}: an admission sketch of {data.numel()} bytes, this table's has "
                                 f"{table.sketch.data.numel()} (admit_sketch_bytes must be the same)")
            if exact and chunks is None:
                table.sketch.load(data, version)
            elif exact:
                table.sketch.set_chunks(chunks, data, version)
            else:
                table.sketch.merge(data, version, chunks)


def _table_delta(name: str, token: str, trainer: str | None = None) -> dict:
    """The rows (and their optimizer state and clocks) changed since the last delta of
    ``token`` taken by ``trainer`` here, the ids evicted meanwhile and the admission sketch's
    chunks changed; the whole table here (``"whole"``: these blocks replace what a loader holds
    in them) at the first such call, or when its baseline is older than the tombstones kept.
    Each trainer's deltas of a token are a chain of their own: another trainer's calls with the
    same token leave its baseline alone."""
    table = _table(name)
    with table.lock:
        table.sweep()
        base = table.baselines.get((token, trainer))
        whole = base is None or base < table.tombstones_from
        since = -1 if whole else base
        parts = []
        for rows in table.blocks:
            with rows.lock:
                ids, slots = rows.stored()
                if not whole:
                    keep = rows.changed.index_select(0, slots) > since
                    ids, slots = ids[keep], slots[keep]
                where = rows.state_slot.index_select(0, slots)
                has = where >= 0
                parts.append((ids, rows.values.index_select(0, slots), rows.touched.index_select(0, slots),
                              {k: v.index_select(0, where[has]) for k, v in rows.state.items()}, has,
                              None if rows.last is None else rows.last.index_select(0, slots)))
        tombs = [t for v, t in table.tombstones if v > since] if not whole else []
        sketch = None
        if table.sketch is not None:
            sketch = (table.sketch.data.clone(), None) if whole else tuple(reversed(table.sketch.changed_since(since)))
        out = {
            "whole": table.layout() if whole else [],
            "ids": torch.cat([p[0] for p in parts]), "rows": torch.cat([p[1] for p in parts]),
            "stepped": torch.cat([p[2] for p in parts]), "has_state": torch.cat([p[4] for p in parts]),
            "state": {k: torch.cat([p[3][k] for p in parts if k in p[3]]) for k in
                      dict.fromkeys(k for p in parts for k in p[3])},
            "last": None if table.spec.evict_after is None else torch.cat([p[5] for p in parts]),
            "evicted": torch.cat(tombs) if tombs else torch.empty(0, dtype=torch.long),
            "step": table.optimizer_steps, "clock": table.clocks.step,
            "sketch": None if sketch is None else (table.layout(),) + sketch,
            "versions": (since, table.clocks.version),  # (what it follows, what it reaches)
        }
        table.baselines[(token, trainer)] = table.clocks.version
        table._trim_tombstones()
        return out


def _apply_delta(name: str, whole: tuple[tuple[int, int], ...], evicted: torch.Tensor, ids: torch.Tensor,
                 rows_: torch.Tensor, stepped: torch.Tensor, state: dict[str, torch.Tensor], has_state: torch.Tensor,
                 last: torch.Tensor | None, step: int, clock: int) -> None:
    """Load this server's share of a delta (:func:`_table_delta`'s, merged over servers and
    split by the trainer): rows in the ``whole`` ranges not in ``ids`` and the ``evicted`` ids
    are dropped, then ``ids`` are set with their optimizer state (``state`` holds the rows
    where ``has_state``; the others have none) and clocks."""
    table = _table(name)
    with table.lock:
        if whole or evicted.numel():
            _drop_where(table, lambda held: (_in_ranges(held, whole) & ~torch.isin(held, ids))
                        | torch.isin(held, evicted))
        version = table.clocks.bump()
        table.optimizer_steps = int(step)
        table.clocks.step = table.swept_at = int(clock)
        if table.kept_for_state.numel():  # (set by the delta now, or dropped: what it says)
            kept = table.kept_for_state
            table.kept_for_state = kept[~(torch.isin(kept, ids) | _in_ranges(kept, whole))]
        state_at = torch.cumsum(has_state.long(), 0) - 1  # each id's row in state
        for rows, mine in table._split(ids):
            with rows.lock:
                slots = _write_rows(rows, ids[mine], rows_[mine], version, table.clocks.step,
                                    None if last is None else last[mine])
                rows.touched[slots] = stepped[mine]
                rows._free_state(slots)  # (rows without state in the delta have none; theirs is free)
                with_state = has_state[mine]
                if state and bool(with_state.any()):
                    where = rows.state_slots(slots[with_state])
                    pick = state_at[mine][with_state]
                    for k, v in state.items():
                        rows.state[k].index_copy_(0, where, v.index_select(0, pick).to(table.spec.dtype))


def _row_state(name: str, first: int) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    """The table's optimizer step count and, for the block starting at row ``first``, the ids
    of the rows with optimizer state and that state (sorted by id)."""
    table = _table(name)
    with table.lock:
        table.sweep()
    rows = table.block(first)
    with rows.lock:
        ids, slots = rows.stored(stepped_only=True)
        where = rows.state_slot.index_select(0, slots)
        return table.optimizer_steps, ids, {k: v.index_select(0, where) for k, v in rows.state.items()}


def _set_row_state(name: str, optimizer_steps: int, ids: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
    """Replace this server's optimizer state of the table, as a torch optimizer's
    ``load_state_dict`` replaces its whole state: the step count, and the state of rows ``ids``
    (they count as touched); every other row here is left with none (its next step starts
    from the optimizer's initial state); a row a weights-only load kept for its state alone
    (:func:`_unloaded_rows_reset`) and given none here is dropped, as that load would have. A
    trainer sends every server of the table its share. A sync table's step (its trainers'
    round) is left alone: it is not optimizer state, and trainers already attached wait on it."""
    table = _table(name)
    with table.lock:
        table.optimizer_steps = optimizer_steps
        # rows a weights-only load kept for their state alone: given none now, they are dropped
        kept = table.kept_for_state
        orphans = kept[~torch.isin(kept, ids)]
        table.kept_for_state = kept[torch.isin(kept, ids)]
        if orphans.numel():
            _drop_where(table, lambda held: torch.isin(held, orphans))
        version = table.clocks.bump()
        for rows in table.blocks:  # (rows stepped since the checkpoint keep no state of their own)
            with rows.lock:
                rows.touched.zero_()
                rows.state_slot.fill_(-1)
                rows.state_used = 0
                rows.state_free = torch.empty(0, dtype=torch.long)
                rows.changed[:rows.used] = version
        if not ids.numel():
            return
        for rows, mine in table._split(ids):
            with rows.lock:
                slots = rows.slots(ids[mine], create=True)
                if state:
                    where = rows.state_slots(slots)
                    for k, v in state.items():
                        rows.state[k].index_copy_(0, where, v[mine].to(table.spec.dtype))
                rows.touched[slots] = True
