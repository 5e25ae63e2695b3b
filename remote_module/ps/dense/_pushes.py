"""A PSModel's step: its dense part's pushes planned (the gradients, sent as they are cleared,
put back where a push failed; geo, the local optimizer's step and every ``geo_push_every``
steps the deltas' pushes), sent with its tables' pushes and the prefetched lookups of its tables
and collections in one message per server (``ps._steps``), and settled part by part."""

from __future__ import annotations

import math
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import torch

from remote_module._core import CallTimeout, nested_seconds
from remote_module.ps._optimizer import GroupedPSOptimizer, set_group
from remote_module.ps._placement import block_of
from remote_module.ps._steps import PushPlan, finished, send_push_plans, settings_plans
from remote_module.ps.dense import _server

if TYPE_CHECKING:
    from remote_module.ps.dense._model import _PlacedBlock


class DensePushes:
    """The step of :class:`~remote_module.ps.dense._model.PSModel` (a part of it: it uses the
    model's blocks, gradients and tables)."""

    def step(self) -> None:
        """Push this step's gradients (geo: step the local copy; every ``geo_push_every``
        optimizer steps push the deltas and take the merged parameters) and clear the local
        gradients, and push every table's gradients: the dense pushes and the tables' to one
        server travel in one message, with the next lookups prefetched on its tables and
        collections (``prefetching`` over them), read once the pushes are applied. Parameters
        without a gradient are left alone, as torch's optimizers leave them.
        A step that raised part-way (a server timed out) is completed by calling ``step()``
        again: the dense part and the tables that were stepped already are not stepped twice
        (after a ``forward`` or ``zero_grad()``, the next ``step()`` is a whole one again).

        ``step()`` returns with its pushes in flight (the local gradients cleared as they are
        sent); the next call on the model waits for them, and a failure raises there, naming
        the server, with the gradients of the parts that failed put back (added to any computed
        since) for that retry. In sync mode each push is answered once its step is applied on
        that server (every trainer pushed it), so the next call on the model (a forward,
        ``zero_grad()``, ``flush()``, a checkpoint) waits for the other trainers, as the pull of
        the next forward did; if they do not push in time it raises a ``CallTimeout`` naming
        them, but the push counted (the step is applied once they push) and the gradients stay
        cleared: the next call waits again, and ``step()`` again pushes nothing twice. In geo
        mode a step that pushes the deltas (every ``geo_push_every`` steps) returns once the
        merged values are in the local copy, as a local optimizer's step leaves its parameters
        (an edit right after ``step()``, a clamp say, applies to them); its tables' pushes go in
        the same message.

        Example::

            loss.backward()
            model.step()
        """
        self._wait_pushes()  # the last step's (a failure raises here: call step() again to retry it)
        # the parts of this step done already: a step() that failed part-way (a table's server
        # timed out) is retried by calling step() again, which does only the parts left, so no
        # part pushes a second step (sync: it would be taken for the next round)
        done = self._step_done
        self._ready = None  # what the last step's answers brought: this step's replace them
        # every part's ps_optimizer settings checked first (a ValueError, a table's momentum say,
        # raises before any part takes its gradients, steps locally or advances its step)
        settings = {None: self.ps_optimizer.current_settings()} if None not in done else {}
        settings.update((qual, table._row_settings()) for qual, table in self._tables.items() if qual not in done)
        plans = []  # each part's pushes; a part that succeeds is marked done
        merging = False  # geo: this step pushes the dense deltas
        if None not in done and self.ps_mode != "geo":
            plans += settings_plans(settings[None], self._sent_settings,
                                    [s for s, slots in self._by_server().items() if slots], _server._set_settings,
                                    (self.name, self._trainer), self._settings_taken)
        if None not in done:
            if self.ps_mode == "geo":  # the local step; every geo_push_every steps the deltas' pushes
                plans += self._step_dense(settings[None])
                merging = bool(plans)
                done.add(None)
            else:
                # (left_out: the blocks a retry leaves out, applied already)
                plan, left_out = self._dense_push_plan()
                restore, took = self._clear_sent_gradients(), []

                def partly(oks: list[bool]) -> None:
                    took.extend(server for (server, _, _), ok in zip(plan.calls, oks) if ok)  # (before failed())

                plans.append(plan._replace(done=partial(finished, done, None, plan.done),
                                           failed=partial(restore, took, left_out), partly=partly))
        pushing: dict[int, list] = {}  # the tables pushing this step, by id: their calls
        for qual, table in self._tables.items():
            if qual not in done:
                plans += table._settings_plans(settings[qual])  # (ahead of its push, in the same message)
                plan = table._push_plan()
                if plan is None:  # geo: the table stepped its cached rows, and pushes nothing this step
                    done.add(qual)
                else:
                    pushing[id(table)] = plan.calls
                    plans.append(plan._replace(done=partial(finished, done, qual, plan.done)))
        # the next lookups prefetched on the tables and collections inside (prefetching over
        # them) go with these pushes, each read once they are applied (sync: their step)
        # (the tables and collections inside: a collection holds no rows of its own, but prefetches)
        prefetchers = [m for m in self.module.modules() if hasattr(m, "_prefetches")]
        steps = {t.name: t._step + (id(t) in pushing) for t in self._tables.values()}
        queues = [m._prefetches for m in prefetchers]
        joined = [queue.to_send(self.ps_mode == "sync") for queue in queues]
        reads = [call for queue, handles in zip(queues, joined) for call in queue.reads(handles, steps.__getitem__)]
        sent = send_push_plans(plans, self.timeout, reads)  # one message per server; each part settles alone
        for queue, handles in zip(queues, joined):
            queue.stepped(handles)
        # returns with the pushes in flight; the next call on the model (or on one of its tables)
        # waits for them (sync: for the step to be applied on every server), and a failure raises
        # there, the parts that failed kept for a retry as above
        self._keep_in_flight(self._tables.values(), sent, done, [h for handles in joined for h in handles])
        for prefetcher, handles in zip(prefetchers, joined):
            if hasattr(prefetcher, "_count"):  # a collection: its traffic counts the messages with its calls
                prefetcher._count([call for t in prefetcher.tables().values() for call in pushing.get(id(t), [])]
                                  + [call for h in handles for call in h.calls])
        # (as a local loop's optimizer.step(): what LR schedulers count), the collections' too:
        # a scheduler on a collection's ps_optimizer drives its tables (embeddings.md)
        grouped = [m.ps_optimizer for m in prefetchers if isinstance(m.ps_optimizer, GroupedPSOptimizer)]
        for opt in [self.ps_optimizer, *(t.ps_optimizer for t in self._tables.values()), *grouped]:
            opt.step()
        for queue in queues:  # (prefetching: the batches after, planned while the servers work)
            for planned in queue.take_after_step():
                planned()
        if merging:  # geo: the merged values are the local copy's when step() returns, as torch's
            self._wait_pushes()  # optimizer leaves its parameters (an edit after step() keeps them)

    def _clear_sent_gradients(self) -> Callable[..., None]:
        """(A step sent with its pushes in flight) clear the local gradients now, as ``step()``
        does, and return what puts them back if the push fails (added to any computed since),
        ``restore(took, left_out)``: the blocks of ``took``, the servers that answered that they
        applied their part, and ``left_out``, the blocks this push left out as applied already,
        get none of it back (their part of the step is done: the retry leaves each out while no
        gradient came since for its parameter, :meth:`_dense_push_plan`, and never pushes it
        twice, nor a zero gradient in its place: a momentum step torch would not take)."""
        params = self._params()
        sent = {name: p.grad for name, p in params.items() if p.grad is not None}
        for p in params.values():
            p.grad = None

        def restore(took: Any = (), left_out: Any = ()) -> None:
            done = [s for s in self._slots if s.server in took or s.name in left_out]
            for name, grad in sent.items():
                mine = [s for s in done if s.pname == name]
                if mine:
                    grad = grad.clone()
                    for slot in mine:
                        block_of(grad, slot.block).zero_()
                p = params[name]
                p.grad = grad if p.grad is None else p.grad + grad
            if done:
                # the gradients as put back: a block of ``done`` is left out of the retry while
                # its parameter's gradient is this (no backward since)
                self._took = ({s.name for s in done},
                                          {name: (p.grad, p.grad._version) for name, p in params.items()
                                           if p.grad is not None})

        return restore

    def _settings_taken(self, settings: dict) -> None:
        """The servers took ``settings``: the next step sends them only if they change."""
        self._sent_settings = settings

    def _step_dense(self, settings: dict) -> list:
        """geo: step the local copy, with ``settings`` (:attr:`ps_optimizer`'s, checked); every
        ``geo_push_every`` steps, the plans that push the deltas and take the merged parameters
        (:meth:`_delta_push_plans`; the other modes push through :meth:`_dense_push_plan`)."""
        params = self._params()
        # a step() without any gradient is no optimizer step (torch's optimizer leaves every
        # parameter alone): it does not count towards the next push either
        if all(p.grad is None for p in params.values()):
            return []
        set_group(self._local_opt.param_groups[0], settings)  # (ps_optimizer's: a scheduler's)
        self._local_opt.step()
        self._local_opt.zero_grad(set_to_none=True)
        self._geo_restored = None  # trained on since a restore
        self._step += 1
        self._geo_unpushed[0] += 1
        if self._step % self.geo_push_every == 0:
            return self._delta_push_plans()
        return []

    def _dense_push_plan(self) -> tuple[PushPlan, set[str]]:
        """The dense part of a step (not geo), as a plan: the pushes to the servers, what to do
        once they all succeeded (count the step; ``step()`` cleared the gradients as it sent
        them), and what to do with their answers: each push is answered with its server's blocks as a pull
        right after it would see them (sync: once the step is applied there), which the next
        forward uses instead of pulling (one round trip per step), when every server holding
        blocks answered, until a half_async server's timer merges what it had queued (this
        push among it); and the blocks it leaves out (:meth:`_applied_already`)."""
        params = self._params()
        calls = []
        sent = time.monotonic()  # before the pushes leave: the servers' timers run out no sooner
        sync = self.ps_mode == "sync"
        by_server = self._by_server()
        left_out = self._applied_already(params)
        for server, slots in by_server.items():
            mine = [s for s in slots if s.name not in left_out]
            if slots and not mine:
                continue  # it applied its part of the step this one retries
            # a parameter without a gradient (frozen, or unused this step) is not pushed: as in
            # torch, its optimizer leaves it alone (no weight decay, no momentum)
            sel = [s for s in mine if params[s.pname].grad is not None]
            grads = [self._block_values(s, params[s.pname].grad) for s in sel]
            # sync: every server with blocks hears from every trainer every step, grads or not
            if grads or (slots and self.ps_mode == "sync"):
                args = (self.name, self._trainer, self._step, self._sent(sel, grads),
                        ([s.name for s in slots], self._packable(slots)))
                if sync:  # answered once the step is applied, or at the servers' deadline
                    args += (nested_seconds(self._seconds()),)
                calls.append((server, _server._push_applied if sync else _server._push, args))

        def answered(got: list) -> None:
            servers = [server for server, _, _ in calls]
            stalled = [left for value, left in got if value is None and isinstance(left, str)]
            if stalled:  # sync: the push counted, its step not applied in time: a read's timeout
                self._stalled = CallTimeout(stalled[0])
            elif set(servers) == {server for server, slots in by_server.items() if slots}:
                values: dict[str, torch.Tensor] = {}
                until = math.inf
                for server, (value, left) in zip(servers, got):
                    values.update(self._received(by_server[server], value))
                    until = min(until, sent + left)
                self._ready = (values, until)

        def finish() -> None:
            self._step += 1

        return PushPlan(calls, finish, answered=answered), left_out

    def _applied_already(self, params: dict) -> set[str]:
        """The blocks (names) whose servers applied them in the failed step this one retries,
        when no gradient came since for their parameters (:meth:`_clear_sent_gradients`): the
        retry leaves them out (async: no step applied twice there, and no zero gradient's step
        either; sync: they counted it), and a server whose blocks are all left out."""
        took, self._took = self._took, None
        if took is None:
            return set()
        done, put_back = took

        def unchanged(name: str) -> bool:
            grad = params[name].grad
            if name not in put_back:
                return grad is None
            was, version = put_back[name]
            return grad is was and grad._version == version

        return {s.name for s in self._slots if s.name in done and unchanged(s.pname)}

    def _delta_push_plans(self) -> list:
        """geo: one plan per server pushing its blocks' deltas (local value minus the value
        last taken from it); its answer, the merged values, is written into the local copy
        and becomes the new base of its deltas, server by server: a server that failed keeps
        its deltas for the next push (its blocks train on locally meanwhile), and the steps
        since the last push count as not pushed until every server took its deltas (so
        ``flush()`` pushes them, and a model left so warns)."""
        plans = []
        params = self._params()
        unpushed = self._geo_unpushed
        steps = unpushed[0]

        def failed() -> None:  # that server kept its blocks' deltas: still to be pushed
            unpushed[0] = max(unpushed[0], steps)

        for server, slots in self._by_server().items():
            # only trainable (floating) parameters move: an integer one has no delta to average
            sel = [s for s in slots if params[s.pname].is_floating_point() or params[s.pname].is_complex()]
            deltas = [self._block_values(s) - self._pulled[s.name] for s in sel]
            if deltas:
                packed = self._packable(sel)
                calls = [(server, _server._push_delta, (self.name, self._sent(sel, deltas), packed))]
                plans.append(PushPlan(calls, failed=failed, answered=partial(self._merged, sel)))
        unpushed[0] = 0
        return plans

    def _merged(self, slots: list[_PlacedBlock], got: list) -> None:
        """geo: a server's answer to a delta push (its blocks merged): into the local copy, and
        the base of the next deltas."""
        values = self._received(slots, got[0])
        params = self._params()
        with torch.no_grad():  # block by block (a parameter's other blocks may be another server's)
            for slot in slots:
                part = block_of(params[slot.pname], slot.block)
                part.copy_(values[slot.name].view(part.shape))
        self._pulled.update({k: v.clone() for k, v in values.items()})
