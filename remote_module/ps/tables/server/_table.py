"""A sharded table on one server: its blocks (row storage, ``_rows``), its step counter, the
modes' bookkeeping (``ps._modes``) and the lifetime parts it composes (admission, eviction,
deltas: ``tables.lifetime``). The RPC handlers that reach it are ``_handlers`` (lookups,
pushes) and ``_checkpoint_handlers`` (rows and state read and written by checkpoints)."""

from __future__ import annotations

import threading
import uuid

import torch
from torch import nn

from remote_module._core import embedding_bag_parts
from remote_module.ps._modes import STEPS_FROM_0, HalfAsyncMerges, SyncSteps, TrainerSettings, settle
from remote_module.ps._rowwise import RowOptimizer, coalesce
from remote_module.ps.tables.lifetime._admission import CountingSketch
from remote_module.ps.tables.lifetime._deltas import Tombstones
from remote_module.ps.tables.lifetime._eviction import Eviction
from remote_module.ps.tables.server._initial import row_key
from remote_module.ps.tables.server._memory import fix_mmap_threshold, release_freed_memory
from remote_module.ps.tables.server._pooling import check_ids, check_offsets, pool_rows, with_padding_row
from remote_module.ps.tables.server._rows import Clocks, RowBlock, TableSpec

ALL = slice(None)  # "every position": indexes a tensor without a copy


class Table:
    """A table's blocks on one server, its step counter and (sync) the pushes of the step."""

    def __init__(self, name: str, spec: TableSpec, blocks: list[tuple[int, int]]) -> None:
        self.name, self.spec = name, spec
        if spec.init == "lazy":
            fix_mmap_threshold()
        key = row_key(spec.seed, name)
        self.clocks = Clocks()
        self.blocks = [RowBlock(spec, first, count, key, self.clocks) for first, count in sorted(blocks)]
        # admission: how many steps each id not stored yet was counted in (admit_after > 1)
        self.sketch = CountingSketch(spec.sketch_bytes, spec.admit_after, key) if spec.admit_after > 1 else None
        # eviction: when the blocks are swept (lifetime/_eviction.py)
        self.eviction = Eviction(spec.evict_after)
        # delta checkpoints: the ids dropped after each version and each caller's baseline
        # (lifetime/_deltas.py)
        self.tombstones = Tombstones()
        # this table's life on this server: an incremental save follows a base saved from the
        # same one only (its versions count from here; a table made again counts afresh)
        self.incarnation = uuid.uuid4().hex
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
        # the trainers' row-wise optimizer settings (their ps_optimizer's lr, betas), and the last
        # ones a step took with the optimizer they make (:meth:`_optimizer`)
        self.settings = TrainerSettings(f"table {name!r}")
        self._last_optimizer: tuple[dict, RowOptimizer] | None = None

    def _block_of(self, ids: torch.Tensor) -> torch.Tensor:
        """For each id, the index of the block that holds it (``ValueError`` for an id no block here holds)."""
        block = torch.searchsorted(self.starts, ids, right=True) - 1
        inside = block >= 0
        if bool(inside.all()):
            ends = self.ends[block]
            inside = ids < ends
        else:
            inside &= ids < self.ends[block.clamp(min=0)]
        if not bool(inside.all()):
            bad = torch.unique(ids[~inside])[:5].tolist()  # (a push's ids may repeat: SGD adds them as they come)
            raise ValueError(f"table {self.name!r}: rows {bad} are not held on this server")
        return block

    def _split(self, ids: torch.Tensor) -> list[tuple[RowBlock, torch.Tensor | slice]]:
        """The blocks holding ``ids`` (checked), each with the positions of its ids (``ALL``:
        all of them, the common case of one block per server, taken without a copy)."""
        if len(self.blocks) == 1:
            rows = self.blocks[0]
            if ids.numel():
                low, high = torch.aminmax(ids)
                if int(low) < rows.first or int(high) >= rows.first + rows.count:
                    self._block_of(ids)  # raises, naming the ids
            return [(rows, ALL)]
        block = self._block_of(ids)
        out = []
        for b, rows in enumerate(self.blocks):
            mine = (block == b).nonzero().reshape(-1)
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
                return embedding_bag_parts(block.values, block.eager_slots(ids), offsets.long(), "sum",
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
        opt = self._optimizer(self.settings.latest if settings is None else settings)
        if self._adds_positions():  # (no sort: each position's gradient added in order)
            uniq, summed = self._without_padding(ids.long(), grad)
        else:
            uniq, summed = self._coalesced(ids, grad)
        parts = self._split(uniq)  # checked before anything changes
        self.clocks.bump()
        if admit and self.sketch is not None:
            uniq, summed = self.admitted(uniq, summed)
            parts = self._split(uniq)
        self.optimizer_steps += 1
        for rows, mine in parts:  # (ALL: the whole tensors, not even a view made)
            rows.step(uniq if mine is ALL else uniq[mine], summed if mine is ALL else summed[mine],
                      self.optimizer_steps, scale, opt)
        if self.kept_for_state.numel():  # (stepped: trained rows now, whatever a load did before)
            self.kept_for_state = self.kept_for_state[~torch.isin(self.kept_for_state, uniq)]
        self.ticked()

    def _optimizer(self, settings: dict | None) -> RowOptimizer | None:
        """The table's optimizer with a trainer's ``settings`` (None without any), made again
        unless they are the last ones, the same dict (:class:`TrainerSettings` keeps its own copy
        of a trainer's, never changed, until the trainer sends others)."""
        if not settings:
            return None
        last = self._last_optimizer
        if last is None or last[0] is not settings:
            last = self._last_optimizer = (settings, self.spec.optimizer._replace(**settings))
        return last[1]

    def _coalesced(self, ids: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A push's gradient summed per id (ids unique, ascending), without the padding row's
        (never trained: trainers leave it out; so does the server)."""
        return self._without_padding(*coalesce(ids, grad))

    def _without_padding(self, ids: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.spec.padding_idx is not None:
            keep = ids != self.spec.padding_idx
            ids, grad = ids[keep], grad[keep]
        return ids, grad

    def _adds_positions(self) -> bool:
        """Whether a step adds a gradient as it comes, repeated ids and all, rather than summed
        per id first (no sort): SGD (``RowBlock.step`` adds rows in order, as torch's sparse
        SGD adds its uncoalesced gradient), on eager rows (a lazy block creates rows per id)
        without admission (which counts each id once per step)."""
        return self.spec.optimizer.kind == "sgd" and self.spec.init != "lazy" and self.sketch is None

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
            release_freed_memory()
        if self.eviction.due(self.clocks.step):
            self.sweep(force=False)

    def sweep(self, force: bool = True) -> None:
        """Drop the evicted rows now (lock held); their ids are kept as tombstones for deltas.
        Not ``force``: only in blocks where they are at least an eighth of the rows (compacting
        costs a pass over all the rows; evicted rows read as absent until then)."""
        if self.spec.evict_after is None:
            return
        self.dropped(self.eviction.sweep(self.blocks, self.clocks.step, force))

    def dropped(self, ids: torch.Tensor) -> None:
        """Rows ``ids`` were dropped (swept, or by a load; lock held): a change, whose ids
        deltas carry as tombstones."""
        if ids.numel():
            self.tombstones.add(self.clocks.bump(), ids)

    def set_clock(self, step: int) -> None:
        """The table's step here is ``step`` from now on (a load; lock held): eviction counts
        from it."""
        self.clocks.step = step
        self.eviction.restart(step)

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
                self._check_shape(trainer, ids, grad)  # (apply checks the ids before anything changes)
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
            answers, error = self.sync.push_counted(trainer, step, (ids, grad), token, self._apply_step, lambda: (
                RuntimeError(f"table {self.name!r}: trainer {trainer!r} pushed step {step}, the table is at step "
                             f"{self.sync.done} ({STEPS_FROM_0})")))
        settle(answers)
        if error is not None:
            raise error

    def _check_push(self, trainer: str, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """``ValueError`` unless ``grad`` has one row of ``dim`` values per id and every id
        (but the padding row) is held here: what :meth:`apply` would refuse later, when the push
        is counted in a step or queued with others."""
        self._check_shape(trainer, ids, grad)
        if self.spec.padding_idx is not None:
            ids = ids[ids != self.spec.padding_idx]
        self._split(ids)

    def _check_shape(self, trainer: str, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """``ValueError`` unless ``grad`` has one row of ``dim`` values per id of 1-d ``ids``
        (an async push too: ``apply`` would raise only once the step was counted: a refused
        push changes nothing)."""
        if ids.dim() != 1 or tuple(grad.shape) != (ids.numel(), self.spec.dim):
            raise ValueError(
                f"table {self.name!r}: trainer {trainer!r} pushed a gradient of shape {tuple(grad.shape)} for ids "
                f"of shape {tuple(ids.shape)}; expected ({ids.numel()}, {self.spec.dim}) for 1-d ids"
            )

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
                    rows.mark_changed(slots, version)
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
                    "merges": self.merged, "longest_eviction_pause_s": self.eviction.longest_sweep_s}

    def block(self, first: int) -> RowBlock:
        """The block starting at row ``first`` (``LookupError`` if this server has none)."""
        for rows in self.blocks:
            if rows.first == first:
                return rows
        raise LookupError(f"table {self.name!r} has no block starting at row {first} here")
