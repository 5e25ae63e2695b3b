"""A sharded table's checkpoints: its rows under the local module's key ``weight`` (a lazy
table: ``weight.ids`` / ``weight.rows``, the touched rows only) and the servers' per-row
optimizer state; both address rows by id, so they load onto any number of servers."""

from __future__ import annotations

from typing import Any

import torch

from remote_module._core import call_all
from remote_module.ps import _table_server


class TableCheckpoints:
    """Checkpoint methods of :class:`remote_module.ps.ShardedEmbedding` (which provides
    ``name``, ``ps_mode``, ``init``, ``timeout``, the layout ``_ranges`` / ``_by_server`` /
    ``_by_owner()``, ``_step``, ``_wait_s()``, ``flush()``, and in geo mode ``_geo`` and
    ``_geo_push()``)."""

    def _settle(self) -> None:
        """Before reading the servers' rows for a checkpoint: sync waits until this trainer's
        last step is applied on every server; half_async applies what is queued; geo pushes
        this trainer's deltas (so the checkpoint holds what it trained since its last push).
        Every mode first waits for this trainer's pushes in flight."""
        self._wait_pushes()
        if self.ps_mode == "geo":
            self._geo_push()
        elif self.ps_mode == "sync":
            nothing = torch.empty(0, dtype=torch.long)
            call_all([(s, _table_server._rows_for, (self.name, nothing, self._step, None, self._wait_s()))
                      for s in self._by_server],
                     timeout=self.timeout)
        elif self.ps_mode == "half_async":
            self.flush()

    def _before_rows_change(self) -> None:
        """Before a load: the pushes in flight land first, and a prefetch sent with them (which
        read the rows before the load) is dropped, this table's or a collection's."""
        self._wait_pushes()
        # (a prefetch, this table's or a collection's, that read its rows before is dropped: Prefetch.matches)
        self._changes = self.__dict__.get("_changes", 0) + 1

    def _stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._settle()
        calls = [(server, _table_server._block_rows, (self.name, first)) for first, _, server in self._ranges]
        got = call_all(calls, timeout=self.timeout)
        ids = torch.cat([i for i, _ in got])
        rows = torch.cat([r for _, r in got])
        order = torch.argsort(ids)
        return ids[order], rows[order]

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        ids, rows = self._stored()
        if self.init == "lazy":
            destination[prefix + "weight.ids"] = ids
            destination[prefix + "weight.rows"] = rows
        else:
            destination[prefix + "weight"] = rows

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        self._before_rows_change()
        keys = ("weight.ids", "weight.rows") if self.init == "lazy" else ("weight",)
        if strict:  # as torch's: every key under this module's prefix is one of its own
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in keys
                                   and not k.endswith("_extra_state"))
        if any(prefix + k not in state_dict for k in keys):
            missing_keys.extend(prefix + k for k in keys if prefix + k not in state_dict)
            return
        if self.init == "lazy":
            ids, rows = state_dict[prefix + "weight.ids"], state_dict[prefix + "weight.rows"]
            misfit = self._misfit(ids, {"rows": rows})
            if misfit:  # refused before any server is written (as torch: strict or not)
                error_msgs.append(f"size mismatch for {prefix}weight.{misfit}")
                return
            ids = ids.long()
        else:
            rows = state_dict[prefix + "weight"]
            if tuple(rows.shape) != (self.num_embeddings, self.embedding_dim):
                error_msgs.append(
                    f"size mismatch for {prefix}weight: copying a param with shape {tuple(rows.shape)}, the "
                    f"table is {(self.num_embeddings, self.embedding_dim)}"
                )
                return
            ids = torch.arange(self.num_embeddings)
        calls = []
        for _, server, mine in self._by_owner(ids):
            if ids[mine].numel():
                calls.append((server, _table_server._set_rows, (self.name, ids[mine], rows[mine].detach().clone())))
        call_all(calls, timeout=self.timeout)
        if self._geo is not None:  # cached rows are stale now: the next lookups fetch the loaded ones
            self._geo.drop(ids.unique())

    def _misfit(self, ids: Any, rows: dict[str, Any]) -> str | None:
        """What makes ``ids`` and their ``rows`` (by name) not fit this table (``None`` if they do)."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
            return f"ids: expected a 1-D tensor of row ids, got {getattr(ids, 'shape', type(ids).__name__)}"
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            return (f"ids: rows {int(ids.min())}..{int(ids.max())}, but the table has num_embeddings="
                    f"{self.num_embeddings} (save and load tables of the same size)")
        for key, value in rows.items():
            shape = (ids.numel(), self.embedding_dim)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                return f"{key}: copying rows of shape {tuple(getattr(value, 'shape', ()))}, the table needs {shape}"
        return None

    def optimizer_state_dict(self) -> dict:
        """The optimizer state for the rows ever touched: ``{"step": the table's optimizer step
        count, "ids": row ids, <state key>: rows, "ps_optimizer": ps_optimizer's state_dict()}``;
        loads onto any number of servers. The servers' state, or in geo mode the trainer's (its
        rows are stepped locally), with ``"geo_step_calls"``, the ``step()`` calls that set when
        deltas are pushed (pushed first, as :meth:`state_dict` does)."""
        self._settle()
        if self._geo is not None:
            return {**self._geo.state_dict(), "ps_optimizer": self.ps_optimizer.state_dict()}
        got = call_all([(server, _table_server._row_state, (self.name, first)) for first, _, server in self._ranges],
                       timeout=self.timeout)
        ids = torch.cat([i for _, i, _ in got]) if got else torch.empty(0, dtype=torch.long)
        order = torch.argsort(ids)
        out: dict[str, Any] = {"step": max(st for st, _, _ in got), "ids": ids[order]}
        # a block never stepped has no state yet (and no ids): its part of each key is empty
        keys = list(dict.fromkeys(key for _, _, state in got for key in state))
        empty = torch.empty(0, self.embedding_dim)
        for key in keys:
            out[key] = torch.cat([state.get(key, empty) for _, _, state in got])[order]
        out["ps_optimizer"] = self.ps_optimizer.state_dict()  # (its current settings, as a scheduler left them)
        return out

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Load :meth:`optimizer_state_dict`'s state: onto this table's servers, re-sliced, or in
        geo mode into the trainer's local optimizer (a checkpoint of any mode loads into any)."""
        if not isinstance(state, dict) or "step" not in state:
            raise TypeError(f"load_optimizer_state_dict takes what optimizer_state_dict() returned, got "
                            f"{type(state).__name__}{' without a step' if isinstance(state, dict) else ''}")
        keys = [k for k in state if k not in ("step", "ids", "geo_step_calls", "ps_optimizer")]
        misfit = self._misfit(state.get("ids"), {k: state[k] for k in keys})
        if misfit:
            raise ValueError(f"optimizer state for table {self.name!r} does not fit it: {misfit}")
        ids = state["ids"].long()
        self._before_rows_change()
        if "ps_optimizer" in state:  # (a checkpoint from before it had none: the settings stay)
            self.ps_optimizer.load_state_dict(state["ps_optimizer"])
            self.__dict__["_sent_settings"] = None  # the next step sends them
        if self._geo is not None:
            calls = state.get("geo_step_calls")
            self._geo.load_state_dict(int(state["step"]), ids, {k: state[k] for k in keys},
                                      None if calls is None else int(calls))
            return
        calls = [(server, _table_server._set_row_state,
                  (self.name, int(state["step"]), ids[mine], {k: state[k][mine] for k in keys}))
                 for _, server, mine in self._by_owner(ids)]
        call_all(calls, timeout=self.timeout)
