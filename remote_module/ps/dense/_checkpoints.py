"""A PSModel's checkpoints: the model's own ``state_dict`` with the servers' values, and the
servers' optimizer state per parameter, both re-sliced on load (any number of servers)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from remote_module._core import call_all
from remote_module.ps.dense import _server


class PSCheckpoints:
    """Checkpoint methods of :class:`remote_module.ps.PSModel` (which provides the layout:
    ``_slots``, ``_by_server()``, ``_params()``, ``_block_values()``, ``_write()``, ``_server_values()``)."""

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The local model's ``state_dict`` (its own keys) with the servers' current parameters
        (sync: once this trainer's last step is applied; half_async: after applying what is
        queued; geo: the local copy is left as it is). The next forward pulls again (a
        checkpoint is where a trainer catches up with the others' pushes).

        As torch's, the dense entries are the local parameters themselves (not in geo mode:
        copies there), which the next forward's pull overwrites, while each table's entries are
        copies gathered from the servers: ``torch.save`` the dict at once (or deep-copy it) to
        keep one step's values."""
        self._wait_pushes()
        self._ready = None
        if self.ps_mode == "half_async":
            self.flush()
        values = self._server_values()
        if self.ps_mode != "geo":
            self._write(values)
            return self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        # geo: the servers' values go into the returned dict only; the local copy (and its progress
        # since the last push, measured against the last pulled values) stays as it is
        out = self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        for pname, value in self._assembled(values).items():
            if prefix + pname in out:
                out[prefix + pname] = value
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load the local model's ``state_dict`` and send its parameters to the servers."""
        self._wait_pushes()
        result = self.module.load_state_dict(state_dict, strict=strict)
        self._loaded(set(state_dict))
        return result

    def _nested_load(self, module: Any, state_dict: Any, prefix: str, *args: Any) -> None:
        """(A pre-hook of ``load_state_dict``) a model holding this PSModel loads a checkpoint:
        this PSModel's part is the local model's keys under ``prefix``, as :meth:`state_dict`
        wrote them, which torch then looks for under ``prefix + "module."``: they are moved
        there, and noted for :meth:`_nested_loaded`."""
        self._wait_pushes()
        own = prefix + "module."
        keys = set()
        for key in list(state_dict):
            if key.startswith(own):
                keys.add(key[len(own):])
            elif key.startswith(prefix):
                keys.add(key[len(prefix):])
                state_dict[own + key[len(prefix):]] = state_dict.pop(key)
        self._nested_keys = keys

    def _nested_loaded(self, module: Any, incompatible: Any) -> None:
        """(A post-hook of ``load_state_dict``) the local model loaded its part of a holding
        model's checkpoint: send it to the servers, as :meth:`load_state_dict` does."""
        keys, self._nested_keys = self._nested_keys, None
        if keys is not None:
            self._loaded(keys)

    def _loaded(self, keys: set) -> None:
        """The local model loaded the checkpoint's ``keys`` (its own): send those parameters to
        the servers; the next forward pulls them (geo: the local copy takes them)."""
        self._ready = None  # the next forward pulls the values loaded
        # only the parameters the checkpoint has: with strict=False, the others keep the servers'
        # values (the local copy may be stale, e.g. one step behind after step())
        loaded = {id(p) for key, p in self.module.named_parameters(remove_duplicate=False) if key in keys}
        params = self._params()
        calls = []
        for server, slots in self._by_server().items():
            values = {s.name: self._block_values(s).clone() for s in slots
                      if id(params[s.pname]) in loaded}
            if values:
                calls.append((server, _server._set_values, (self.name, values)))
        call_all(calls, timeout=self.timeout)
        if self.ps_mode == "geo":
            restored, self._geo_restored = self._geo_restored, None
            if restored is None:
                self._pulled = {}
                self.pull()
            else:
                # the optimizer state was loaded first (torch's loads go in either order): the
                # trainer's progress it restored stays, as if it had been loaded after this
                with torch.no_grad():
                    for pname, p in self._params().items():
                        p.copy_(restored[pname])

    def optimizer_state_dict(self) -> dict:
        """The optimizer state: ``{"state": {parameter: {key: value}}, "optimizer": the class
        name, "per_element": {parameter: [keys]}, "tables": {table: its state}, "ps_optimizer":
        :attr:`ps_optimizer`'s ``state_dict()`` (its current settings)}``. Per-element
        state (e.g. Adam's moments) is in the parameter's shape, and ``per_element`` names those
        keys (a scalar parameter's look like ``step``); scalars such as ``step`` are kept as they
        are. Loadable by :meth:`load_optimizer_state_dict` onto any number of servers.

        sync, async, half_async: the servers' optimizers' state, concatenated from the blocks.
        geo: the optimizer is this trainer's own, so this is its state, plus ``"geo"``: this
        trainer's progress since its last push (``"steps"``: its optimizer steps so far, which
        time the pushes; ``"local"``: its local copy; ``"pulled"``: the values it last took from
        the servers; ``"unpushed"``: its local steps not pushed yet). Each trainer saves and
        loads its own: restored after the model's ``load_state_dict``, training continues
        exactly as it would have.

        Example::

            torch.save({"model": ps.state_dict(), "optim": ps.optimizer_state_dict()}, "ckpt.pt")
            # ... a fresh PSModel (any servers), then:
            ps.load_state_dict(ckpt["model"])
            ps.load_optimizer_state_dict(ckpt["optim"])
        """
        self._wait_pushes()
        self._ready = None  # (as state_dict: the next forward pulls again)
        tables = {qual: table.optimizer_state_dict() for qual, table in self._tables.items()}
        settings = self.ps_optimizer.state_dict()  # (its current lr and the rest, as a scheduler left them)
        if self.ps_mode == "geo":
            state, per_element = self._trainer_optimizer_state()
            return {"state": state, "optimizer": self.optimizer[0].__name__, "per_element": per_element,
                    "tables": tables, "geo": self._geo_progress(), "ps_optimizer": settings}
        calls = [(server, _server._optimizer_state, (self.name, [s.name for s in slots]))
                 for server, slots in self._by_server().items() if slots]
        by_block: dict[str, dict] = {}
        for got in call_all(calls, timeout=self.timeout):
            by_block.update(got)
        params = self._params()
        state: dict[str, dict] = {}
        per_element: dict[str, list[str]] = {}
        for pname, p in params.items():
            slots = [s for s in self._slots if s.pname == pname]
            parts = [by_block.get(s.name, {}) for s in slots]
            entry: dict[str, Any] = {}
            per_element[pname] = []
            for key in parts[0] if parts else ():
                values = [part[key] for part in parts]
                if (isinstance(values[0], torch.Tensor) and values[0].dim() == 1
                        and values[0].numel() == slots[0].block.size):
                    entry[key] = torch.cat(values).reshape(p.shape)
                    per_element[pname].append(key)  # a scalar parameter's are 0-dim like ``step``: say which
                else:
                    entry[key] = values[0]
            state[pname] = entry
        return {"state": state, "optimizer": self.optimizer[0].__name__, "per_element": per_element, "tables": tables,
                "ps_optimizer": settings}

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        """Load optimizer state from :meth:`optimizer_state_dict`: sent to the servers,
        re-sliced (geo: into this trainer's optimizer, with its ``"geo"`` progress; before or
        after the model's :meth:`load_state_dict`, as torch's loads go: a model loaded after it,
        before the next step or pull, keeps that progress)."""
        if not isinstance(state_dict, dict) or "state" not in state_dict:
            raise TypeError("load_optimizer_state_dict takes what optimizer_state_dict() returned")
        self._wait_pushes()
        if state_dict.get("optimizer") != self.optimizer[0].__name__:
            raise ValueError(
                f"the optimizer state is for {state_dict.get('optimizer')!r}, "
                f"this job uses {self.optimizer[0].__name__!r}"
            )
        tables = state_dict.get("tables", {})
        missing = [qual for qual in self._tables if qual not in tables]
        if missing:
            raise KeyError(f"the optimizer state has no entry for sharded table(s) {missing}")
        marked = state_dict.get("per_element")
        self._check_parameter_states(state_dict["state"], marked)  # checked before anything is sent
        for qual, table in self._tables.items():  # (refused here, e.g. another optimizer's: nothing loaded)
            table._check_optimizer_state(tables[qual])
        geo = state_dict.get("geo") if self.ps_mode == "geo" else None
        if geo is not None:
            self._check_geo_progress(geo)
        if "ps_optimizer" in state_dict:  # (a checkpoint from before it had none: the settings stay)
            self.ps_optimizer.load_state_dict(state_dict["ps_optimizer"])
            self._sent_settings = None  # the next step sends them
        if self.ps_mode == "geo":
            self._load_trainer_optimizer_state(state_dict["state"])
            if geo is not None:
                self._load_geo_progress(geo)
        else:
            self._load_server_optimizer_state(state_dict["state"], marked)
        for qual, table in self._tables.items():
            table.load_optimizer_state_dict(tables[qual])

    @staticmethod
    def _per_element(key: str, value: Any, names: Any) -> bool:
        """Whether ``key`` of a parameter's optimizer state is per element (sliced as the
        parameter is): among ``names`` (a checkpoint's record of them), or, for a checkpoint
        without it (None), a tensor that is not a scalar."""
        return key in names if names is not None else (isinstance(value, torch.Tensor) and value.dim() > 0)

    def _check_parameter_states(self, states: dict, marked: dict | None) -> None:
        """``KeyError`` for a parameter without optimizer state in ``states``, ``ValueError``
        for a per-element entry of another shape than its parameter's."""
        for pname, p in self._params().items():
            entry = states.get(pname)
            if entry is None:
                raise KeyError(f"the optimizer state has no entry for parameter {pname!r}")
            for key, value in entry.items():
                per_element = self._per_element(key, value, marked.get(pname, ()) if marked is not None else None)
                if per_element and (not isinstance(value, torch.Tensor) or value.shape != p.shape):
                    raise ValueError(
                        f"the optimizer state of parameter {pname!r} has {key!r} of shape "
                        f"{tuple(getattr(value, 'shape', ()))}, but the parameter has shape {tuple(p.shape)}: load "
                        "optimizer state saved from the same model"
                    )

    def _load_server_optimizer_state(self, states: dict, marked: dict | None) -> None:
        """Send each server the optimizer state of its blocks (the per-element entries sliced
        as the blocks are, the others as they are)."""
        calls = []
        for server, slots in self._by_server().items():
            blocks = {}
            for s in slots:
                names = marked.get(s.pname, ()) if marked is not None else None
                block = {}
                for key, value in states[s.pname].items():
                    if self._per_element(key, value, names):
                        block[key] = value.reshape(-1)[s.block.offset:s.block.offset + s.block.size].clone()
                    else:
                        block[key] = value.clone() if isinstance(value, torch.Tensor) else value
                blocks[s.name] = block
            if blocks:
                calls.append((server, _server._load_optimizer_state, (self.name, blocks)))
        call_all(calls, timeout=self.timeout)

    # ---- geo: the optimizer and the progress since the last push are the trainer's ----------------

    def _trainer_optimizer_state(self) -> tuple[dict[str, dict], dict[str, list[str]]]:
        """This trainer's optimizer state by parameter name (copies), and its per-element keys:
        tensors of the parameter's shape (a scalar parameter's ``step`` is a scalar)."""
        opt = self._local_opt
        state: dict[str, dict] = {}
        per_element: dict[str, list[str]] = {}
        for pname, p in self._params().items():
            entry = {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                     for k, v in opt.state.get(p, {}).items()}
            state[pname] = entry
            per_element[pname] = [k for k, v in entry.items() if isinstance(v, torch.Tensor)
                                  and v.shape == p.shape and (p.dim() > 0 or k != "step")]
        return state, per_element

    def _load_trainer_optimizer_state(self, state: dict[str, dict]) -> None:
        """``state`` (by parameter name, checked) into this trainer's optimizer, through torch's
        own ``load_state_dict`` (which casts to each parameter's dtype and device)."""
        opt = self._local_opt
        if opt is None:  # (no dense parameter)
            return
        index = {id(p): i for i, p in enumerate(p for group in opt.param_groups for p in group["params"])}
        loaded = {}
        for pname, p in self._params().items():
            entry = state[pname]
            if entry:
                loaded[index[id(p)]] = {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                                        for k, v in entry.items()}
        sd = opt.state_dict()
        sd["state"] = loaded
        opt.load_state_dict(sd)

    def _geo_progress(self) -> dict:
        params = self._params()
        return {"steps": self._step,
                "local": {pname: p.detach().clone() for pname, p in params.items()},
                "pulled": self._assembled(self._pulled),
                "unpushed": self._geo_unpushed[0]}

    def _check_geo_progress(self, geo: Any) -> None:
        """A ``"geo"`` entry as :meth:`_geo_progress` made it for this model (checked before
        anything is loaded): a ``ValueError`` naming what does not fit."""
        if not (isinstance(geo, dict) and isinstance(geo.get("steps"), int) and isinstance(geo.get("local"), dict)
                and isinstance(geo.get("pulled"), dict)):
            raise ValueError("the optimizer state's 'geo' entry must have 'steps' (int), 'local' and 'pulled' "
                             f"(dicts by parameter name) as optimizer_state_dict() makes it, got {geo!r:.200}")
        for pname, p in self._params().items():
            trained = p.is_floating_point() or p.is_complex()
            for what in ("local", "pulled"):
                value = geo[what].get(pname)
                if value is None and (what == "local" or trained):
                    raise KeyError(f"the optimizer state's geo {what!r} values have no entry for parameter {pname!r}")
                if value is not None and (not isinstance(value, torch.Tensor) or value.shape != p.shape):
                    raise ValueError(
                        f"the optimizer state's geo {what!r} value of parameter {pname!r} has shape "
                        f"{tuple(getattr(value, 'shape', ()))}, but the parameter has shape {tuple(p.shape)}: load "
                        "optimizer state saved from the same model"
                    )

    def _load_geo_progress(self, geo: dict) -> None:
        """The local copy, the values last pulled (re-sliced) and the step count, as saved."""
        params = self._params()
        with torch.no_grad():
            for pname, p in params.items():
                p.copy_(geo["local"][pname])
        self._pulled = {s.name: self._block_values(s, geo["pulled"][s.pname].to(params[s.pname].dtype)).clone()
                        for s in self._slots if s.pname in geo["pulled"]}
        self._step = geo["steps"]
        # (the local steps not pushed yet, as saved: flush() pushes them; a state saved before
        # this count was kept says whether there are any)
        saved = geo.get("unpushed")
        if isinstance(saved, int) and saved >= 0:
            self._geo_unpushed[0] = saved
        else:
            self._geo_unpushed[0] = int(any(not torch.equal(self._block_values(s), self._pulled[s.name])
                                            for s in self._slots if s.name in self._pulled))
        # a load_state_dict() before the next step or pull keeps this progress (see there)
        self._geo_restored = {pname: p.detach().clone() for pname, p in params.items()}
