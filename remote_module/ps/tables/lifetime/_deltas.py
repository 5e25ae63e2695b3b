"""Delta checkpoints, a part a table server composes: what changed in a table's blocks on one
server since a caller's last delta. Row storage (``tables.server._rows``) stamps every row with
the version of its last change; :class:`Tombstones` keeps the ids dropped since (evicted, or
by a load) and each caller's baseline, and :func:`changed_rows` reads the rows changed since a
version out of the blocks."""

from __future__ import annotations

from typing import Sequence

import torch

from remote_module.ps.tables.server._rows import RowBlock


class Tombstones:
    """The ids a table's server dropped, by the version they were dropped at, for deltas; each
    caller's baseline by ``(token, trainer)`` (the version its last delta reached), and the
    version before which none are kept (a caller whose baseline is older gets a whole table)."""

    #: tombstones kept per table per server at most (ids); callers whose baseline is older get a
    #: whole table instead of a delta
    KEPT = 1 << 22

    def __init__(self) -> None:
        self.baselines: dict[tuple[str, str | None], int] = {}
        self.dropped: list[tuple[int, torch.Tensor]] = []
        self.kept_from = 0

    def add(self, version: int, ids: torch.Tensor) -> None:
        """``ids`` were dropped at ``version`` (the table's newest)."""
        self.dropped.append((version, ids))
        self.trim(version)

    def trim(self, version: int) -> None:
        """Drop the tombstones no caller needs (older than every baseline; ``version``: the
        table's newest, the baseline when there is none), and the oldest beyond :attr:`KEPT`."""
        oldest = min(self.baselines.values(), default=version)
        while self.dropped and (self.dropped[0][0] <= oldest or
                                sum(t.numel() for _, t in self.dropped) > self.KEPT):
            self.kept_from = self.dropped.pop(0)[0]

    def since(self, key: tuple[str, str | None]) -> int | None:
        """The version the caller ``key``'s next delta follows: its baseline, or None when it
        needs the whole table (its first delta, or its baseline older than the tombstones)."""
        base = self.baselines.get(key)
        return None if base is None or base < self.kept_from else base

    def dropped_since(self, version: int) -> torch.Tensor:
        """The ids dropped after ``version``."""
        tombs = [t for v, t in self.dropped if v > version]
        return torch.cat(tombs) if tombs else torch.empty(0, dtype=torch.long)

    def taken(self, key: tuple[str, str | None], version: int) -> None:
        """The caller ``key`` took a delta reaching ``version``: its next one follows it."""
        self.baselines[key] = version
        self.trim(version)


def changed_rows(blocks: Sequence[RowBlock], since: int, clocks: bool) -> dict:
    """The rows of ``blocks`` changed after version ``since`` (-1: every row stored), each
    block's lock taken: their ``ids``, ``rows``, whether each was ever ``stepped``, which
    ``has_state`` and that ``state``, and with ``clocks`` (eviction) their clocks, ``last``."""
    parts = []
    for rows in blocks:
        with rows.lock:
            rows.track_changes()  # (the next delta reads what changed after this one)
            ids, slots = rows.stored()
            if since >= 0:
                keep = rows.changed_after(slots, since)
                ids, slots = ids[keep], slots[keep]
            where = rows.state_slot_of(slots)
            has = where >= 0
            parts.append((ids, rows.values.index_select(0, slots), rows.touched.index_select(0, slots),
                          {k: v.index_select(0, where[has]) for k, v in rows.state.items()}, has,
                          None if rows.last is None else rows.last.index_select(0, slots)))
    return {
        "ids": torch.cat([p[0] for p in parts]), "rows": torch.cat([p[1] for p in parts]),
        "stepped": torch.cat([p[2] for p in parts]), "has_state": torch.cat([p[4] for p in parts]),
        "state": {k: torch.cat([p[3][k] for p in parts if k in p[3]]) for k in
                  dict.fromkeys(k for p in parts for k in p[3])},
        "last": torch.cat([p[5] for p in parts]) if clocks else None,
    }
