"""A sharded table's checkpoints: its rows under the local module's key ``weight`` (a lazy
table: ``weight.ids`` / ``weight.rows``, the touched rows only) and the servers' per-row
optimizer state; both address rows by id, so they load onto any number of servers."""

from __future__ import annotations

from typing import Any

import torch

from remote_module._core import call_all
from remote_module.ps._rowwise import new_state
from remote_module.ps.tables.lifetime._admission import counter_bits
from remote_module.ps.tables.server import _checkpoint_handlers
from remote_module.ps.tables.server._checkpoint_handlers import aged

#: the optimizers' names, by row-wise kind (errors name them as torch does)
_OPTIMIZER_NAMES = {"sgd": "SGD", "adagrad": "Adagrad", "sparse_adam": "SparseAdam"}
#: settings of an optimizer's param group that tell which of them saved it
_GROUP_MARKS = {"sgd": ("momentum", "dampening", "nesterov"), "adagrad": ("lr_decay", "initial_accumulator_value"),
                "sparse_adam": ("betas",)}
#: the key of a table's entry in a state_dict's ``_metadata`` that says where in the delta
#: chains its rows were read: ``{"table": name, "versions": {server: (first, last)}}``
CHAIN_METADATA = "delta_chain"


def _compact(counters: torch.Tensor) -> torch.Tensor:
    """An admission sketch's counters as a checkpoint keeps them: a sparse tensor while few
    bytes are nonzero (a sketch that counted few ids), else as they are."""
    if int(torch.count_nonzero(counters)) * 9 < counters.numel():
        return counters.to_sparse()
    return counters


class TableCheckpoints:
    """Checkpoint methods of :class:`remote_module.ps.ShardedEmbedding` (which provides
    ``name``, ``ps_mode``, ``init``, ``timeout``, ``_applied_or_told()``, the layout ``_ranges`` / ``_by_server`` /
    ``_by_server_of()``, ``_step``, ``_wait_s()``, ``flush()``, and in geo mode ``_geo`` and
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
            self._applied_or_told()  # (a refused step this trainer was not told of raises here)
        elif self.ps_mode == "half_async":
            self.flush()

    def _before_rows_change(self) -> None:
        """Before a load: the pushes in flight land first, and a prefetch sent with them (which
        read the rows before the load) is dropped, this table's or a collection's."""
        self._wait_pushes()
        # (a prefetch, this table's or a collection's, that read its rows before is dropped: Prefetch.matches)
        self._changes += 1

    def _tracks(self) -> bool:
        """Whether the servers keep admission counts or eviction clocks (checkpointed too)."""
        return self.admit_after > 1 or self.evict_after_steps is not None

    def _stored(self) -> tuple:
        """``(ids, rows, last, clock, at)``: the rows stored (sorted by id) and, with eviction,
        each one's clock and the table's step (the highest of its servers'; each row's clock
        moved by its server's lag, so its age is kept), else ``None``s; ``at``: each server's
        versions while its blocks were read (first, last), where they are in the delta chains."""
        self._settle()
        evicting = self.evict_after_steps is not None
        calls = [(server, _checkpoint_handlers._block_rows, (self.name, first, evicting, True))
                 for first, _, server in self._ranges]
        got = call_all(calls, timeout=self.timeout)
        ids = torch.cat([g[0] for g in got])
        rows = torch.cat([g[1] for g in got])
        order = torch.argsort(ids)
        last = clock = None
        if evicting:
            clock = max(g[3] for g in got)
            last = torch.cat([aged(g[2], clock - g[3]) for g in got])[order]
        at: dict[str, tuple[int, int]] = {}
        for (_, _, server), g in zip(self._ranges, got):
            first, end = at.get(server, (g[-1], g[-1]))
            at[server] = (min(first, g[-1]), max(end, g[-1]))
        return ids[order], rows[order], last, clock, at

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        ids, rows, last, clock, at = self._stored()
        # where in the delta chains these rows are: a delta loaded after them must follow it.
        # In the state_dict's metadata, which torch keeps with it (torch.save, load_state_dict)
        # and a local module ignores, so the keys stay the local module's
        metadata = getattr(destination, "_metadata", None)
        if isinstance(metadata, dict) and isinstance(metadata.get(prefix[:-1]), dict):
            metadata[prefix[:-1]][CHAIN_METADATA] = {"table": self.name, "versions": at}
        if self.init == "lazy":
            destination[prefix + "weight.ids"] = ids
            destination[prefix + "weight.rows"] = rows
        else:
            destination[prefix + "weight"] = rows
        if last is not None:
            destination[prefix + "weight.last_step"] = last
        if self._tracks():
            admission = call_all([(s, _checkpoint_handlers._admission_state, (self.name,)) for s in self._by_server],
                                 timeout=self.timeout)
            destination[prefix + "_extra_state"] = {"eviction_clock": clock,
                                                    "admission": [(blocks, _compact(data)) for blocks, data in
                                                                  (a for a in admission if a is not None)],
                                                    "admission_bits": self._admission_bits()}

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        self._before_rows_change()
        keys = ("weight.ids", "weight.rows") if self.init == "lazy" else ("weight",)
        optional = ("weight.last_step",)
        if strict:  # as torch's: every key under this module's prefix is one of its own
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in keys
                                   and k[len(prefix):] not in optional and not k.endswith("_extra_state"))
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
        last = state_dict.get(prefix + "weight.last_step")
        extra = state_dict.get(prefix + "_extra_state") or {}
        if last is not None and (not isinstance(last, torch.Tensor) or tuple(last.shape) != (ids.numel(),)):
            error_msgs.append(f"size mismatch for {prefix}weight.last_step: expected one clock per row "
                              f"({ids.numel()}), got {tuple(getattr(last, 'shape', ()))}")
            return
        refused = self._admission_misfit(extra.get("admission"), extra.get("admission_bits"))
        if refused:
            error_msgs.append(f"admission sketch of {prefix or 'the table'}: {refused}")
            return
        if self.evict_after_steps is None:
            last = None
        clock = extra.get("eviction_clock") if last is not None else None
        calls = []
        for _, server, mine in self._by_server_of(ids):
            held = tuple(self._by_server[server])
            # a lazy table's checkpoint holds all its rows: rows stored since and not in it are dropped
            calls.append((server, _checkpoint_handlers._set_rows,
                          (self.name, ids[mine], rows[mine].detach().clone(), None if last is None else last[mine],
                           clock, held if self.init == "lazy" else ())))
        call_all(calls, timeout=self.timeout)
        # the rows are the checkpoint's now: the next delta must follow it (unknown, None, for a
        # state_dict without the metadata state_dict() gives it: then only a whole table loads)
        self._rows_at = _chain_place(local_metadata.get(CHAIN_METADATA) if isinstance(
            local_metadata, dict) else None)
        admission = extra.get("admission")
        if self.admit_after > 1:  # (a checkpoint without counts: counts start from zero)
            self._set_admission([(blocks, data.to_dense() if data.is_sparse else data, None)
                                 for blocks, data in admission or ()])
        if self._geo is not None:  # cached rows are stale now: the next lookups fetch the loaded ones
            # every one: a lazy checkpoint holds all the rows the table keeps, so a row trained
            # since and not in it goes back to its first value, its delta not pushed with it
            self._geo.drop(self._geo.ids)

    def _loaded_from_files(self, place: dict, settings: dict | None, geo: dict | None) -> None:
        """The trainer's side of a load whose rows the servers read from files themselves
        (``remote_module.ps.load_shards``), after they did: the rows are at ``place`` in the
        saving table's delta chains (``{"table", "versions"}``), ``ps_optimizer`` takes
        ``settings`` (None: kept); in geo mode the cached rows are stale and the local
        optimizer state is ``geo`` (what :meth:`optimizer_state_dict` returned)."""
        self._rows_at = _chain_place(place)
        if self._geo is not None:
            self._geo.drop(self._geo.ids)
            if geo is not None:
                self.load_optimizer_state_dict(geo)
                return
        if settings is not None:
            self.ps_optimizer.load_state_dict(settings)
            self._sent_settings = None

    def _set_admission(self, parts: list) -> None:
        """Every server of the table loads the saved sketches ``parts`` (``(blocks, counters,
        chunks)``: :func:`_checkpoint_handlers._set_admission`)."""
        call_all([(s, _checkpoint_handlers._set_admission, (self.name, parts)) for s in self._by_server],
                 timeout=self.timeout)

    def _admission_bits(self) -> int | None:
        """The width of the admission sketch's counters (None without admission): sketches of
        other widths hash ids to other counters, so they cannot be loaded."""
        admit_after = self.admit_after
        return counter_bits(admit_after) if admit_after > 1 else None

    def _admission_misfit(self, parts: Any, bits: Any, chunked: bool = False) -> str | None:
        """Why saved admission sketches ``parts`` (``bits`` wide, None: not recorded) do not fit
        this table's (None if they do, or if it keeps none)."""
        mine = self._admission_bits()
        if not parts or mine is None:
            return None
        if bits is not None and bits != mine:
            return (f"its counters are {bits} bits wide, this table's {mine} (admit_after={self.admit_after}): a "
                    "sketch loads only into a table whose admit_after needs counters as wide (2 bits: 2-3, 4 bits: "
                    "4-15, 8 bits: 16-255)")
        for part in parts:
            data, chunks = part[1], part[2] if chunked else None
            if chunks is None and data.numel() != self.admit_sketch_bytes:
                return (f"it has {data.numel()} bytes, this table's {self.admit_sketch_bytes} (admit_sketch_bytes "
                        "must be the same)")
        return None

    def delta_state_dict(self, token: str) -> dict:
        """What changed on the servers since this trainer's last call with the same ``token``:
        the rows stepped or loaded since (``"ids"``, ``"rows"``), their optimizer state
        (``"has_state"`` and one tensor per state key, for those rows), the ids evicted
        meanwhile (``"evicted"``: tombstones), the eviction clocks and the admission sketch's
        changed parts, the table's step count and ``ps_optimizer``'s settings; in geo mode also
        this trainer's local optimizer state (``"geo"``).

        Each token has its own baseline on the servers for each trainer: callers with different
        tokens, or trainers calling with the same one, never reset each other's, so each
        trainer's deltas of a token are a complete chain. A trainer's first call with a token
        (or one whose baseline is older than the tombstones a server keeps, ``Tombstones.KEPT``
        ids, tables/lifetime/_deltas.py) returns the whole table on that server (its ranges
        under ``"whole"``): loading it replaces those rows.

        :meth:`load_delta_state_dict` applies one: a checkpoint (``state_dict()`` and
        ``optimizer_state_dict()``) loaded, then the deltas taken after it in order, give the
        rows, optimizer state and clocks a checkpoint at the end would, on any number of servers.
        A delta that does not follow what the table loaded last is refused (see there).

        Example::

            full = (emb.state_dict(), emb.optimizer_state_dict())
            emb.delta_state_dict("ckpt")          # the baseline (the whole table)
            train(emb, steps=100)                 # (your training loop)
            delta = emb.delta_state_dict("ckpt")  # only the rows changed since
        """
        if not isinstance(token, str) or not token:
            raise ValueError(f"token must be a non-empty str naming the caller's baseline, got {token!r}")
        self._settle()
        got = call_all([(s, _checkpoint_handlers._table_delta, (self.name, token, self._trainer))
                        for s in self._by_server], timeout=self.timeout)
        ids = torch.cat([g["ids"] for g in got])
        order = torch.argsort(ids)
        has_state = torch.cat([g["has_state"] for g in got])
        out: dict[str, Any] = {
            "whole": [tuple(r) for g in got for r in g["whole"]],
            "ids": ids[order], "rows": torch.cat([g["rows"] for g in got])[order],
            "stepped": torch.cat([g["stepped"] for g in got])[order], "has_state": has_state[order],
            "evicted": torch.cat([g["evicted"] for g in got]).unique(),
            "step": max(g["step"] for g in got),
            "clock": max(g["clock"] for g in got),
            "admission": [g["sketch"] for g in got if g["sketch"] is not None],
            "admission_bits": self._admission_bits(),
            "ps_optimizer": self.ps_optimizer.state_dict(),
            # which deltas it follows and reaches, per server: loads check that deltas come in order
            "chain": {"table": self.name, "token": token, "trainer": self._trainer,
                      "versions": {s: g["versions"] for s, g in zip(self._by_server, got)}},
        }
        if got[0]["last"] is not None:
            clock = out["clock"]
            out["last"] = torch.cat([aged(g["last"], clock - g["clock"]) for g in got])[order]
        # each state row's position among the rows with state, in the sorted order
        state_order = torch.argsort(ids[has_state])
        keys = list(dict.fromkeys(k for g in got for k in g["state"]))
        empty = torch.empty(0, self.embedding_dim)
        out["state"] = {k: torch.cat([g["state"].get(k, empty) for g in got])[state_order] for k in keys}
        if self._geo is not None:
            out["geo"] = self._geo.delta(token)
        return out

    def load_delta_state_dict(self, delta: dict) -> None:
        """Apply :meth:`delta_state_dict`'s ``delta`` to the servers (any number of them).

        ``ValueError`` naming its token and trainer, before anything changes, unless it follows
        what this table loaded last (a full checkpoint's ``state_dict()``, or a delta of any
        token or trainer): it must hold every change since then (taken at or before it) and
        none older (taken at or after it). A whole table (a token's first delta) follows
        anything. So a checkpoint, then one trainer's deltas of a token in order, load; a delta
        skipped, one older than the checkpoint, or one of another trainer's chain that does not
        overlap is refused. Loading the same delta again is harmless."""
        self._check_delta(delta)
        ids = delta["ids"].long()
        self._before_rows_change()
        if "ps_optimizer" in delta:
            self.ps_optimizer.load_state_dict(delta["ps_optimizer"])
            self._sent_settings = None
        has_state = delta["has_state"].bool()
        state_at = torch.cumsum(has_state.long(), 0) - 1
        last = delta.get("last") if self.evict_after_steps is not None else None
        evicted = delta["evicted"].long()
        calls = []
        for _, server, mine in self._by_server_of(ids):
            held = self._by_server[server]
            whole = tuple((max(f, wf), min(f + c, wf + wc) - max(f, wf)) for f, c in held for wf, wc in delta["whole"]
                          if max(f, wf) < min(f + c, wf + wc))
            mine_has = has_state[mine]
            pick = state_at[mine][mine_has]
            state = {k: v.index_select(0, pick) for k, v in delta["state"].items()}
            mine_evicted = evicted[_checkpoint_handlers._in_ranges(evicted, held)]
            calls.append((server, _checkpoint_handlers._apply_delta,
                          (self.name, whole, mine_evicted, ids[mine], delta["rows"][mine], delta["stepped"][mine],
                           state, mine_has, None if last is None else last[mine], int(delta["step"]),
                           int(delta["clock"]))))
        call_all(calls, timeout=self.timeout)
        if delta.get("admission") and self.admit_after > 1:
            self._set_admission(list(delta["admission"]))
        if self._geo is not None:
            if "geo" in delta:
                self._geo.load_delta(delta["geo"])
            self._geo.drop(torch.cat([ids, evicted]).unique())
        chain = delta.get("chain")
        # the rows are the source's as this delta reached them (unknown without its chain)
        self._rows_at = None if chain is None else _chain_place(
            {"table": chain["table"], "versions": {s: (v[1], v[1]) for s, v in chain["versions"].items()}})

    def _check_delta(self, delta: Any) -> None:
        """What :meth:`load_delta_state_dict` checks before anything changes: ``TypeError``
        unless ``delta`` is what :meth:`delta_state_dict` returned, ``ValueError`` unless it fits
        this table (sizes, admission sketch, optimizer) and follows what it loaded last."""
        needed = {"ids", "rows", "evicted", "whole", "stepped", "has_state", "state", "step", "clock"}
        if not isinstance(delta, dict) or not needed <= set(delta):
            missing = f" without {sorted(needed - set(delta))}" if isinstance(delta, dict) else ""
            raise TypeError(f"load_delta_state_dict takes what delta_state_dict() returned, got "
                            f"{type(delta).__name__}{missing}")
        misfit = self._misfit(delta["ids"], {"rows": delta["rows"]}) or self._admission_misfit(
            delta.get("admission"), delta.get("admission_bits"), chunked=True)
        if misfit:
            raise ValueError(f"delta for table {self.name!r} does not fit it: {misfit}")
        geo = delta.get("geo") if self._geo is not None else None
        keys = [k for k in geo if k not in ("whole", "step", "ids", "geo_step_calls")] if isinstance(geo, dict) \
            else list(delta["state"])
        self._check_optimizer(keys, delta.get("ps_optimizer"), "delta", bool(delta["has_state"].any()))
        self._check_chain(delta.get("chain"))

    def _check_chain(self, chain: Any) -> None:
        """``ValueError`` naming the delta's token and trainer unless the delta whose ``chain``
        this is follows what this table loaded last (``_rows_at``: a checkpoint's rows, or a
        delta): on each server it holds every change since then (it follows a version at or
        before it) and none older (it reaches a version at or after it); where it is a whole
        table (it follows -1) anything. Deltas loaded out of order would move rows back in time,
        or miss changes (another trainer's, say)."""
        if chain is None:  # (a delta of before chains were kept)
            return
        follows = {s: v[0] for s, v in chain["versions"].items()}
        if all(v < 0 for v in follows.values()):  # a whole table everywhere
            return
        place = self._rows_at
        which = (f"delta of table {chain['table']!r} (token {chain['token']!r}, trainer "
                 f"{chain.get('trainer', 'not recorded')!r})")
        if place is None:
            raise ValueError(
                f"{which} follows an earlier state of the table, but this table loaded no checkpoint it could follow "
                "(or one whose state_dict lost its metadata, which says where its rows are): load the full checkpoint "
                "taken before it (state_dict() and optimizer_state_dict(), as returned or torch.save()d) and the "
                "deltas taken after that in order, or a token's first delta (a whole table)")
        if place["table"] != chain["table"] or set(place["versions"]) != set(follows):
            raise ValueError(
                f"{which} does not follow what this table loaded last, which was read from table {place['table']!r} "
                f"on servers {sorted(place['versions'])}: load deltas of the table and layout the checkpoint was "
                "taken from")
        gap = {s: v for s, v in follows.items() if v >= 0 and v > place["versions"][s][0]}
        older = {s: v[1] for s, v in chain["versions"].items() if v[1] < place["versions"][s][1]}
        if gap or older:
            why = (f"it follows versions {follows}, later than what it loaded last reached "
                   f"{ {s: v[0] for s, v in place['versions'].items()} }: changes in between would be missing"
                   if gap else f"it reaches versions { {s: v[1] for s, v in chain['versions'].items()} }, older "
                   f"than what it loaded last { {s: v[1] for s, v in place['versions'].items()} }: rows would move "
                   "back in time")
            raise ValueError(
                f"{which} does not follow what this table loaded last ({why}): load deltas in the order "
                "delta_state_dict() returned them, each trainer's own chain, after the full checkpoint taken before "
                "the first of them")

    def _check_optimizer(self, keys: list, settings: Any, what: str, required: bool = True) -> None:
        """``ValueError`` unless optimizer state with state ``keys`` (all of the optimizer's if
        ``required``: some rows have state) and ``ps_optimizer`` ``settings`` (a state_dict)
        was saved by a table with this table's optimizer: another's would fail on the servers."""
        mine = self._row_opt.kind
        expected = sorted(new_state(self._row_opt, 0, self.embedding_dim, torch.float32))
        given = sorted(keys)
        groups = settings.get("param_groups") if isinstance(settings, dict) else None
        group = groups[0] if isinstance(groups, list) and groups and isinstance(groups[0], dict) else {}
        saved_by = next((kind for kind, marks in _GROUP_MARKS.items() if all(m in group for m in marks)), None)
        if saved_by is None:
            saved_by = next((kind for kind in _OPTIMIZER_NAMES if given and given == sorted(
                new_state(self._row_opt._replace(kind=kind), 0, 1, torch.float32))), None)
        fits = set(given) <= set(expected) and (given == expected or not required)
        if fits and saved_by in (None, mine):
            return
        theirs = f"{_OPTIMIZER_NAMES[saved_by]}'s" if saved_by is not None else "another optimizer's"
        raise ValueError(
            f"{what} for table {self.name!r} holds {theirs} state (state keys {given}), but this table's optimizer "
            f"is {_OPTIMIZER_NAMES[mine]}, which keeps {expected}: load the state of a table with the same optimizer "
            "(nothing was loaded)")

    def _misfit(self, ids: Any, rows: dict[str, Any]) -> str | None:
        """What makes ``ids`` and their ``rows`` (by name) not fit this table (``None`` if they do)."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
            return f"ids: expected a 1-D tensor of row ids, got {getattr(ids, 'shape', type(ids).__name__)}"
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            return (f"ids: rows {int(ids.min())}..{int(ids.max())}, but the table has num_embeddings="
                    f"{self.num_embeddings} (save and load tables of the same size)")
        if ids.numel():
            unique, counts = torch.unique(ids, return_counts=True)
            if bool((counts > 1).any()):  # which of two rows for one id would win is undefined
                twice = unique[counts > 1]
                return (f"ids: {twice.numel()} row id(s) appear more than once, e.g. {int(twice[0])} "
                        f"({int(counts.max())} times); a checkpoint holds each row once")
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
        got = call_all([(server, _checkpoint_handlers._row_state, (self.name, first))
                        for first, _, server in self._ranges], timeout=self.timeout)
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
        geo mode into the trainer's local optimizer (a checkpoint of any mode loads into any).
        ``ValueError`` before anything changes for state that does not fit the table (its
        sizes, or another optimizer's state)."""
        keys = self._check_optimizer_state(state)
        ids = state["ids"].long()
        self._before_rows_change()
        if "ps_optimizer" in state:  # (a checkpoint from before it had none: the settings stay)
            self.ps_optimizer.load_state_dict(state["ps_optimizer"])
            self._sent_settings = None  # the next step sends them
        if self._geo is not None:
            calls = state.get("geo_step_calls")
            # (a table never stepped saves no state key: its rows' state is empty)
            empty = torch.empty(0, self.embedding_dim)
            every = new_state(self._row_opt, 0, self.embedding_dim, torch.float32)
            self._geo.load_state_dict(int(state["step"]), ids, {k: state.get(k, empty) for k in every},
                                      None if calls is None else int(calls))
            return
        calls = [(server, _checkpoint_handlers._set_row_state,
                  (self.name, int(state["step"]), ids[mine], {k: state[k][mine] for k in keys}))
                 for _, server, mine in self._by_server_of(ids)]
        call_all(calls, timeout=self.timeout)

    def _check_optimizer_state(self, state: Any) -> list[str]:
        """What :meth:`load_optimizer_state_dict` checks before anything changes (``TypeError``
        for what :meth:`optimizer_state_dict` does not return, ``ValueError`` for state that does
        not fit this table); the state's per-row keys."""
        if not isinstance(state, dict) or "step" not in state:
            raise TypeError(f"load_optimizer_state_dict takes what optimizer_state_dict() returned, got "
                            f"{type(state).__name__}{' without a step' if isinstance(state, dict) else ''}")
        keys = [k for k in state if k not in ("step", "ids", "geo_step_calls", "ps_optimizer")]
        misfit = self._misfit(state.get("ids"), {k: state[k] for k in keys})
        if misfit:
            raise ValueError(f"optimizer state for table {self.name!r} does not fit it: {misfit}")
        self._check_optimizer(keys, state.get("ps_optimizer"), "optimizer state", bool(state["ids"].numel()))
        return keys


def _chain_place(marker: Any) -> dict | None:
    """A table's place in its source's delta chains as a checkpoint's metadata or a delta
    says it (``{"table": name, "versions": {server: (first, last)}}``), checked; None if
    there is none, or it is not one."""
    if not (isinstance(marker, dict) and isinstance(marker.get("table"), str)
            and isinstance(marker.get("versions"), dict) and marker["versions"]):
        return None
    try:
        versions = {str(s): (int(v[0]), int(v[1])) for s, v in marker["versions"].items()}
    except (TypeError, ValueError, IndexError):
        return None
    return {"table": marker["table"], "versions": versions}
