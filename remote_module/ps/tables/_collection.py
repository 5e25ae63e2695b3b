"""ShardedEmbeddingBagCollection: the tables of a model looked up together, one message per
server, and their gradients pushed together, one message per server."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from itertools import chain
from typing import Any

import torch
from torch import nn

from remote_module._core import (
    call_grouped,
    nested_seconds,
    positive_seconds,
    retyped,
    timeout_seconds,
)
from remote_module.ps._modes import StepRefusal
from remote_module.ps._optimizer import GroupedPSOptimizer, step_each
from remote_module.ps._steps import InFlight, finished, run_push_plans
from remote_module.ps.tables import _packed
from remote_module.ps.tables._embedding_bag import ShardedEmbeddingBag
from remote_module.ps.tables._lookups import LookupPlan, at_step, told_refusals
from remote_module.ps.tables._prefetch import Prefetch, PrefetchQueue
from remote_module.ps.tables.server._requests import (
    BagsRead,
    BagTablesPush,
    PooledRead,
    RowDeltasPush,
    RowsPush,
    RowsRead,
    TablesPush,
)


class ShardedEmbeddingBagCollection(InFlight, nn.Module):
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
    no ``per_sample_weights`` or ``padding_idx``) of one ``embedding_dim`` are planned
    together: the ids of all of them are checked and split by server in a few whole-batch
    array ops, and each server gets their shares packed in two tensors (``ps._packed``; a
    plan per ``embedding_dim``); outputs and gradients are each table's own, bit for bit.
    Other tables (one whose ``embedding_dim`` no other table has included) plan their lookups
    alone, in the same message.

    Hooks registered on a table do not run: the collection calls the tables' lookups, not
    their ``forward``.

    In geo mode a table steps its cached rows locally and pushes their deltas every
    ``geo_push_every`` steps, in the step's message to each server.

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
        #: per server: messages this collection sent it, ids it asked it to look up, and gradient
        #: rows it pushed to it (a packed push counts the lookup's ids there, whose rows the
        #: server sums; see :meth:`_count`), since construction
        self.traffic: dict[str, dict[str, int]] = {}
        self._layouts: dict = {}  # per embedding_dim, the last batch layout of the tables planned together
        # the tables stepped already by a step() that failed part-way, which its retry leaves out
        self._step_done: set[str] = set()
        self._start_trainer_state()
        #: the tables' ps_optimizers as one torch.optim.Optimizer, a param group per table (each the
        #: table's own): an LR scheduler on it drives every table's (see ShardedEmbedding.ps_optimizer)
        self.ps_optimizer = GroupedPSOptimizer([t.ps_optimizer for t in self._modules.values()],
                                               "ShardedEmbeddingBagCollection")

    #: set at every forward and step (a Flight, None, a set): once set, stored without
    #: ``nn.Module.__setattr__``'s checks, which cost about 40 calls a training step
    _PLAIN_ATTRIBUTES = frozenset({"_flight", "_step_done"})

    def __setattr__(self, name: str, value: Any) -> None:
        # (set already, so no parameter, buffer or table has the name, and the value neither a
        # tensor nor a module: nn.Module.__setattr__ would store it as a plain attribute too; the
        # first time, at construction, it checks that no table took the name)
        if (name in ShardedEmbeddingBagCollection._PLAIN_ATTRIBUTES and name in self.__dict__
                and not isinstance(value, (torch.Tensor, nn.Module))):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def _start_trainer_state(self) -> None:
        """(Construction, and a copy) What this object alone holds: its step's pushes in flight
        and its prefetches."""
        self._flight = None
        #: the prefetched lookups of the next forwards, and the ones prefetching plans after the next step
        self._prefetches = PrefetchQueue()

    def __getstate__(self) -> dict:
        """As nn.Module's, once the pushes in flight landed, less the prefetch (a copy shares
        the servers' rows, not this trainer's lookups ahead)."""
        self._wait_pushes()
        state = self.__dict__.copy()
        for key in ("_flight", "_prefetches"):
            del state[key]
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._start_trainer_state()

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

    def _table_list(self) -> list[ShardedEmbeddingBag]:
        """The tables, in the order given (as :meth:`tables`' values; read from the children at
        each call, so a table replaced by ``setattr`` is seen)."""
        return list(map(self._modules.__getitem__, self._names))

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
        """``{name: pooled bags}`` for every table (see the class docstring); of the
        :meth:`prefetch` of equal features when there is one."""
        arguments = self._arguments(features)
        key = tuple(chain.from_iterable(arguments.values()))  # (every table's arguments, in turn)
        records = self._plan_states(self._table_list())
        handle = self._prefetches.claim(key, records, self._wait_pushes)
        self._step_done = set()  # a failed step() not retried: the next one is whole
        try:
            return PrefetchQueue.output(
                handle, lambda calls: call_grouped(self._count(at_step(calls, self._step_of)), timeout=self.timeout),
                lambda: self._plan(arguments, records))
        except StepRefusal as exc:  # (sync steps of its tables refused: raised here once)
            told_refusals(exc, self._by_name())
            raise

    def prefetch(self, features: Mapping[str, Any]) -> Prefetch:
        """Plan the lookups of ``features`` now (checked as :meth:`forward` checks them) for the
        next forward: sent with the next :meth:`step`'s pushes (one message per server; the
        servers answer once they applied them, so results are those without prefetch, in every
        mode), or by that forward when no step comes first. The next forward with equal
        features (by value) consumes it; any other forward drops it; a new prefetch replaces
        it. Returns the handle."""
        return self._prefetch_input(features)

    def _prefetch_input(self, features: Mapping[str, Any], queued: bool = False, overlap: bool = False) -> Prefetch:
        """A prefetch of ``features``; ``queued``, ``overlap``: as a table's (``prefetching``)."""
        arguments = self._arguments(features)
        key = tuple(chain.from_iterable(arguments.values()))  # (every table's arguments, in turn)
        tables = self._table_list()
        records = self._plan_states(tables)
        calls, finish = self._plan(arguments, records)  # (the steps it reads are set when it is sent)
        handle = Prefetch(key, records, calls, finish, replan=tables[0].ps_mode == "geo", tables=tables,
                          overlap=overlap)
        self._prefetches.add(handle, queued)
        return handle

    @staticmethod
    def _plan_states(tables: list[ShardedEmbeddingBag]) -> tuple:
        """Each table's ``_plan_state()`` (whether it records, its dtype): what a lookup's plan
        depends on besides its arguments (read here for all of them, grad mode once)."""
        grad = torch.is_grad_enabled()
        return tuple([(grad and marker.requires_grad, marker.dtype if marker.dtype.is_floating_point else torch.float32)
                      for marker in [t._parameters["grad_marker"] for t in tables]])

    def _step_of(self, name: str) -> int:
        return self._by_name()[name]._step

    def _count(self, calls: list) -> list:
        """Add ``calls`` (one send: one message per server) to :attr:`traffic`; ``calls``."""
        traffic = self.traffic
        for server in {server for server, _, _ in calls}:
            traffic.setdefault(server, {"messages": 0, "ids_looked_up": 0, "rows_pushed": 0})["messages"] += 1
        for server, _, request in calls:
            counts = traffic[server]
            if isinstance(request, PooledRead):
                counts["ids_looked_up"] += request.ids.numel()
            elif isinstance(request, RowsPush):
                counts["rows_pushed"] += 0 if request.ids is None else request.ids.numel()
            elif isinstance(request, TablesPush):
                counts["rows_pushed"] += request.ids.numel()
            elif isinstance(request, BagTablesPush):  # (the lookup's ids: the rows are summed there)
                counts["rows_pushed"] += 0 if request.ids is None else request.ids.numel()
            elif isinstance(request, RowDeltasPush):  # geo: the rows' deltas
                counts["rows_pushed"] += request.ids.numel()
            elif isinstance(request, RowsRead):  # a table's own lookup: its ids
                counts["ids_looked_up"] += request.ids.numel()
            elif isinstance(request, BagsRead):  # a lookup of a table one server holds whole: its input
                counts["ids_looked_up"] += request.input.numel()
        return calls

    def _by_name(self) -> dict[str, ShardedEmbeddingBag]:
        """The tables by their job-wide names (as the servers know them)."""
        return {t.name: t for t in self._table_list()}

    def _wait_pushes(self) -> None:
        """Wait for the pushes in flight of this collection's step and of its tables'."""
        self._land_in_flight(self._table_list())

    def _arguments(self, features: Mapping[str, Any]) -> dict[str, tuple]:
        """Each table's ``(input, offsets, per_sample_weights)`` of ``features``, checked (in the
        tables' order)."""
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
        arguments = {}
        modules = self._modules
        for name in self._names:
            value = features[name]
            if isinstance(value, (tuple, list)):
                given = len(value)
                if not 1 <= given <= 3:
                    raise TypeError(
                        f"ShardedEmbeddingBagCollection: table {name!r}'s input must be a tensor or a tuple "
                        f"(input, offsets=None, per_sample_weights=None), got a {type(value).__name__} of {given}"
                    )
                arguments[name] = tuple(value) + (None,) * (3 - given)
            else:
                arguments[name] = (value, None, None)
            try:  # include_last_offset: its offsets as the other tables'
                arguments[name] = modules[name]._bag_args(*arguments[name])
            except (TypeError, ValueError, RuntimeError) as exc:
                raise retyped(exc, f"ShardedEmbeddingBagCollection table {name!r}: {exc}") from exc
        return arguments

    def _plan(self, arguments: dict[str, tuple], records: tuple) -> LookupPlan:
        """The host calls of a forward of ``arguments`` (:meth:`_arguments`') and what makes its
        output of their answers; ``records``: the tables' :meth:`_plan_states`, taken with them."""
        wait_s = nested_seconds(timeout_seconds(self.timeout))  # a sync server's answer arrives in time
        # the plain sum / mean lookups planned together, in a few whole-batch NumPy ops (ps._packed)
        # (one plan per embedding_dim: a server answers a plan's bags packed in one tensor)
        by_dim: dict[int, list[str]] = {}
        for (name, args), (recording, _) in zip(arguments.items(), records):
            table = self._modules[name]
            if _packed.packable(table, *args, recording):
                by_dim.setdefault(table.embedding_dim, []).append(name)
        layouts = self._layouts
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
        return LookupPlan(calls, partial(self._outputs, plans, packs))

    def _outputs(self, plans: dict[str, LookupPlan], packs: list[tuple[list[str], LookupPlan]],
                 got: list) -> dict[str, torch.Tensor]:
        """A forward's output of the answers ``got`` of :meth:`_plan`'s calls: each table's
        ``plans`` and the ``packs`` of tables planned together, finished in turn."""
        out, at = {}, 0
        for name, (table_calls, table_finish) in plans.items():
            out[name] = table_finish(got[at:at + len(table_calls)])
            at += len(table_calls)
        for names, (pack_calls, pack_finish) in packs:
            out.update(zip(names, pack_finish(got[at:at + len(pack_calls)])))
            at += len(pack_calls)
        return {name: out[name] for name in self._names}

    def step(self) -> None:
        """Push every table's gradients, one message per server (see the tables' ``step``:
        what is pushed, retries, sync). Each table succeeds or fails as its own ``step()``
        would: one whose push failed keeps its gradients for a retry (or ``zero_grad()``), the
        others count as stepped; the first failure is raised once every call was answered. A
        ``step()`` after one that failed part-way steps only the tables that failed.

        Except in sync mode without a :meth:`prefetch`, the pushes are sent and ``step()``
        returns with them in flight; the next call on the collection or one of its tables waits
        for them first, and a failure raises there (once), as above."""
        timeout_seconds(self.timeout)  # checked before anything is taken
        self._wait_pushes()
        # the tables stepped already by a step() that failed part-way: its retry steps only the
        # others (sync: a second push of a stepped table would be taken for its next round, and
        # put this trainer a step ahead of the others for good), as PSModel.step() does
        done = self._step_done
        plans, pushing = [], set()
        tables = self._table_list()
        pushing_names = [name for name in self._names if name not in done]
        # (checked first: a ValueError raises before any table takes its gradients)
        settings = {name: self._modules[name]._row_settings() for name in pushing_names}
        together: dict[int, tuple] = {}  # tables whose gradients were recorded together, by that record
        for name, table in zip(self._names, tables):
            if name in done:
                continue
            plans += table._settings_plans(settings[name])  # (ahead of its push, in the same message)
            hint = table._take_packed_gradient()
            if hint is None:
                plan = table._push_plan()
            else:
                table._wait_pushes()
                taken = table._take_for_step()
                if len(taken) == 1 and taken[0] is hint.gradient:  # exactly that record since its last step
                    together.setdefault(id(hint.lookup), (hint.lookup, []))[1].append((name, table, taken))
                    pushing.add(table.name)
                    continue
                plan = table._push_plan(taken)
            if plan is None:  # geo: the table stepped its cached rows, and pushes nothing this step
                done.add(name)
            else:
                plans.append(plan._replace(done=partial(finished, done, name, plan.done)))
                pushing.add(table.name)
        for record, members in together.values():  # their pushes to a server in one call, at once
            plans.append(_packed.push_together(record, members, done))
        # each table's step once these pushes are applied, by name (read before any is sent)
        after, sync = {t.name: t._step + (t.name in pushing) for t in tables}, tables[0].ps_mode == "sync"
        sent, joined = self._prefetches.send(  # sync: a prefetch reads the step these pushes complete
            plans, self.timeout, sync, after.__getitem__)
        self._count([call for plan in plans for call in plan.calls] + [call for h in joined for call in h.calls])
        if joined or not sync:
            self._keep_in_flight(tables, sent, done, joined)
        # (as a local loop's optimizer.step(): what LR schedulers count)
        step_each([self._modules[name].ps_optimizer for name in pushing_names] + [self.ps_optimizer])
        for planned in self._prefetches.take_after_step():  # (prefetching: later batches, planned meanwhile)
            planned()
        if not joined and sync:
            sent.settle()
            done.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every table's ``zero_grad`` (the gradients recorded since the last step are dropped),
        once the pushes in flight landed."""
        self._wait_pushes()
        self._step_done = set()  # a failed step() dropped, not retried
        for table in self.tables().values():
            table.zero_grad(set_to_none)

    def flush(self) -> None:
        """Wait for the pushes in flight; every table's ``flush`` (half_async: the servers apply
        what they queued; geo: the deltas of the rows trained since the last push, every
        table's in one message per server, counted in :attr:`traffic`)."""
        self._wait_pushes()
        plans = [plan for plan in (table._geo_flush_plan() for table in self.tables().values()) if plan is not None]
        if plans:
            self._count([call for plan in plans for call in plan.calls])
            run_push_plans(plans, self.timeout)
        for table in self.tables().values():
            table.flush()  # (geo: nothing left to push)

    def optimizer_state_dict(self) -> dict[str, dict]:
        """``{name: that table's optimizer_state_dict()}``."""
        self._wait_pushes()
        return {name: table.optimizer_state_dict() for name, table in self.tables().items()}

    def load_optimizer_state_dict(self, state: Mapping[str, dict]) -> None:
        """Load :meth:`optimizer_state_dict`'s state into every table (``KeyError`` naming a
        table it has no state for, or a name that is not a table; a table's refusal, e.g. of
        another optimizer's state, before any table is loaded)."""
        self._check_per_table(state, "optimizer_state_dict")
        for name in self._names:
            if name not in state:
                raise KeyError(f"ShardedEmbeddingBagCollection: no optimizer state for table {name!r}")
        for name in self._names:  # (every table's checked first: a refused one leaves every table as it was)
            self._modules[name]._check_optimizer_state(state[name])
        for name in self._names:
            self._modules[name].load_optimizer_state_dict(state[name])

    def table_stats(self) -> dict[str, dict]:
        """``{name: that table's table_stats()}`` (rows held, admitted, evicted, bytes, merges)."""
        self._wait_pushes()
        return {name: table.table_stats() for name, table in self.tables().items()}

    def delta_state_dict(self, token: str) -> dict[str, dict]:
        """``{name: that table's delta_state_dict(token)}``: what changed since this token's last call."""
        self._wait_pushes()
        return {name: table.delta_state_dict(token) for name, table in self.tables().items()}

    def load_delta_state_dict(self, delta: Mapping[str, dict]) -> None:
        """Load :meth:`delta_state_dict`'s deltas into their tables (``KeyError`` naming a name
        that is not a table; a table without one in ``delta`` is left as it is; a table's
        refusal before any table is loaded)."""
        self._check_per_table(delta, "delta_state_dict")
        for name in self._names:  # (every table's checked first: a refused one leaves every table as it was)
            if name in delta:
                self._modules[name]._check_delta(delta[name])
        for name in self._names:
            if name in delta:
                self._modules[name].load_delta_state_dict(delta[name])

    def _check_per_table(self, given: Any, saved_by: str) -> None:
        """``TypeError`` unless ``given`` is a mapping (what ``saved_by`` returned), ``KeyError``
        naming a key of it that is not a table."""
        if not isinstance(given, Mapping):
            raise TypeError(f"load_{saved_by} takes what {saved_by}() returned, got {type(given).__name__}")
        for name in given:
            self.table(name)
