"""geo mode's trainer-side rows: the rows a trainer looked up since its last push, trained
locally with its own row-wise optimizer, as sorted tensors (no per-row Python)."""

from __future__ import annotations

import threading

import torch

from remote_module.ps._rowwise import RowOptimizer, new_state, step_rows


def _find(sorted_ids: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of ``ids``, its position in ``sorted_ids`` and whether it is there."""
    at = torch.searchsorted(sorted_ids, ids)
    found = at < sorted_ids.numel()
    found &= sorted_ids[at.clamp(max=max(sorted_ids.numel() - 1, 0))] == ids if sorted_ids.numel() else found
    return at, found


class GeoCache:
    """Cached rows (``ids`` sorted, their current values and the values they were fetched
    with) and each row's local optimizer state, which outlives its row: a push drops the rows
    (the next lookup fetches the merged ones) but a local sparse optimizer keeps its state.

    ``steps`` counts optimizer steps (steps with a gradient, as torch counts them); ``calls``
    counts the table's ``step()`` calls, which set when deltas are pushed."""

    def __init__(self, dim: int, optimizer: RowOptimizer, dtype: torch.dtype = torch.float32) -> None:
        self.dim, self.optimizer, self.dtype = dim, optimizer, dtype
        self.lock = threading.Lock()
        self.ids = torch.empty(0, dtype=torch.long)
        self.rows = torch.empty(0, dim, dtype=dtype)
        self.fetched = torch.empty(0, dim, dtype=dtype)
        self.state_ids = torch.empty(0, dtype=torch.long)
        self.state = new_state(optimizer, 0, dim, dtype)
        self.steps = 0
        self.calls = 0
        # the ids of a push of their deltas sent and not settled yet (its outcome is the push's:
        # a failure no call waited for is warned of as such, see _steps.Flight)
        self.sending = torch.empty(0, dtype=torch.long)
        # delta checkpoints: a counter of the state's changes (steps and loads; never goes back,
        # as ``steps`` does when a checkpoint is loaded), each state row's count when it last
        # changed, and each caller's baseline
        self.changes = 0
        self.state_changed = torch.empty(0, dtype=torch.long)
        self.baselines: dict[str, int] = {}

    def missing(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` are not cached."""
        with self.lock:
            return ~_find(self.ids, ids)[1]

    def add(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Cache fetched rows (ids not cached yet; a row cached meanwhile keeps its value)."""
        with self.lock:
            new = ~_find(self.ids, ids)[1]
            ids, rows = ids[new], rows[new]
            merged = torch.cat([self.ids, ids])
            order = torch.argsort(merged)
            self.ids = merged[order]
            self.rows = torch.cat([self.rows, rows])[order]
            self.fetched = torch.cat([self.fetched, rows])[order]

    def values(self, ids: torch.Tensor) -> torch.Tensor:
        """The cached values of ``ids`` (all cached)."""
        with self.lock:
            return self.rows[torch.searchsorted(self.ids, ids)]

    def step(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """One local optimizer step of the cached rows ``ids`` (sorted, unique, all cached)."""
        with self.lock:
            self.steps += 1
            self.changes += 1
            at = torch.searchsorted(self.ids, ids)
            before = {}
            if self.state:
                where, known = _find(self.state_ids, ids)
                if not bool(known.all()):
                    self._insert_state(ids[~known], new_state(self.optimizer, int((~known).sum()), self.dim,
                                                              self.dtype))
                    where = torch.searchsorted(self.state_ids, ids)
                before = {k: v[where] for k, v in self.state.items()}
            new_rows, after = step_rows(self.optimizer, self.rows[at], grad, before, self.steps)
            self.rows[at] = new_rows
            for k, v in after.items():
                self.state[k][where] = v
            if self.state:
                self.state_changed = self._changed()
                self.state_changed[where] = self.changes

    def trained(self) -> int:
        """How many cached rows moved since they were fetched: training not pushed yet."""
        with self.lock:
            return int(self._moved().sum())

    def never_sent(self) -> int:
        """How many cached rows moved since they were fetched and are in no push sent: what a
        table that ends now leaves unpushed (a push in flight carries the others)."""
        with self.lock:
            moved = self._moved()
            if moved.numel() and self.sending.numel():
                moved &= ~_find(self.sending, self.ids)[1]
            return int(moved.sum())

    def _moved(self) -> torch.Tensor:
        """(Lock held) which cached rows moved since they were fetched."""
        return (self.rows != self.fetched).any(dim=1)

    def deltas(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, value - value when fetched)`` of every cached row."""
        with self.lock:
            return self.ids.clone(), self.rows - self.fetched

    def drop(self, ids: torch.Tensor) -> None:
        """Forget the rows ``ids`` (pushed): their next lookup fetches the merged rows."""
        with self.lock:
            keep = ~_find(ids, self.ids)[1] if ids.numel() else torch.ones_like(self.ids, dtype=torch.bool)
            self.ids, self.rows, self.fetched = self.ids[keep], self.rows[keep], self.fetched[keep]

    def state_dict(self) -> dict:
        """The local optimizer's state in the form of a table's ``optimizer_state_dict()``:
        ``{"step", "ids", <state key>: rows, "geo_step_calls"}`` (copies)."""
        with self.lock:
            out: dict = {"step": self.steps, "ids": self.state_ids.clone()}
            out.update({k: v.clone() for k, v in self.state.items()})
            out["geo_step_calls"] = self.calls
            return out

    def _insert_state(self, ids: torch.Tensor, state: dict[str, torch.Tensor], changed: int = 0) -> None:
        """Add the state rows ``state`` of ``ids`` (none held yet), marked changed at ``changed``
        (lock held)."""
        marks = torch.cat([self._changed(), torch.full((ids.numel(),), changed, dtype=torch.long)])
        merged = torch.cat([self.state_ids, ids])
        order = torch.argsort(merged)
        self.state_ids = merged[order]
        self.state = {k: torch.cat([v, state[k]])[order] for k, v in self.state.items()}
        self.state_changed = marks[order]

    def _changed(self) -> torch.Tensor:
        """``state_changed``, as long as ``state_ids``."""
        if self.state_changed.numel() != self.state_ids.numel():
            self.state_changed = torch.zeros(self.state_ids.numel(), dtype=torch.long)
        return self.state_changed

    def delta(self, token: str) -> dict:
        """The local optimizer's state of the rows stepped since ``token``'s last call (all at
        its first: ``"whole"``), in :meth:`state_dict`'s form."""
        with self.lock:
            base = self.baselines.get(token)
            pick = slice(None) if base is None else self._changed() > base
            out: dict = {"whole": base is None, "step": self.steps, "ids": self.state_ids[pick].clone()}
            out.update({k: v[pick].clone() for k, v in self.state.items()})
            out["geo_step_calls"] = self.calls
            self.baselines[token] = self.changes
            return out

    def load_delta(self, delta: dict) -> None:
        """Apply :meth:`delta`'s: a whole one replaces the state, another updates its rows."""
        keys = {k: v for k, v in delta.items() if k not in ("whole", "step", "ids", "geo_step_calls")}
        ids = delta["ids"].long()
        if delta["whole"]:
            self.load_state_dict(int(delta["step"]), ids, keys, int(delta["geo_step_calls"]))
            return
        expected = sorted(new_state(self.optimizer, 0, self.dim, self.dtype))
        if sorted(keys) != expected:
            raise ValueError(f"optimizer state keys {sorted(keys)} do not fit this table's {self.optimizer.kind} "
                             f"optimizer, which keeps {expected}")
        with self.lock:
            self.changes += 1  # (the rows loaded changed: the next delta of every token holds them)
            where, known = _find(self.state_ids, ids)
            for k, v in keys.items():
                self.state[k][where[known]] = v[known].to(self.dtype)
            self._changed()[where[known]] = self.changes
            if not bool(known.all()):
                self._insert_state(ids[~known], {k: v[~known].to(self.dtype) for k, v in keys.items()}, self.changes)
            self.steps = int(delta["step"])
            self.calls = int(delta["geo_step_calls"])

    def load_state_dict(self, steps: int, ids: torch.Tensor, state: dict[str, torch.Tensor],
                        calls: int | None) -> None:
        """Replace the local optimizer's state (``ids`` unique and checked by the caller; their
        state rows by key, the optimizer's keys exactly) and step counts (``calls`` ``None``:
        kept)."""
        expected = sorted(new_state(self.optimizer, 0, self.dim, self.dtype))
        if sorted(state) != expected:
            raise ValueError(f"optimizer state keys {sorted(state)} do not fit this table's {self.optimizer.kind} "
                             f"optimizer, which keeps {expected}: load the state of a table with the same optimizer")
        order = torch.argsort(ids)
        with self.lock:
            self.state_ids = ids[order].clone()
            self.state = {k: v[order].to(self.dtype).clone() for k, v in state.items()}
            self.changes += 1  # (every row changed: the next delta of every token holds them all)
            self.state_changed = torch.full((ids.numel(),), self.changes, dtype=torch.long)
            self.steps = steps
            if calls is not None:
                self.calls = calls

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("lock")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.lock = threading.Lock()
