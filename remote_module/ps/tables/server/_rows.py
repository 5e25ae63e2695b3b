"""A sharded table's storage on a server: the rows of one block, held eagerly (one tensor,
every row created at once) or lazily (a row is created on its first touch, so a 100-million-row
table costs memory only for the rows used), with row-wise optimizer state for the rows ever
stepped, each row's version (for delta checkpoints) and, with eviction, its clock. Rows start
at their initial values (``_initial``)."""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from remote_module.ps._rowwise import RowOptimizer, new_state, step_rows
from remote_module.ps.tables.server._initial import initial_rows, row_key

#: the largest stamp a row's version is kept as (int32)
_STAMP_MAX = 2**31 - 1


def _grown(t: torch.Tensor, rows: int, fill: float = 0) -> torch.Tensor:
    """``t`` with room for ``rows`` rows (the new ones ``fill``)."""
    out = torch.full((rows,) + tuple(t.shape[1:]), fill, dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


class SlotIndex:
    """A lazy block's map from global row id to storage slot, in whole-tensor ops (no per-id
    Python): two sorted runs of ``(id, slot)`` pairs, a large one and a small recent one that
    new ids are merged into; the recent run is merged into the large one once it holds an
    eighth as many, so each id is copied a bounded number of times on average.

    Example::

        index = SlotIndex()
        index.add(torch.tensor([7, 3]), torch.tensor([0, 1]))
        index.find(torch.tensor([3, 5, 7]))        # tensor([ 1, -1,  0])
    """

    #: the recent run is merged into the large one beyond max(this, large / 8) pairs
    RECENT_MIN = 4096

    def __init__(self) -> None:
        empty = torch.empty(0, dtype=torch.long)
        self.ids, self.slots = empty, empty  # the large run, ids ascending
        self.recent_ids, self.recent_slots = empty, empty  # the recent run, ids ascending

    def __len__(self) -> int:
        return self.ids.numel() + self.recent_ids.numel()

    @staticmethod
    def _lookup(sorted_ids: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n = sorted_ids.numel()
        if not n:
            return torch.full_like(ids, -1)
        at = torch.searchsorted(sorted_ids, ids).clamp_(max=n - 1)
        return torch.where(sorted_ids[at] == ids, slots[at], -1)

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each of ``ids`` (int64, any shape, repeats allowed); -1 where none."""
        found = self._lookup(self.ids, self.slots, ids)
        if self.recent_ids.numel():
            found = torch.where(found >= 0, found, self._lookup(self.recent_ids, self.recent_slots, ids))
        return found

    @staticmethod
    def _merged(a_ids: torch.Tensor, a_slots: torch.Tensor, b_ids: torch.Tensor,
                b_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two sorted runs with no id in common as one sorted run."""
        n = a_ids.numel() + b_ids.numel()
        at_b = torch.searchsorted(a_ids, b_ids) + torch.arange(b_ids.numel())  # b's places in the result
        from_a = torch.ones(n, dtype=torch.bool)
        from_a[at_b] = False
        ids, slots = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.long)
        ids[at_b], slots[at_b] = b_ids, b_slots
        ids[from_a], slots[from_a] = a_ids, a_slots
        return ids, slots

    def add(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Add ``ids`` (sorted, unique, none present yet) at ``slots``."""
        self.recent_ids, self.recent_slots = self._merged(self.recent_ids, self.recent_slots, ids, slots)
        if self.recent_ids.numel() > max(self.RECENT_MIN, self.ids.numel() // 8):
            self.ids, self.slots = self._merged(self.ids, self.slots, self.recent_ids, self.recent_slots)
            self.recent_ids = self.recent_slots = torch.empty(0, dtype=torch.long)

    def remove_slots(self, dead: torch.Tensor) -> torch.Tensor:
        """Remove the ids whose slot ``s`` has ``dead[s]`` (a bool per slot, covering every slot
        held); the ids removed, ascending."""
        removed = []
        for run in ("", "recent_"):
            ids, slots = getattr(self, run + "ids"), getattr(self, run + "slots")
            if not ids.numel():
                continue
            gone = dead.index_select(0, slots)
            removed.append(ids[gone])
            setattr(self, run + "ids", ids[~gone])
            setattr(self, run + "slots", slots[~gone])
        return torch.sort(torch.cat(removed))[0] if removed else torch.empty(0, dtype=torch.long)

    def pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every ``(ids, slots)``, ids ascending."""
        return self._merged(self.ids, self.slots, self.recent_ids, self.recent_slots)


class TableSpec(NamedTuple):
    num_embeddings: int
    dim: int
    dtype: torch.dtype
    init: str  # "eager" | "lazy"
    seed: int
    mode: str
    num_trainers: int
    optimizer: RowOptimizer
    merge_every: int = 4  # half_async
    merge_s: float = 0.1  # half_async
    padding_idx: int | None = None  # in [0, num_embeddings): created as zeros, never stepped
    admit_after: int = 1  # lazy: a row is stored once its id was counted in this many steps
    sketch_bytes: int = 0  # the admission sketch's size per server (admit_after > 1)
    evict_after: int | None = None  # a row not stepped for this many of the table's steps is dropped


#: an eviction clock meaning "an eager row at its first value": never stale (see RowBlock.stale)
AT_INIT = -1


class Clocks:
    """A table's counters on one server, shared by its blocks: ``step`` (the table's steps
    here: what eviction counts) and ``version`` (bumped by every change: what a delta
    checkpoint compares against)."""

    def __init__(self) -> None:
        self.step = 0
        self.version = 0

    def bump(self) -> int:
        self.version += 1
        return self.version


def row_init(spec: TableSpec, name: str, ids: torch.Tensor) -> torch.Tensor:
    """The first values of rows ``ids`` of table ``name`` (:func:`initial_rows`)."""
    return initial_rows(row_key(spec.seed, name), ids, spec.dim, spec.dtype, spec.padding_idx)


class RowBlock:
    """Rows ``[first, first + count)`` of a table, held eagerly or lazily, with optimizer state
    for the rows ever stepped."""

    def __init__(self, spec: TableSpec, first: int, count: int, key: int, clocks: Clocks | None = None) -> None:
        """``key``: the table's :func:`row_key`, which (with the row id) gives each row's first
        value; ``clocks``: the table's (:class:`Clocks`)."""
        self.spec, self.first, self.count, self.key = spec, first, count, key
        self.clocks = Clocks() if clocks is None else clocks
        self.lock = threading.Lock()
        self.created = 0  # rows created (admitted) so far, a stale row's re-creation included
        self.evicted = 0  # rows dropped so far by eviction
        if spec.init == "eager":
            self.values = self.initial(torch.arange(first, first + count))
            self.slot_of: SlotIndex | None = None
        else:
            self.values = torch.empty(0, spec.dim, dtype=spec.dtype)
            self.slot_of = SlotIndex()
        self.used = count if spec.init == "eager" else 0  # slots holding a row (lazy: capacity grows ahead)
        self.touched = torch.zeros(count if spec.init == "eager" else 0, dtype=torch.bool)
        # optimizer state, for the rows ever stepped only (eager tables too): each storage slot's
        # state slot (-1: none yet), made at the first row given state (an optimizer without
        # state, plain SGD, never makes it: 8 bytes a row), and the state rows, grown by doubling
        self._state_slot: torch.Tensor | None = None
        self.state_used = 0
        self.state: dict[str, torch.Tensor] = {}
        # slots and state slots freed by eviction or a load (lazy), which new rows take first
        self.free = torch.empty(0, dtype=torch.long)
        self.state_free = torch.empty(0, dtype=torch.long)
        size = count if spec.init == "eager" else 0
        # each slot's version when it last changed (delta checkpoints, incremental saves, kept
        # snapshots), made by the first reader of what changed (track_changes: 4 bytes a row a
        # table that never gives a delta does not spend; int32, relative to _changed_base, which
        # moves up when a version no longer fits), and with eviction the table's step when it
        # was last stepped (AT_INIT: an eager row at its first value, which eviction leaves
        # alone: nothing to drop, and it must not be counted or tombstoned again every
        # evict_after steps)
        self._changed: torch.Tensor | None = None
        self._changed_base = 0
        self.last = None if spec.evict_after is None else torch.full((size,), AT_INIT, dtype=torch.long)

    @property
    def state_slot(self) -> torch.Tensor:
        """Each storage slot's state slot, -1 where it has no optimizer state (to read)."""
        if self._state_slot is None:
            return torch.full((self.values.shape[0],), -1, dtype=torch.long)
        return self._state_slot

    def state_slot_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The state slots of storage ``slots`` (-1: none)."""
        if self._state_slot is None:
            return torch.full(slots.shape, -1, dtype=torch.long)
        return self._state_slot.index_select(0, slots)

    def track_changes(self) -> None:
        """From now on keep each row's version of its last change (:meth:`changed_after`); a
        block that did not keep them counts every row changed at the table's version now (the
        newest a reader can have been told of: rows it had are then read again, none is missed)."""
        if self._changed is None:
            self._changed_base = self.clocks.version
            self._changed = torch.zeros(self.values.shape[0], dtype=torch.int32)

    def _stamp(self, version: int) -> int:
        """``version`` as :attr:`_changed` holds it (relative to its base, moved up first where
        it would not fit: the stamps before the new base become it, so those rows count as
        changed at it, never as unchanged after a version they are not)."""
        if version - self._changed_base > _STAMP_MAX:
            shift = version - self._changed_base - _STAMP_MAX // 2
            self._changed.sub_(min(shift, _STAMP_MAX)).clamp_(min=0)
            self._changed_base += shift
        return version - self._changed_base

    def mark_changed(self, slots: torch.Tensor, version: int) -> None:
        """Rows at storage ``slots`` changed at ``version`` (nothing kept before
        :meth:`track_changes`)."""
        if self._changed is not None:
            self._changed.index_fill_(0, slots, self._stamp(version))

    def changed_after(self, slots: torch.Tensor | slice, since: int) -> torch.Tensor:
        """Which of storage ``slots`` (indices, or a slice: a run of slots read without an index)
        changed after version ``since`` (all of them where changes are not tracked:
        :meth:`track_changes`)."""
        if self._changed is None:
            n = slots.numel() if isinstance(slots, torch.Tensor) else len(range(*slots.indices(self.values.shape[0])))
            return torch.ones(n, dtype=torch.bool)
        picked = self._changed[slots] if isinstance(slots, slice) else self._changed.index_select(0, slots)
        return picked > max(since - self._changed_base, -1)

    @property
    def changed(self) -> torch.Tensor | None:
        """Each slot's version of its last change, None while not tracked (to read)."""
        return self._changed

    def stale(self, slots: torch.Tensor) -> torch.Tensor:
        """Which of ``slots`` (stored, ``-1`` for none) hold a row evicted by now: not stepped
        in ``evict_after`` of the table's steps (swept later, read and stepped as absent now)."""
        if self.last is None:
            return torch.zeros(slots.shape, dtype=torch.bool)
        out = slots >= 0
        if bool(out.any()):
            last = self.last.index_select(0, slots[out])
            out[out.clone()] = (last != AT_INIT) & (last <= self.clocks.step - self.spec.evict_after)
            pad = self.spec.padding_idx  # never stepped, so never evicted: it keeps what a load set
            if pad is not None and self.first <= pad < self.first + self.count and bool(out.any()):
                pad_slot = pad - self.first if self.slot_of is None else int(self.slot_of.find(torch.tensor([pad]))[0])
                out &= slots != pad_slot
        return out

    def _renew(self, ids: torch.Tensor, slots: torch.Tensor, swept: bool = False) -> None:
        """Rows ``ids`` at ``slots`` (unique) start again: their first values, no optimizer state
        (``swept``: an eager block's rows dropped by a sweep, left at their first values; else
        rows about to be stepped or set)."""
        self.values[slots] = self.initial(ids)
        self._free_state(slots)
        self.touched[slots] = False
        self.mark_changed(slots, self.clocks.version)
        if self.last is not None:  # (an eager row back at its first value: nothing to evict until it changes)
            self.last[slots] = AT_INIT if swept else self.clocks.step

    def _free_state(self, slots: torch.Tensor) -> None:
        """Storage ``slots`` keep no optimizer state: their state rows are free for others."""
        if self._state_slot is None:
            return
        held = self._state_slot.index_select(0, slots)
        held = held[held >= 0]
        if held.numel():
            self.state_free = torch.cat([self.state_free, held])
        self._state_slot[slots] = -1

    def free_state(self, slots: torch.Tensor) -> None:
        """Storage ``slots`` keep no optimizer state (a delta that gives them none; lock held)."""
        self._free_state(slots)

    def forget_state(self, version: int) -> None:
        """No row keeps optimizer state or counts as stepped any more, every row changed at
        ``version`` (an optimizer state load replaces the whole state; lock held)."""
        self.touched.zero_()
        if self._state_slot is not None:
            self._state_slot.fill_(-1)
        self.state_used = 0
        self.state_free = torch.empty(0, dtype=torch.long)
        if self._changed is not None:
            self._changed[:self.used] = self._stamp(version)

    def held(self) -> int:
        """Rows stored (a lazy block's slots in use, less the free ones)."""
        return self.used - self.free.numel()

    def initial(self, ids: torch.Tensor) -> torch.Tensor:
        """The first values of rows ``ids`` (:func:`initial_rows`)."""
        return initial_rows(self.key, ids, self.spec.dim, self.spec.dtype, self.spec.padding_idx)

    def eager_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """An eager block's storage slots of global row ``ids`` (all inside it): ``ids - first``,
        or ``ids`` themselves for a block from row 0 (no copy: callers only read slots)."""
        return ids - self.first if self.first else ids

    def slots(self, ids: torch.Tensor, create: bool) -> torch.Tensor:
        """Storage slots of global row ``ids`` (all inside this block); lazy rows are created
        when ``create`` (else a row never touched reads as its initial value, not stored)."""
        ids = ids.long()
        found = self.eager_slots(ids) if self.slot_of is None else self.slot_of.find(ids)
        if self.last is not None:  # evicted rows not swept yet: absent, or created again
            stale = self.stale(found)
            if bool(stale.any()):
                if not create:
                    return torch.where(stale, -1, found)
                again, inverse = torch.unique(found[stale], return_inverse=True)
                # (an eager row as a sweep leaves it, AT_INIT: what the caller sets next, a step or
                # loaded state, must not depend on whether a sweep ran first)
                self._renew(torch.empty_like(again).scatter_(0, inverse, ids[stale]), again,
                            swept=self.slot_of is None)
                self.created += again.numel()
                self.evicted += again.numel()
        if self.slot_of is None:
            return found
        if create:
            absent = found < 0
            if bool(absent.any()):
                missing = torch.unique(ids[absent])  # sorted
                reused, self.free = self.free[:missing.numel()], self.free[missing.numel():]
                start, need = self.used, self.used + missing.numel() - reused.numel()
                if need > self.values.shape[0]:  # grow by doubling: appending rows stays cheap on average
                    capacity = max(need, 2 * self.values.shape[0], 64)
                    self.values = _grown(self.values, capacity)
                    self.touched = _grown(self.touched, capacity)
                    if self._state_slot is not None:
                        self._state_slot = _grown(self._state_slot, capacity, -1)
                    if self._changed is not None:
                        self._changed = _grown(self._changed, capacity)
                    if self.last is not None:
                        self.last = _grown(self.last, capacity)
                new_slots = torch.cat([reused, torch.arange(start, need)])
                self.values[new_slots] = self.initial(missing)
                self.mark_changed(new_slots, self.clocks.version)
                if self.last is not None:
                    self.last[new_slots] = self.clocks.step
                self.used = need
                self.created += missing.numel()
                self.slot_of.add(missing, new_slots)
                found[absent] = new_slots[torch.searchsorted(missing, ids[absent])]
        return found

    def sweep(self, force: bool = True) -> torch.Tensor:
        """Drop the evicted rows (lock held): a lazy block frees their storage and optimizer
        state, an eager one sets them to their first values; the ids dropped. Not ``force``:
        only when they are at least an eighth of the rows stored."""
        no_ids = torch.empty(0, dtype=torch.long)
        if self.last is None:
            return no_ids
        # (one pass over the clocks: every slot in use, a lazy block's free ones never stale)
        dead = self.stale(torch.arange(self.used))
        stale = int(dead.sum())
        if not stale or (not force and stale < max(1, self.held() // 8)):
            return no_ids
        self.evicted += stale
        if self.slot_of is not None:  # (no pass over the rows' values: their slots are freed)
            return self._free_slots(dead)
        slots = dead.nonzero().reshape(-1)
        self._renew(slots + self.first, slots, swept=True)
        return slots + self.first

    def drop(self, ids: torch.Tensor, slots: torch.Tensor, gone: torch.Tensor) -> torch.Tensor:
        """Drop the rows ``ids[gone]`` (``ids``, ``slots``: :meth:`stored`'s; lock held): a lazy
        block frees their storage and optimizer state, an eager one sets them to their first
        values; the ids dropped."""
        if self.slot_of is None:
            self._renew(ids[gone], slots[gone], swept=True)
            return ids[gone]
        dead = torch.zeros(self.used, dtype=torch.bool)
        dead[slots[gone]] = True
        return self._free_slots(dead)

    def _free_slots(self, dead: torch.Tensor) -> torch.Tensor:
        """A lazy block drops the rows in the slots ``dead`` marks (a bool per used slot): their
        slots and state rows are free for new rows; the ids dropped."""
        gone_ids = self.slot_of.remove_slots(dead)
        freed = dead.nonzero().reshape(-1)
        self._free_state(freed)
        self.touched[freed] = False
        if self.last is not None:
            self.last[freed] = AT_INIT  # (free: nothing to evict there)
        self.free = torch.cat([self.free, freed])
        return gone_ids

    def stored(self, stepped_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, slots)`` of the rows stored here, sorted by id: every row of an eager block,
        the created rows of a lazy one; with ``stepped_only``, the rows ever stepped (lock held)."""
        if self.slot_of is None:
            slots = self.touched.nonzero().reshape(-1) if stepped_only else torch.arange(self.count)
            return slots + self.first, slots
        ids, slots = self.slot_of.pairs()
        if stepped_only:
            keep = self.touched.index_select(0, slots)
            ids, slots = ids[keep], slots[keep]
        return ids, slots

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (lazy rows never touched: their initial values, not stored)."""
        with self.lock:
            if self.slot_of is None and self.last is None:  # eager: every row is stored
                return self.values.index_select(0, self.eager_slots(ids))
            slots = self.slots(ids, create=False)
            out = torch.empty(ids.numel(), self.spec.dim, dtype=self.spec.dtype)
            known = slots >= 0
            out[known] = self.values[slots[known]]
            if not bool(known.all()):
                out[~known] = self.initial(ids[~known])
            return out

    def state_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The state slots of storage ``slots`` (unique), created with the optimizer's initial
        state where a row has none yet (lock held)."""
        if self._state_slot is None:
            self._state_slot = torch.full((self.values.shape[0],), -1, dtype=torch.long)
        found = self._state_slot.index_select(0, slots)
        new = (found < 0).nonzero().reshape(-1)
        if new.numel() and self.state_free.numel():  # state rows freed by eviction first
            k = min(new.numel(), self.state_free.numel())
            reused, self.state_free = self.state_free[:k], self.state_free[k:]
            fresh = new_state(self.spec.optimizer, k, self.spec.dim, self.spec.dtype)
            for key, v in fresh.items():
                self.state[key][reused] = v
            found[new[:k]] = reused
            self._state_slot.index_copy_(0, slots[new[:k]], reused)
            new = new[k:]
        if new.numel():
            start, need = self.state_used, self.state_used + new.numel()
            fresh = new_state(self.spec.optimizer, new.numel(), self.spec.dim, self.spec.dtype)
            if not self.state:
                self.state = {k: torch.zeros(max(need, 64), self.spec.dim, dtype=self.spec.dtype) for k in fresh}
            elif need > next(iter(self.state.values())).shape[0]:
                capacity = max(need, 2 * next(iter(self.state.values())).shape[0])
                self.state = {k: _grown(v, capacity) for k, v in self.state.items()}
            for k, v in fresh.items():
                self.state[k][start:need] = v
            found[new] = torch.arange(start, need)
            self._state_slot.index_copy_(0, slots[new], found[new])
            self.state_used = need
        return found

    def step(self, ids: torch.Tensor, grad: torch.Tensor, step: int, scale: float = 1.0,
             opt: RowOptimizer | None = None) -> None:
        """One row-wise optimizer step on coalesced ``ids`` / ``grad`` (``grad * scale``), with
        the table's optimizer or ``opt`` (its settings as a trainer's ps_optimizer set them).
        SGD (stateless) adds the gradient rows, times the lr, in order with ``index_add_`` (as
        torch's sparse SGD adds an uncoalesced gradient, up to float32 rounding: it scales inside
        the add), so ``ids`` may repeat there: each position's gradient is added to its row as
        it comes."""
        opt = self.spec.optimizer if opt is None else opt
        if not ids.numel():
            return
        with self.lock:
            slots = self.slots(ids, create=True)
            before, where = {}, None
            if new_state(opt, 0, self.spec.dim, self.spec.dtype):  # an optimizer with state
                where = self.state_slots(slots)
                before = {k: v.index_select(0, where) for k, v in self.state.items()}
            g = grad * scale if scale != 1.0 else grad
            if opt.kind == "sgd":  # (index_add_ with an alpha takes a slow per-row path: scaled first)
                self.values.index_add_(0, slots, g * (opt.lr if opt.maximize else -opt.lr))
            else:
                new_values, after = step_rows(opt, self.values.index_select(0, slots), g, before, step)
                self.values.index_copy_(0, slots, new_values)
                for k, v in after.items():
                    self.state[k].index_copy_(0, where, v)
            self.touched.index_fill_(0, slots, True)
            self.mark_changed(slots, self.clocks.version)
            if self.last is not None:  # (the step being applied: the table counts it once all blocks stepped)
                self.last.index_fill_(0, slots, self.clocks.step + 1)

    def memory_bytes(self) -> int:
        """Bytes of the rows stored and of the optimizer state of the rows ever stepped (lazy
        rows and all state grow by doubling, so up to twice that, and at least 64 rows, may be
        allocated)."""
        row = self.values.shape[1] * self.values.element_size()
        return self.held() * row + (self.state_used - self.state_free.numel()) * row * len(self.state)

    def bookkeeping_bytes(self) -> int:
        """Bytes per row stored besides its values and state: whether it was stepped; its state
        slot, once a row has state; its version, once changes are tracked; its eviction clock; a
        lazy block's id-to-slot index."""
        per_slot = (1 + (8 if self._state_slot is not None else 0) + (4 if self._changed is not None else 0)
                    + (8 if self.last is not None else 0) + (16 if self.slot_of is not None else 0))
        return self.held() * per_slot
