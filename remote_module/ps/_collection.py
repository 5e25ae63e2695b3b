"""ShardedEmbeddingBagCollection: the tables of a model looked up together, one message per
server, and their gradients pushed together, one message per server."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping

import torch
from torch import nn

from remote_module._core import (
    call_grouped,
    nested_seconds,
    positive_seconds,
    retyped,
    timeout_seconds,
)
from remote_module.ps import _packed
from remote_module.ps._embedding import run_push_plans
from remote_module.ps._embedding_bag import ShardedEmbeddingBag


def _finished(done: set, name: str, finish: Callable[[], None]) -> None:
    """A table of a collection's step whose pushes succeeded: ``finish()``, and remember it, so
    a retried ``step()`` does not push it again."""
    finish()
    done.add(name)


class ShardedEmbeddingBagCollection(nn.Module):
    """Several :class:`ShardedEmbeddingBag` tables used together, as torchrec's
    ``EmbeddingBagCollection`` groups a model's tables: a forward sends every table's lookups
    for one server in **one message** (and gets their pooled bags back in one answer), and
    :meth:`step` sends every table's pushes for one server in one message. Each table keeps
    its own rules: arguments, errors, modes, checkpoints.

    ``tables`` maps a name to a table; the tables must share ``ps_mode`` and ``num_trainers``
    (``ValueError`` naming the table that differs). They are this module's children under
    those names, so ``state_dict()`` keys are ``<name>.weight`` (a lazy table:
    ``<name>.weight.ids`` / ``<name>.weight.rows``), and a model or :class:`PSModel` holding
    the collection reaches them as it reaches any submodule.

    ``forward(features)`` takes, for every table, its input: the ids tensor, or a tuple (or
    list) ``(input, offsets, per_sample_weights)`` (the last two may be ``None`` or left out),
    as the table's own ``forward`` takes them; it returns ``{name: pooled bags}``. A name not
    in the collection, or a table without an input, raises ``KeyError`` naming it; a table's
    own errors keep their type and name the table. ``ebc[name]``, ``name in ebc``,
    ``len(ebc)``, ``list(ebc)`` and ``keys()`` see the tables by name.

    ``timeout`` (seconds; ``None``: the RPC agent's default) is the collection's own, not the
    tables': a forward's and a step's calls share one deadline, and a server runs the calls
    of its message one after another, so it must cover all the tables' work on a server. A
    sync lookup waits on a server for the step within it (and names the trainers missing).

    :meth:`step` steps every table as its own ``step()`` would: a table whose push failed on
    some server (a server down or late) keeps its gradients for a retry, as alone, and the
    others count as stepped; the first failure is raised once all have been answered. Calling
    ``step()`` again retries the failed tables only (after a forward or ``zero_grad()``, the
    next ``step()`` steps every table again).

    The lookups of sum and mean tables with plain inputs (int64 ids, 2-d or 1-d with offsets;
    no ``per_sample_weights`` or ``padding_idx``) are planned together: the ids of all of them
    are checked, deduplicated and split by server in a few whole-batch tensor ops, and each
    server gets their shares packed in two tensors (``ps._packed``); outputs and gradients are
    each table's own, bit for bit. Other tables plan their lookups alone, in the same message.

    Hooks registered on a table do not run: the collection calls the tables' lookups, not
    their ``forward``.

    In geo mode a table steps its cached rows locally and pushes their deltas every
    ``geo_push_every`` steps in messages of its own (as it does alone).

    Example::

        tables = {"items": ShardedEmbeddingBag(1_000_000, 16, servers, name="items", mode="sum"),
                  "users": ShardedEmbeddingBag(100_000, 16, servers, name="users", mode="sum")}
        ebc = ShardedEmbeddingBagCollection(tables)
        out = ebc({"items": (ids, offsets), "users": user_ids.view(-1, 1)})   # one message per server
        loss = model(out["items"], out["users"]); loss.backward()
        ebc.step()                                                        # one message per server
    """

    def __init__(self, tables: Mapping[str, ShardedEmbeddingBag], *, timeout: float | None = None) -> None:
        super().__init__()
        self.timeout = None if timeout is None else positive_seconds(timeout, "timeout")
        if not isinstance(tables, Mapping) or not tables:
            raise TypeError("ShardedEmbeddingBagCollection takes a non-empty mapping of name -> ShardedEmbeddingBag, "
                            f"got {tables!r:.100}")
        first_name, first = None, None
        seen: dict[int, str] = {}
        for name, table in tables.items():
            if not isinstance(name, str):
                raise TypeError(f"ShardedEmbeddingBagCollection: table names must be str, got {name!r}")
            if not isinstance(table, ShardedEmbeddingBag):
                raise TypeError(f"ShardedEmbeddingBagCollection: table {name!r} must be a ShardedEmbeddingBag, "
                                f"got {type(table).__name__}")
            if id(table) in seen:
                raise ValueError(f"ShardedEmbeddingBagCollection: tables {seen[id(table)]!r} and {name!r} are the same "
                                 "table object; give each table once")
            seen[id(table)] = name
            if first is None:
                first_name, first = name, table
            for what in ("ps_mode", "num_trainers"):
                if getattr(table, what) != getattr(first, what):
                    raise ValueError(
                        f"ShardedEmbeddingBagCollection: table {name!r} has {what}={getattr(table, what)!r}, but table "
                        f"{first_name!r} has {what}={getattr(first, what)!r}; the tables of a collection share both"
                    )
            self.add_module(name, table)  # torch's own checks of the name (no '.', no attribute clash)
        self._names = tuple(tables)
        self._layouts: dict = {}  # per embedding_dim, the last batch layout of the tables planned together

    @property
    def ps_mode(self) -> str:
        return self.table(self._names[0]).ps_mode

    def table(self, name: str) -> ShardedEmbeddingBag:
        """The table called ``name`` (``KeyError`` naming it when there is none)."""
        if name not in self._names:
            raise KeyError(f"ShardedEmbeddingBagCollection has no table {name!r} (tables: {', '.join(self._names)})")
        return self._modules[name]

    def tables(self) -> dict[str, ShardedEmbeddingBag]:
        """``{name: table}``, in the order given."""
        return {name: self._modules[name] for name in self._names}

    def keys(self) -> list[str]:
        """The table names, in the order given."""
        return list(self._names)

    def __getitem__(self, name: str) -> ShardedEmbeddingBag:
        return self.table(name)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Any:
        return iter(self._names)

    def extra_repr(self) -> str:
        return f"tables={list(self._names)}, ps_mode={self.ps_mode!r}"

    def forward(self, features: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """``{name: pooled bags}`` for every table (see the class docstring)."""
        if not isinstance(features, Mapping):
            raise TypeError(f"ShardedEmbeddingBagCollection takes a mapping of table name -> input, got "
                            f"{type(features).__name__}")
        for name in features:
            if name not in self._names:
                raise KeyError(f"ShardedEmbeddingBagCollection has no table {name!r} (tables: "
                               f"{', '.join(self._names)})")
        for name in self._names:
            if name not in features:
                raise KeyError(f"ShardedEmbeddingBagCollection: no input for table {name!r}")
        wait_s = nested_seconds(timeout_seconds(self.timeout))  # a sync server's answer arrives in time
        self.__dict__.pop("_step_done", None)  # a failed step() not retried: the next one is whole
        arguments = {}
        for name in self._names:
            value = features[name]
            if isinstance(value, (tuple, list)):
                if not 1 <= len(value) <= 3:
                    raise TypeError(
                        f"ShardedEmbeddingBagCollection: table {name!r}'s input must be a tensor or a tuple "
                        f"(input, offsets=None, per_sample_weights=None), got a {type(value).__name__} of {len(value)}"
                    )
                arguments[name] = tuple(value) + (None,) * (3 - len(value))
            else:
                arguments[name] = (value, None, None)
            try:  # include_last_offset: its offsets as the other tables'
                arguments[name] = self._modules[name]._bag_args(*arguments[name])
            except (TypeError, ValueError, RuntimeError) as exc:
                raise retyped(exc, f"ShardedEmbeddingBagCollection table {name!r}: {exc}") from exc
        # the plain sum / mean lookups planned together, in a few whole-batch ops (ps._packed)
        # (one plan per embedding_dim: a server answers a plan's bags packed in one tensor)
        by_dim: dict[int, list[str]] = {}
        for name in self._names:
            if _packed.packable(self._modules[name], *arguments[name]):
                by_dim.setdefault(self._modules[name].embedding_dim, []).append(name)
        layouts = self.__dict__.setdefault("_layouts", {})
        packs = []
        for dim, names in by_dim.items():
            if len(names) > 1:
                made = _packed.plan(layouts.setdefault(dim, {}),
                                    [(self._modules[n], *arguments[n][:2]) for n in names], wait_s)
                if made is not None:
                    packs.append((names, made))
        together = {name for names, _ in packs for name in names}
        plans = {}
        for name in self._names:
            if name in together:
                continue
            try:
                plans[name] = self._modules[name]._lookup_plan(*arguments[name], wait_s)
            except (TypeError, ValueError, IndexError, RuntimeError) as exc:  # the table's own checks
                raise retyped(exc, f"ShardedEmbeddingBagCollection table {name!r}: {exc}") from exc
        calls = [call for table_calls, _ in plans.values() for call in table_calls]
        for _, (pack_calls, _) in packs:
            calls += pack_calls
        got = call_grouped(calls, timeout=self.timeout)
        out, at = {}, 0
        for name, (table_calls, finish) in plans.items():
            out[name] = finish(got[at:at + len(table_calls)])
            at += len(table_calls)
        for names, (pack_calls, finish) in packs:
            out.update(zip(names, finish(got[at:at + len(pack_calls)])))
            at += len(pack_calls)
        return {name: out[name] for name in self._names}

    def step(self) -> None:
        """Push every table's gradients, one message per server (see the tables' ``step``:
        what is pushed, retries, sync). Each table succeeds or fails as its own ``step()``
        would: one whose push failed keeps its gradients for a retry (or ``zero_grad()``), the
        others count as stepped; the first failure is raised once every call was answered. A
        ``step()`` after one that failed part-way steps only the tables that failed."""
        timeout_seconds(self.timeout)  # checked before anything is taken
        # the tables stepped already by a step() that failed part-way: its retry steps only the
        # others (sync: a second push of a stepped table would be taken for its next round, and
        # put this trainer a step ahead of the others for good), as PSModel.step() does
        done = self.__dict__.setdefault("_step_done", set())
        plans = []
        for name in self._names:
            if name in done:
                continue
            plan = self._modules[name]._push_plan()
            if plan is None:  # geo: the table stepped (and pushed its deltas) itself
                done.add(name)
            else:
                calls, table_done, failed = plan
                plans.append((calls, partial(_finished, done, name, table_done), failed))
        run_push_plans(plans, self.timeout)
        done.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every table's ``zero_grad`` (the gradients recorded since the last step are dropped)."""
        self.__dict__.pop("_step_done", None)  # a failed step() dropped, not retried
        for table in self.tables().values():
            table.zero_grad(set_to_none)

    def flush(self) -> None:
        """Every table's ``flush`` (half_async: the servers apply what they queued)."""
        for table in self.tables().values():
            table.flush()

    def optimizer_state_dict(self) -> dict[str, dict]:
        """``{name: that table's optimizer_state_dict()}``."""
        return {name: table.optimizer_state_dict() for name, table in self.tables().items()}

    def load_optimizer_state_dict(self, state: Mapping[str, dict]) -> None:
        """Load :meth:`optimizer_state_dict`'s state into every table (``KeyError`` naming a
        table it has no state for, or a name that is not a table)."""
        if not isinstance(state, Mapping):
            raise TypeError(f"load_optimizer_state_dict takes what optimizer_state_dict() returned, got "
                            f"{type(state).__name__}")
        for name in state:
            self.table(name)
        for name in self._names:
            if name not in state:
                raise KeyError(f"ShardedEmbeddingBagCollection: no optimizer state for table {name!r}")
        for name in self._names:
            self._modules[name].load_optimizer_state_dict(state[name])
