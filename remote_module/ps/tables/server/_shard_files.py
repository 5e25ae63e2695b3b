"""A table server writes and reads its own shards of a checkpoint (``remote_module.ps.save_shards``
and ``load_shards``): no row passes through the trainer, and no server waits for another.

What a server writes for its blocks of a table is what the trainer-side checkpoint
(``tables._checkpoints``) holds for them, read with the same handlers
(``_checkpoint_handlers``), called here in-process:

- ``<stem>.distcp`` (an eager table): each block's rows as one ``torch.save`` of a tensor,
  one after another: the file format of ``torch.distributed.checkpoint`` (the trainer writes
  its ``.metadata``, which says where each block is);
- ``<stem>.pt``: by id, ``torch.save`` of a dict: the ids of the rows stored (None for an eager
  table, which stores every row of its ``blocks``; with ``rows`` for a lazy one), their eviction
  clocks (``last``, or None) and this server's step (``clock``), the optimizer step count and
  the optimizer state of the rows stepped (``state_ids``, ``state``);
- ``<stem>.sketch.pt``: the admission sketch (with admission), ``(blocks, counters)``.

A save is a snapshot and a write: :func:`_snapshot` copies the server's blocks under the
table's locks (a memcpy for an eager block), :func:`_write_snapshot` writes the copy, hashing it
as it goes (``torch.save`` writes straight into the file: no second copy in memory). A
background save (:func:`_begin_shards`) returns after the snapshot and writes on this server's
one writer thread (``_shard_io.writes``) while the table trains on; :func:`_shards_written`
answers with the outcome.

A load is two calls: :func:`_stage_chain` reads the files the trainer names (checking each
one's size and checksum, as the manifest records them) and keeps the rows in this server's
ranges, changing nothing; once every server staged, :func:`_apply_staged` loads them with the
handlers a trainer-side load uses (``_set_rows``, ``_set_admission``, ``_set_row_state``), in
the same order. A corrupt file on any server so leaves every table as it was.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.distributed.rpc as rpc

from remote_module.ps._shard_io import FileEntry, snapshots, writes
from remote_module.ps._shard_io import load_file as _load
from remote_module.ps._shard_io import verify as _verify
from remote_module.ps._shard_io import write_file as _write_file
from remote_module.ps._shard_io import write_saved as _write_saved
from remote_module.ps.tables.server import _checkpoint_handlers as handlers
from remote_module.ps.tables.server._handlers import _table


class ShardReads(NamedTuple):
    """What one server reads for one table at a load: the by-id files of the saving servers
    whose blocks overlap its own (``rows``: each with that server's step, ``clock``), the
    eager blocks among them (``chunks``: ``(file, first row, rows, offset, length)``), and
    every saving server's admission sketch (``sketches``). ``files``: each file read, once."""

    files: list[FileEntry]
    rows: list[tuple[str, int]]
    chunks: list[tuple[str, int, int, int, int]]
    sketches: list[str]


class Written(NamedTuple):
    """What a server wrote of a table (:func:`_write_shards`), as the manifest lists it: its
    ``files`` (``{rel: (size, checksum)}``), an eager table's ``chunks`` (``(first row, rows,
    offset, length)`` in its ``.distcp`` file), the ``blocks`` it holds, the table's step here
    (``clock``) and its optimizer step count, the optimizer state's keys and rows, and the
    table's ``versions`` while read (its place in the delta chains: ``(first, last)``)."""

    files: dict[str, tuple[int, str]]
    chunks: list[tuple[int, int, int, int]]
    blocks: list[tuple[int, int]]
    clock: int
    optimizer_steps: int
    state_keys: list[str]
    state_rows: int
    versions: tuple[int, int]
    #: the table's life on this server (``Table.incarnation``): an incremental save follows it only
    incarnation: str = ""
    #: an incremental save's: the version its base reached here (it holds what changed after it);
    #: None: these blocks whole
    since: int | None = None


class Staged(NamedTuple):
    """A table's rows, state and sketches read for a load, kept until it is applied."""

    key: str
    ids: torch.Tensor
    rows: torch.Tensor
    last: torch.Tensor | None
    state_ids: torch.Tensor
    state: dict[str, torch.Tensor]
    sketches: list[tuple[list[tuple[int, int]], torch.Tensor, None]]


#: the staged loads here, by (table, load): two trainers may load one table at once
_staged: dict[tuple[str, str], Staged] = {}
#: when each staged load is forgotten unless applied or dropped (``time.monotonic()``; None: never)
_expires: dict[tuple[str, str], float | None] = {}
_staged_lock = threading.Lock()
#: a staged load is kept this many times its trainer's timeout: one whose trainer gave up (a
#: server timed out, the trainer died) is forgotten at a later stage on this server
KEEP_STAGED_TIMEOUTS = 3


class Snapshot(NamedTuple):
    """Copies of what a server holds of a table at one moment (:func:`_snapshot`), to be
    written afterwards while the table trains on (:func:`_write_snapshot`)."""

    name: str
    blocks: list[tuple[int, int]]
    read: list[tuple]
    state: list[tuple]
    admission: tuple | None
    eager: bool
    evicting: bool
    dim: int
    dtype: torch.dtype
    incarnation: str = ""
    #: an incremental snapshot's base version here (``read`` holds the rows changed after it, by id;
    #: ``dropped`` the ids dropped since); None: every row of the blocks
    since: int | None = None
    dropped: torch.Tensor | None = None


def _snapshot(name: str, evicting: bool, keep_s: float = 0.0) -> Snapshot:
    """Copy this server's blocks of table ``name`` (rows, clocks, optimizer state, sketch):
    what :func:`_write_snapshot` writes (``evicting``: with each row's eviction clock;
    ``keep_s``: eager rows into snapshot memory kept that long, ``_shard_io.SnapshotMemory``)."""
    table = _table(name)
    blocks = table.layout()
    read = [handlers._block_rows(name, first, True, True, eager_ids=False, keep_s=keep_s) for first, _ in blocks]
    state = [handlers._row_state(name, first) for first, _ in blocks]
    return Snapshot(name, blocks, read, state, handlers._admission_state(name), table.spec.init != "lazy", evicting,
                    table.spec.dim, table.spec.dtype, table.incarnation)


def chain_key(token: str) -> tuple[str, None]:
    """The key under which a table's tombstones keep the baseline of the incremental saves of
    ``token`` (``Tombstones``; apart from ``delta_state_dict``'s ``(token, trainer)`` keys)."""
    return (f"save_shards {token}", None)


def _delta_snapshot(name: str, evicting: bool, since: int, incarnation: str,
                    blocks: list[tuple[int, int]]) -> Snapshot | None:
    """Copy what changed in this server's blocks of table ``name`` after version ``since`` of
    its life ``incarnation`` holding ``blocks`` (an incremental save's base here): the rows
    changed, by id (their clocks with ``evicting``), the optimizer state of those stepped, the
    ids dropped since and the whole admission sketch, under the table's lock (one consistent
    point). None when what changed is not known here (the table was made again, by a restart;
    its blocks moved; the ids dropped since were not all kept, ``Tombstones.KEPT``), or when an
    eager table's changed rows with their ids are no smaller than its blocks whole: the caller
    saves these blocks whole instead."""
    table = _table(name)
    with table.lock:
        table.sweep()
        layout = table.layout()
        if (incarnation != table.incarnation or [tuple(b) for b in blocks] != [tuple(b) for b in layout]
                or not table.tombstones.kept_from <= since <= table.clocks.version):
            return None
        read, state = [], []
        for rows in table.blocks:
            with rows.lock:
                ids, slots = rows.stored()
                keep = rows.changed_after(slots, since)
                ids, slots = ids[keep], slots[keep]
                last = rows.last.index_select(0, slots) if evicting and rows.last is not None else None
                read.append((ids, rows.values.index_select(0, slots), last, table.clocks.step, table.clocks.version))
                stepped = rows.touched.index_select(0, slots)  # (what _row_state reads, of these rows)
                where = rows.state_slot_of(slots[stepped])
                state.append((table.optimizer_steps, ids[stepped],
                              {k: v.index_select(0, where) for k, v in rows.state.items()}))
        if table.spec.init != "lazy":  # (an eager block whole has no ids: smaller once most rows changed)
            row = table.spec.dim * table.blocks[0].values.element_size()
            if sum(r[0].numel() for r in read) * (row + 8) >= sum(count for _, count in layout) * row:
                return None
        admission = None if table.sketch is None else (layout, table.sketch.data.clone())
        return Snapshot(name, layout, read, state, admission, table.spec.init != "lazy", evicting, table.spec.dim,
                        table.spec.dtype, table.incarnation, since, table.tombstones.dropped_since(since))


def _chain_from(name: str, token: str, snap: Snapshot) -> None:
    """The incremental saves of ``token`` may follow ``snap`` from now on: the table's
    tombstones keep the ids dropped after the version it was read from (its first)."""
    table = _table(name)
    with table.lock:
        table.tombstones.taken(chain_key(token), min(r[-1] for r in snap.read))


def _write_snapshot(snap: Snapshot, directory: str, stem: str) -> Written:
    """Write a table's :class:`Snapshot` under ``directory`` (files ``stem.*``, ``stem``
    relative to it): what the manifest lists."""
    read, state = snap.read, snap.state
    whole_eager = snap.eager and snap.since is None  # (every row of the blocks, in order: no ids)
    ids = None if whole_eager else torch.cat([r[0] for r in read])
    clock = max(r[3] for r in read)  # (the table's step here: a block read before a step was a step behind)
    keys = list(dict.fromkeys(k for _, _, s in state for k in s))
    empty = torch.empty(0, snap.dim, dtype=snap.dtype)
    by_id = {"table": snap.name, "blocks": snap.blocks, "ids": ids,
             "rows": None if whole_eager else torch.cat([r[1] for r in read]),
             "last": torch.cat([handlers.aged(r[2], clock - r[3]) for r in read])
             if snap.evicting and read[0][2] is not None else None, "clock": clock,
             "optimizer_steps": max(s[0] for s in state), "state_ids": torch.cat([s[1] for s in state]),
             "state": {k: torch.cat([s[2].get(k, empty) for s in state]) for k in keys},
             "delta": None if snap.since is None else {"since": snap.since, "dropped": snap.dropped}}
    out = Written({}, [], snap.blocks, clock, by_id["optimizer_steps"], keys, by_id["state_ids"].numel(),
                  (min(r[-1] for r in read), max(r[-1] for r in read)), snap.incarnation, snap.since)
    if whole_eager:  # each block's rows, as torch.distributed.checkpoint writes a tensor chunk
        written, spans = _write_saved(directory, f"{stem}.distcp", [r[1].contiguous() for r in read])
        out.files[f"{stem}.distcp"] = written
        out.chunks.extend((first, count, *span) for (first, count), span in zip(snap.blocks, spans))
    out.files[f"{stem}.pt"] = _write_file(directory, f"{stem}.pt", [by_id])
    if snap.admission is not None:
        out.files[f"{stem}.sketch.pt"] = _write_file(directory, f"{stem}.sketch.pt", [snap.admission])
    return out


def _write_shards(name: str, directory: str, stem: str, evicting: bool) -> Written:
    """Write this server's blocks of table ``name`` under ``directory`` (files ``stem.*``, ``stem``
    relative to it; ``evicting``: with each row's eviction clock): what the manifest lists."""
    return _write_snapshot(_snapshot(name, evicting), directory, stem)


# ---- saves in the background: a snapshot now, its files written while the table trains on --------

def _begin_shards(save: str, tables: list[tuple[str, str, str, bool]], keep_s: float = 0.0,
                  token: str | None = None, bases: dict | None = None) -> None:
    """Snapshot this server's blocks of each table now (``(name, directory, stem, evicting)``:
    what :func:`_write_shards` would write), one after another, then write them in the
    background (``_shard_io.writes``: one save after another); :func:`_shards_written` answers
    with each outcome. Returns once every snapshot is taken: the tables may change from then on
    without changing what is written. ``keep_s``: the snapshot's memory is kept that long for
    the next save's (``_shard_io.SnapshotMemory``). ``token``: the saves form a chain of that
    name (the tables keep the ids dropped since this one for the next); ``bases``: by table,
    ``(version, incarnation, blocks)`` of its base here: only what changed after it is written
    (:func:`_delta_snapshot`; these blocks whole where that is not known)."""
    again = [name for name, *_ in tables if writes.begun(("table", save, name))]
    if again:
        raise ValueError(f"table {again[0]!r}: save {save!r} was begun here already")
    bases = bases or {}
    snaps = []
    for name, directory, stem, evicting in tables:
        snap = _delta_snapshot(name, evicting, *bases[name]) if name in bases else None
        snap = _snapshot(name, evicting, keep_s) if snap is None else snap
        if token is not None:
            _chain_from(name, token, snap)
        snaps.append((snap, directory, stem))
    for snap, directory, stem in snaps:
        writes.begin(("table", save, snap.name), partial(_write_and_keep, snap, directory, stem, keep_s),
                     f"table {snap.name!r}: writing {os.path.join(directory, stem)}.*")


def _write_and_keep(snap: Snapshot, directory: str, stem: str, keep_s: float) -> Written:
    """:func:`_write_snapshot`, then its eager rows' memory kept for the next snapshot."""
    written = _write_snapshot(snap, directory, stem)
    if snap.eager and snap.since is None:
        for (first, _), read in zip(snap.blocks, snap.read):  # (read[-1]: the version it was read at)
            snapshots.keep(handlers.snapshot_key(snap.name, first), read[1], keep_s,
                           handlers.snapshot_stamp(snap.incarnation, read[-1]))
    return written


def _end_chain(names: list[str], token: str) -> None:
    """Tables ``names`` keep no more dropped ids for the incremental saves of ``token``: a save
    of that chain after this is written whole where ids were dropped since its base (they are
    not kept: ``_delta_snapshot``)."""
    for name in names:
        table = _table(name)
        with table.lock:
            if table.tombstones.baselines.pop(chain_key(token), None) is not None:
                # (the ids kept for it go; a later save on its old base finds them missing, kept_from)
                table.tombstones.trim(table.clocks.version)


def _forget_snapshots(names: list[str]) -> int:
    """Free the snapshot memory this server keeps for the next save of tables ``names`` (the
    job saves no more); its bytes."""
    return snapshots.forget(lambda key: key[0] == "table rows" and key[1] in names)


@rpc.functions.async_execution
def _shards_written(name: str, save: str) -> torch.futures.Future:
    """What the background save ``save`` of table ``name`` wrote (a ``Written``), once it has;
    its failure (``OSError``) if it failed; ``LookupError`` if no such save was begun here."""
    return writes.outcome(("table", save, name), f"table {name!r}, save {save!r}")


def _stage_chain(name: str, key: str, links: list[tuple[str, ShardReads]], clock: int,
                 timeout: float | None = None) -> str | None:
    """Read (and check) this server's share of a table's checkpoint for load ``key``: the rows
    in its own blocks, their clocks aged to the table's step ``clock``, their optimizer state
    and every saved sketch; kept until :func:`_apply_staged`. ``links``: the checkpoint, or a
    chain (a full one, then the incremental saves that follow it, in order), each one's
    directory and what this server reads there; the sketches are the last one's. Every file of
    every link is checked before any is read; nothing of the table changes. Why it cannot be
    loaded (a file missing, truncated or corrupt, named), or None. Staged loads older than
    :data:`KEEP_STAGED_TIMEOUTS` times their ``timeout`` (the trainer's) are forgotten first."""
    _forget_expired()
    table = _table(name)
    where = links[0][0]  # (the directory whose files are being read: named if one does not read)
    try:
        for where, reads in links:
            for entry in reads.files:
                _verify(where, entry)
        staged = _read_chain(table.layout(), links, clock, table.spec.dim)
        where, last_reads = links[-1]
        sketches = [(*_load(os.path.join(where, rel)), None) for rel in last_reads.sketches]
    except (ValueError, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:  # (one that does not read)
        if isinstance(exc, ValueError):
            return str(exc)
        return f"{exc.filename if isinstance(exc, OSError) and exc.filename else where}: a file does not read: {exc}"
    with _staged_lock:
        _staged[(name, key)] = staged._replace(key=key, sketches=sketches)
        _expires[(name, key)] = None if not timeout else time.monotonic() + KEEP_STAGED_TIMEOUTS * timeout
    return None


def _forget_expired() -> None:
    now = time.monotonic()
    with _staged_lock:
        for load in [load for load, at in _expires.items() if at is not None and at < now]:
            _staged.pop(load, None)
            del _expires[load]


def _read_chain(layout: list[tuple[int, int]], links: list[tuple[str, ShardReads]], clock: int, dim: int) -> Staged:
    """The rows of the blocks ``layout`` (this server's) in the checked files of ``links`` (one
    checkpoint, or a chain: a full one, then incremental saves in order), their clocks (aged to
    ``clock``) and optimizer state, sorted by id. Each saving server's part replaces what came
    before it of its rows: a whole part every row of its blocks, an incremental one the rows it
    holds and the ids dropped since its base."""
    mine = tuple(layout)
    have = _Rows()
    for directory, reads in links:
        chunks = {(rel, first): (offset, length) for rel, first, _, offset, length in reads.chunks}
        for rel, saved_clock in reads.rows:
            try:
                part = _load(os.path.join(directory, rel))
            except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
                path = os.path.join(directory, rel)
                raise ValueError(f"{path}: does not read ({type(exc).__name__}: {exc})") from exc
            saved = part["ids"] if part["ids"] is not None else _every_id(part["blocks"])  # (eager: every row)
            keep = handlers._in_ranges(saved, mine)
            delta = part.get("delta")
            if delta is None:  # these blocks whole: what came before of them goes
                have.drop(lambda ids: handlers._in_ranges(ids, tuple(tuple(b) for b in part["blocks"])))
            else:  # its rows and the ids dropped since its base go
                gone = torch.cat([delta["dropped"].long(), saved])
                have.drop(lambda ids: torch.isin(ids, gone))
            kept = handlers._in_ranges(part["state_ids"], mine)
            have.add(saved[keep], part["rows"][keep] if part["rows"] is not None
                     else _eager_rows(part["blocks"], mine, directory, rel, chunks, dim),
                     None if part["last"] is None else handlers.aged(part["last"][keep], clock - saved_clock),
                     part["state_ids"][kept], {k: v[kept] for k, v in part["state"].items()})
    return _sorted("", have.ids, have.rows, have.last if have.every_last else None, have.state_ids, have.state, dim)


class _Rows:
    """The rows (and clocks, optimizer state) a load has read so far, in parts: what
    :func:`_read_chain` builds, a later part replacing rows of earlier ones."""

    def __init__(self) -> None:
        self.ids: list[torch.Tensor] = []
        self.rows: list[torch.Tensor] = []
        self.last: list[torch.Tensor | None] = []
        self.state_ids: list[torch.Tensor] = []
        self.state: list[dict[str, torch.Tensor]] = []

    @property
    def every_last(self) -> bool:
        """Whether every part has its rows' clocks (else none is kept)."""
        return all(last is not None for last in self.last)

    def add(self, ids: torch.Tensor, rows: torch.Tensor, last: torch.Tensor | None, state_ids: torch.Tensor,
            state: dict[str, torch.Tensor]) -> None:
        self.ids.append(ids)
        self.rows.append(rows)
        self.last.append(last)
        self.state_ids.append(state_ids)
        self.state.append(state)

    def drop(self, which: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Forget the rows, and the optimizer state, of the ids ``which(ids)`` selects."""
        for i, ids in enumerate(self.ids):
            out = which(ids)
            if bool(out.any()):
                keep = ~out
                self.ids[i], self.rows[i] = ids[keep], self.rows[i][keep]
                if self.last[i] is not None:
                    self.last[i] = self.last[i][keep]
        for i, ids in enumerate(self.state_ids):
            out = which(ids)
            if bool(out.any()):
                keep = ~out
                self.state_ids[i] = ids[keep]
                self.state[i] = {k: v[keep] for k, v in self.state[i].items()}


def _every_id(blocks: list[tuple[int, int]]) -> torch.Tensor:
    """The ids of every row of ``blocks`` (``(first, count)``), in order: an eager server's rows."""
    return torch.cat([torch.arange(first, first + count) for first, count in blocks])


def _eager_rows(blocks: list, mine: tuple, directory: str, rel: str, chunks: dict, dim: int) -> torch.Tensor:
    """An eager server's rows in this server's ranges ``mine``, block by block in the order of
    its by-id file (``rel``); only the blocks that hold some are read from its ``.distcp``."""
    weights = f"{rel[:-len('.pt')]}.distcp"
    out = [torch.empty(0, dim)]
    for first, count in blocks:
        inside = handlers._in_ranges(torch.arange(first, first + count), mine)
        if bool(inside.any()):
            out.append(_load(os.path.join(directory, weights), chunks[(weights, first)])[inside])
    return torch.cat(out)


def _sorted(key: str, ids: list, rows: list, last: list | None, state_ids: list, state: list, dim: int) -> Staged:
    """The staged parts, concatenated and sorted by id (as a trainer-side load sends them)."""
    every = torch.cat(ids) if ids else torch.empty(0, dtype=torch.long)
    order = torch.argsort(every)
    got_state = torch.cat(state_ids) if state_ids else torch.empty(0, dtype=torch.long)
    state_order = torch.argsort(got_state)
    keys = list(dict.fromkeys(k for s in state for k in s))
    empty = torch.empty(0, dim)
    return Staged(key, every[order], torch.cat(rows)[order] if rows else torch.empty(0, dim),
                  None if not last else torch.cat(last)[order], got_state[state_order],
                  {k: torch.cat([s.get(k, empty) for s in state])[state_order] for k in keys}, [])


def _apply_staged(name: str, key: str, clock: int | None, optimizer_steps: int | None) -> None:
    """Load what :func:`_stage_chain` read for load ``key`` as a trainer-side load of the same
    checkpoint would (``_set_rows``, then the sketches, then the optimizer state unless
    ``optimizer_steps`` is None: geo tables keep theirs on the trainer). ``clock``: the
    table's step (with eviction), else None."""
    table = _table(name)
    with _staged_lock:
        staged = _staged.pop((name, key), None)
        _expires.pop((name, key), None)
    if staged is None:
        raise LookupError(f"table {name!r}: no checkpoint staged here for load {key!r} (forgotten: its trainer "
                          "took longer than its timeout allows)")
    lazy = table.spec.init == "lazy"
    last = staged.last if clock is not None else None
    handlers._set_rows(name, staged.ids, staged.rows, last, clock if last is not None else None,
                       tuple(table.layout()) if lazy else ())
    if table.sketch is not None:
        handlers._set_admission(name, staged.sketches)
    if optimizer_steps is not None:
        handlers._set_row_state(name, optimizer_steps, staged.state_ids, staged.state)


def _drop_staged(name: str, key: str) -> None:
    """Forget load ``key``'s staged rows of table ``name`` (another server refused its files)."""
    with _staged_lock:
        _staged.pop((name, key), None)
        _expires.pop((name, key), None)
