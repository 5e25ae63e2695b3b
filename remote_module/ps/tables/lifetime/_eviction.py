"""Eviction, a part a table server composes: a row not stepped in ``evict_after`` of the
table's steps is evicted (it reads and steps as absent from then on: its first value again,
no optimizer state), and dropped from storage at the next sweep, which runs every
``evict_after / 4`` steps. Row storage (``tables.server._rows``) keeps each row's clock and
does the sweep of one block; this part says when, and keeps the pauses' record."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from remote_module.ps.tables.server._rows import RowBlock


class Eviction:
    """When a table's blocks on one server are swept (``after``: ``evict_after``, None: never),
    the table's step of the last sweep and the longest sweep so far (seconds)."""

    def __init__(self, after: int | None) -> None:
        self.after = after
        self.swept_at = 0
        self.longest_sweep_s = 0.0

    def due(self, step: int) -> bool:
        """Whether a sweep is due at the table's ``step`` (every ``after / 4`` steps)."""
        return self.after is not None and step - self.swept_at >= max(1, self.after // 4)

    def restart(self, step: int) -> None:
        """The table's clock was set to ``step`` (a load): the next sweep counts from there."""
        self.swept_at = step

    def sweep(self, blocks: Sequence[RowBlock], step: int, force: bool = True) -> torch.Tensor:
        """Drop the evicted rows of ``blocks`` now, at the table's ``step`` (the table's lock
        held; each block's taken here); the ids dropped. Not ``force``: only in blocks where they
        are at least an eighth of the rows (compacting costs a pass over all the rows)."""
        began = time.perf_counter()
        self.swept_at = step
        gone = []
        for rows in blocks:
            with rows.lock:
                gone.append(rows.sweep(force))
        self.longest_sweep_s = max(self.longest_sweep_s, time.perf_counter() - began)
        return torch.cat(gone)
