"""The RPC handlers a sharded table's checkpoints use on its servers: a block's rows read out
and rows written (weights loads, with their clocks), the admission sketch read and loaded,
deltas taken and applied (what changed since a caller's last delta: ``tables.lifetime._deltas``)
and the optimizer state read and replaced. A table's state is ``_table.Table``."""

from __future__ import annotations

import torch

from remote_module.ps._shard_io import snapshots
from remote_module.ps.tables.lifetime._deltas import changed_rows
from remote_module.ps.tables.server._handlers import _table
from remote_module.ps.tables.server._rows import AT_INIT, RowBlock
from remote_module.ps.tables.server._table import Table


def _block_rows(name: str, first: int, clocks: bool = False, version: bool = False, eager_ids: bool = True,
                keep_s: float | None = None) -> tuple:
    """``(ids, rows)`` the block starting at row ``first`` stores: every row of an eager block,
    the touched rows of a lazy one (sorted by id; evicted rows swept first); with ``clocks``
    also each row's eviction clock (its step when last stepped, or None without eviction) and
    the table's step here; with ``version`` last the table's version here (what a delta taken
    now would reach: a checkpoint's place in the delta chains). Without ``eager_ids``, an eager
    block's ids are None (they are its rows in order: a snapshot need not spend 8 bytes a row);
    ``keep_s``: a save's snapshot: an eager block's rows are copied into snapshot memory kept
    that long (``_shard_io.SnapshotMemory``); None (a ``state_dict()``'s read, sent at once):
    into fresh memory, the memory a job keeps for its next save left alone."""
    table = _table(name)
    with table.lock:
        table.sweep()
        rows = table.block(first)
        with rows.lock:
            if keep_s is not None:  # a save: an incremental save, or the next snapshot, reads what changed since
                rows.track_changes()
            if rows.slot_of is None:  # an eager block stores every row, in order: one copy is a plain memcpy
                slots = None
                ids = torch.arange(rows.first, rows.first + rows.count) if eager_ids else None

                def changed_since(stamp: tuple) -> torch.Tensor | None:
                    """The rows changed since a kept snapshot of them (``snapshot_stamp``)."""
                    if stamp[0] != table.incarnation:
                        return None
                    return rows.changed_after(slice(0, rows.count), stamp[1]).nonzero().reshape(-1)

                values = (rows.values[:rows.count].clone() if keep_s is None else
                          snapshots.copy(snapshot_key(name, rows.first), rows.values[:rows.count], keep_s,
                                         changed_since))
            else:
                ids, slots = rows.stored()
                values = rows.values.index_select(0, slots)
            out = (ids, values)
            if clocks:
                last = (None if rows.last is None else
                        rows.last[:rows.count].clone() if slots is None else rows.last.index_select(0, slots))
                out += (last, table.clocks.step)
            if version:
                out += (table.clocks.version,)
            return out


def snapshot_stamp(incarnation: str, version: int) -> tuple:
    """What a kept snapshot of an eager block holds: its rows as of ``version`` of the table's
    life ``incarnation`` here (a later snapshot into it copies only the rows changed since:
    every change of a row stamps it with a later version)."""
    return (incarnation, version)


def snapshot_key(name: str, first: int) -> tuple:
    """The key under which snapshots of the rows of table ``name``'s block at ``first`` are
    kept (``_shard_io.snapshots``)."""
    return ("table rows", name, first)


def aged(last: torch.Tensor, lag: int) -> torch.Tensor:
    """A server's eviction clocks ``last`` moved by its ``lag`` behind the table's highest
    step (an eager row at its first value, ``AT_INIT``, stays so)."""
    return torch.where(last == AT_INIT, last, last + lag)


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
            table.set_clock(int(clock))


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
            with_state = rows.state_slot_of(slots) >= 0
            keep = out & with_state
            if bool(keep.any()):
                again = slots[keep]
                rows.values[again] = rows.initial(held[keep])
                rows.mark_changed(again, version)
                if rows.last is not None:
                    rows.last[again] = step
                kept.append(held[keep])
            if bool((out & ~with_state).any()):
                gone_ids.append(rows.drop(held, slots, out & ~with_state))
    if gone_ids:
        table.dropped(torch.cat(gone_ids))
    table.kept_for_state = torch.cat(kept) if kept else torch.empty(0, dtype=torch.long)


def _write_rows(rows: RowBlock, ids: torch.Tensor, values: torch.Tensor, version: int, step: int,
                last: torch.Tensor | None) -> torch.Tensor:
    """Set loaded rows ``ids`` of block ``rows`` (lazy ones created) to ``values``, changed at
    ``version``; with eviction their clocks ``last`` as loaded (a lazy block's rows are never at
    their first value, ``AT_INIT``: they start at ``step``), or ``step`` without them (lock
    held); their slots."""
    slots = rows.slots(ids, create=True)
    rows.values[slots] = values.to(rows.values.dtype)
    rows.mark_changed(slots, version)
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
        table.dropped(torch.cat(gone_ids))


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
        base = table.tombstones.since((token, trainer))
        whole = base is None
        since = -1 if whole else base
        sketch = None
        if table.sketch is not None:
            sketch = (table.sketch.data.clone(), None) if whole else tuple(reversed(table.sketch.changed_since(since)))
        out = {
            "whole": table.layout() if whole else [],
            **changed_rows(table.blocks, since, clocks=table.spec.evict_after is not None),
            "evicted": torch.empty(0, dtype=torch.long) if whole else table.tombstones.dropped_since(since),
            "step": table.optimizer_steps, "clock": table.clocks.step,
            "sketch": None if sketch is None else (table.layout(),) + sketch,
            "versions": (since, table.clocks.version),  # (what it follows, what it reaches)
        }
        table.tombstones.taken((token, trainer), table.clocks.version)
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
        table.set_clock(int(clock))
        if table.kept_for_state.numel():  # (set by the delta now, or dropped: what it says)
            kept = table.kept_for_state
            table.kept_for_state = kept[~(torch.isin(kept, ids) | _in_ranges(kept, whole))]
        state_at = torch.cumsum(has_state.long(), 0) - 1  # each id's row in state
        for rows, mine in table._split(ids):
            with rows.lock:
                slots = _write_rows(rows, ids[mine], rows_[mine], version, table.clocks.step,
                                    None if last is None else last[mine])
                rows.touched[slots] = stepped[mine]
                rows.free_state(slots)  # (rows without state in the delta have none; theirs is free)
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
        where = rows.state_slot_of(slots)
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
                rows.forget_state(version)
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
