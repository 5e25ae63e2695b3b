"""A PSModel's checkpoints: the model's own ``state_dict`` with the servers' values, and the
servers' optimizer state per parameter, both re-sliced on load (any number of servers)."""

from __future__ import annotations

from typing import Any

import torch

from remote_module._fanout import call_all
from remote_module.ps import _server


class PSCheckpoints:
    """Checkpoint methods of :class:`remote_module.ps.PSModel` (which provides the layout:
    ``_slots``, ``_by_server()``, ``_params()``, ``_block_values()``, ``_write()``, ``_server_values()``)."""

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The local model's ``state_dict`` (its own keys) with the servers' current parameters
        (sync: once this trainer's last step is applied; half_async: after applying what is
        queued; geo: the local copy is left as it is)."""
        if self.mode == "half_async":
            self.flush()
        values = self._server_values()
        if self.mode != "geo":
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
        result = self.module.load_state_dict(state_dict, strict=strict)
        # only the parameters the checkpoint has: with strict=False, the others keep the servers'
        # values (the local copy may be stale, e.g. one step behind after step())
        loaded = {id(p) for key, p in self.module.named_parameters(remove_duplicate=False) if key in state_dict}
        params = self._params()
        calls = []
        for server, slots in self._by_server().items():
            values = {s.name: self._block_values(s).clone() for s in slots
                      if id(params[s.pname]) in loaded}
            if values:
                calls.append((server, _server._set_values, (self.name, values)))
        call_all(calls, timeout=self.timeout)
        if self.mode == "geo":
            self._pulled = {}
            self.pull()
        return result

    def optimizer_state_dict(self) -> dict:
        """The servers' optimizer state: ``{"state": {parameter: {key: value}}, "optimizer":
        the class name, "per_element": {parameter: [keys]}}``. Per-element state (e.g. Adam's
        moments) is concatenated in the parameter's shape, and ``per_element`` names those keys
        (a scalar parameter's look like ``step``); scalars such as ``step`` are kept as they are.
        Loadable by :meth:`load_optimizer_state_dict` onto any number of servers.

        Example::

            torch.save({"model": ps.state_dict(), "optim": ps.optimizer_state_dict()}, "ckpt.pt")
        """
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
                if isinstance(values[0], torch.Tensor) and values[0].dim() == 1 and values[0].numel() == slots[0].block.size:
                    entry[key] = torch.cat(values).reshape(p.shape)
                    per_element[pname].append(key)  # a scalar parameter's are 0-dim like ``step``: say which
                else:
                    entry[key] = values[0]
            state[pname] = entry
        tables = {qual: table.optimizer_state_dict() for qual, table in self._tables.items()}
        return {"state": state, "optimizer": self.optimizer[0].__name__, "per_element": per_element, "tables": tables}

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        """Send optimizer state from :meth:`optimizer_state_dict` to the servers, re-sliced."""
        if not isinstance(state_dict, dict) or "state" not in state_dict:
            raise TypeError("load_optimizer_state_dict takes what optimizer_state_dict() returned")
        if state_dict.get("optimizer") != self.optimizer[0].__name__:
            raise ValueError(
                f"the optimizer state is for {state_dict.get('optimizer')!r}, this job uses {self.optimizer[0].__name__!r}"
            )
        params = self._params()
        tables = state_dict.get("tables", {})
        missing = [qual for qual in self._tables if qual not in tables]
        if missing:
            raise KeyError(f"the optimizer state has no entry for sharded table(s) {missing}")
        marked = state_dict.get("per_element")
        for pname, p in params.items():  # checked before anything is sent
            entry = state_dict["state"].get(pname)
            if entry is None:
                raise KeyError(f"the optimizer state has no entry for parameter {pname!r}")
            for key, value in entry.items():
                per_element = key in marked.get(pname, ()) if marked is not None else (
                    isinstance(value, torch.Tensor) and value.dim() > 0)
                if per_element and (not isinstance(value, torch.Tensor) or value.shape != p.shape):
                    raise ValueError(
                        f"the optimizer state of parameter {pname!r} has {key!r} of shape "
                        f"{tuple(getattr(value, 'shape', ()))}, but the parameter has shape {tuple(p.shape)}: load "
                        "optimizer state saved from the same model"
                    )
        calls = []
        for server, slots in self._by_server().items():
            states = {}
            for s in slots:
                entry = state_dict["state"][s.pname]
                names = marked.get(s.pname, ()) if marked is not None else None
                block = {}
                for key, value in entry.items():
                    if key in names if names is not None else (isinstance(value, torch.Tensor) and value.dim() > 0):
                        block[key] = value.reshape(-1)[s.block.offset:s.block.offset + s.block.size].clone()
                    else:
                        block[key] = value.clone() if isinstance(value, torch.Tensor) else value
                states[s.name] = block
            if states:
                calls.append((server, _server._load_optimizer_state, (self.name, states)))
        call_all(calls, timeout=self.timeout)
        for qual, table in self._tables.items():
            table.load_optimizer_state_dict(tables[qual])


