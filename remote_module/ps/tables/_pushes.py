"""A table's step: its pushes planned (the gradients recorded since the last step, or geo's row
deltas every ``geo_push_every`` steps), with its ps_optimizer's settings ahead of them
(:class:`TablePushes`, a part of ``ShardedEmbedding``), and how several tables' pushes to one
server travel in one call (:func:`pack_table_pushes`, the step transport's packer)."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from remote_module._core import to_exception
from remote_module.ps._rowwise import bag_ends, coalesce, row_gradients
from remote_module.ps._steps import Flight, PushPlan, run_push_plans, set_push_packer, settings_plans
from remote_module.ps.tables._recording import BagsGradient, set_plain
from remote_module.ps.tables.server import _handlers
from remote_module.ps.tables.server._requests import BagsPush, PackedEntry, RowDeltasPush, RowsPush, TablesPush


def table_push_failure(server: str, table: str, failure: Any) -> BaseException:
    """The failure of one table's push among several in one ``_push_tables`` call, as raised."""
    return to_exception(failure, f"on worker {server!r} in the push of table {table!r}")


def _packs(calls: list) -> dict[tuple, list[int]]:
    """The tables' pushes of ``calls`` that travel packed: the indices of each group of two or
    more with a gradient to one server, of one row width and dtypes."""
    packs: dict[tuple, list[int]] = {}
    for i, (server, _, push) in enumerate(calls):
        if isinstance(push, RowsPush) and push.ids is not None:
            packs.setdefault((server, push.grad.shape[1], push.grad.dtype, push.ids.dtype), []).append(i)
    return {key: members for key, members in packs.items() if len(members) > 1}


def pack_table_pushes(calls: list) -> tuple[list, Callable[[list], list]]:
    """The step transport's packer (:func:`~remote_module.ps._steps.set_push_packer`): the
    tables' pushes (:class:`RowsPush`) to one server packed into one call (``_push_tables``:
    their ids and gradient rows in one tensor each, per row width) that runs them in order and
    answers each one's outcome, as the grouped calls would be run and answered; the other
    calls as they are. Returns the calls to send and ``unpack(their outcomes) -> each of
    calls' outcome``."""
    if len(calls) < 2:  # (nothing to pack: one call travels as it is)
        return calls, list
    packs = _packs(calls)
    packed = {i for members in packs.values() for i in members}
    sent = [call for i, call in enumerate(calls) if i not in packed]
    alone = len(sent)
    for (server, _, _, _), members in packs.items():
        pushes = [calls[i][2] for i in members]
        entries = [PackedEntry(p.name, p.trainer, p.step, p.ids.numel(), p.token) for p in pushes]
        sent.append((server, _handlers._push_tables, TablesPush(entries, torch.cat([p.ids for p in pushes]),
                                                                torch.cat([p.grad for p in pushes]))))

    def unpack(got: list) -> list:
        outcomes: list[Any] = [None] * len(calls)
        single = iter(got[:alone])
        for i in range(len(calls)):
            if i not in packed:
                outcomes[i] = next(single)
        for ((server, _, _, _), members), (ok, value) in zip(packs.items(), got[alone:]):
            for j, i in enumerate(members):
                if not ok:  # the message failed (a server down or late): every push it carried did
                    outcomes[i] = (False, value)
                elif value[j][0]:
                    outcomes[i] = (True, None)
                else:
                    outcomes[i] = (False, table_push_failure(server, calls[i][2].name, value[j][1]))
        return outcomes

    return sent, unpack


set_push_packer(pack_table_pushes)


def _joined(parts: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    """``parts`` in one tensor: the one part as it is, several concatenated, ``empty`` for none."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else empty


class TablePushes:
    """The pushes of :class:`~remote_module.ps.tables._embedding.ShardedEmbedding`'s steps (a
    part of it: it uses the table's servers, gradients and step count)."""

    def _settings_plans(self, settings: dict | None = None) -> list:
        """:attr:`ps_optimizer`'s settings for this step (``settings``: :meth:`_row_settings`,
        when the caller checked them already): geo, set in the local optimizer; else the plan
        that tells every server, when they changed (:func:`settings_plans`)."""
        settings = self._row_settings() if settings is None else settings
        if self._geo is not None:
            self._geo.optimizer = self._geo.optimizer._replace(**settings)
            return []
        return settings_plans(settings, self._sent_settings, self._server_names, _handlers._set_settings,
                              (self.name, self._trainer), self._settings_taken)

    def _settings_taken(self, settings: dict) -> None:
        """The servers took ``settings``: the next step sends them only if they change."""
        self._sent_settings = settings

    def _row_settings(self) -> dict:
        """The settings of :attr:`ps_optimizer` a row-wise optimizer takes (``lr``, and
        SparseAdam's ``betas``); ``ValueError`` for a momentum or weight decay a scheduler set,
        which the rows' optimizer cannot apply (as construction refuses them)."""
        settings = self.ps_optimizer.current_settings()
        last = self.__dict__.get("_row_settings_of")
        if last is not None and last[0] is settings:  # (the optimizer's settings as last time: checked then)
            return last[1]
        for key in ("momentum", "weight_decay"):
            if settings.get(key, 0.0) != 0.0:
                raise ValueError(f"table {self.name!r}: its ps_optimizer has {key}={settings[key]!r}, which a "
                                 f"sparse table's row-wise optimizer cannot apply; keep it 0 (OneCycleLR: "
                                 "cycle_momentum=False, or SparseAdam, whose betas cycle)")
        rows = {key: settings[key] for key in ("lr", "betas") if key in settings}
        set_plain(self, "_row_settings_of", (settings, rows))
        return rows

    def step(self) -> None:
        """Push the touched rows' gradients (only those rows) and forget them (geo: step the
        cached rows locally, push their deltas every ``geo_push_every`` steps).

        Without a gradient recorded since the last step (or since ``zero_grad()``) this is no
        optimizer step, as torch's optimizers skip a parameter whose ``.grad`` is ``None``
        (sync: the trainer still tells the servers, which wait for every trainer's step).

        A step that fails (a server did not answer in time) keeps the gradients, as a failed
        ``optimizer.step()`` keeps ``.grad``: call ``step()`` again to retry it (in sync mode a
        server that already has this step's push takes the retry as a no-op; in async and
        half_async the retry leaves out a server that answered that it applied its rows, unless
        a backward since recorded gradients: then it is a step there too, of the new rows or
        an empty one), or ``zero_grad()`` to drop them.

        In async, half_async and geo modes (and in sync mode after a :meth:`prefetch`) the
        pushes are sent and ``step()`` returns with them in flight (geo: the deltas' pushes,
        whose rows are dropped from the cache once they land); the next call on the table waits for
        them first (a lookup is sent once they were applied), and a push that failed raises
        there, naming its server, keeping the gradients for a retry as above."""
        with self._flight_lock:
            self._wait_pushes()  # the last step's (a failure raises here: call step() again to retry)
            settings = self._settings_plans()
            plan = self._push_plan()
            self.ps_optimizer.step()  # (as a local loop's optimizer.step(): what LR schedulers count)
            if plan is None:
                return
            sync = self.ps_mode == "sync"
            sent, joined = self._prefetches.send([*settings, plan], self.timeout, sync,
                                                  lambda name: self._step + 1)
            if joined or not sync:
                self._flight = Flight(sent, joined, names=[self.name])
            after = self._prefetches.take_after_step()
        for planned in after:  # (prefetching: later batches, planned while the servers work)
            planned()
        if not joined and sync:
            sent.settle()  # (sync waits for its push to be taken; a prefetch's lookup waits for the step)

    def _push_plan(self, taken: list | None = None) -> PushPlan | None:
        """:meth:`step` in parts: the host calls that push this step's gradients, what to do
        once they all succeeded, and what to do when they failed (keep the gradients for a
        retry); in geo mode it steps the cached rows here, and is the plan of their deltas'
        push every ``geo_push_every`` calls (:meth:`_geo_push_plan`), None otherwise. ``taken``:
        the gradients, taken already (:meth:`_take_for_step`)."""
        self._wait_pushes()
        if taken is None:
            taken = self._take_for_step()
        if len(taken) == 1 and isinstance(taken[0], BagsGradient) and self.ps_mode != "geo":
            return self._bags_push_plan(taken)
        ids_parts, grad_parts = [], []
        for uniq, g in map(row_gradients, taken):
            if self.padding_idx is None:
                ids_parts.append(uniq)
                grad_parts.append(g)
            else:
                keep = uniq != self.padding_idx
                ids_parts.append(uniq[keep])
                grad_parts.append(g[keep])
        has_grad = bool(taken)
        # (one lookup's gradient, the usual step, goes as it is: the push is pickled when sent)
        ids = _joined(ids_parts, torch.empty(0, dtype=torch.long))
        grad = _joined(grad_parts, torch.empty(0, self.embedding_dim))
        if self.ps_mode == "geo":  # (a plan only when this step pushes the deltas)
            return self._geo_step(ids, grad, has_grad)
        calls = []
        took = self._took  # (the retry of a step these servers applied already)
        for _, server, mine in self._by_server_of(ids):
            # every server hears of a step with a gradient (an empty push where it holds none of
            # its rows): it is one optimizer step of the whole table, as torch counts steps per
            # parameter (Adagrad's lr_decay, SparseAdam's bias correction); sync: every step,
            # without a gradient as None (the servers' step waits for every trainer)
            if server in took and not (has_grad and ids[mine].numel()):
                continue  # it applied this step: nothing to push there again (no step twice)
            if has_grad:
                calls.append((server, _handlers._push_rows,
                              RowsPush(self.name, self._trainer, self._step, ids[mine], grad[mine], self._token)))
            elif self.ps_mode == "sync":
                calls.append((server, _handlers._push_rows,
                              RowsPush(self.name, self._trainer, self._step, None, None, self._token)))
        pushes = [push for _, _, push in calls]
        pushing = bool(calls) and (self.ps_mode == "sync" or any(p.ids is not None for p in pushes))
        # counted as sent (a push retried after a failure is counted again)
        sent = sum(p.ids.numel() * p.ids.element_size() + p.grad.numel() * p.grad.element_size()
                   for p in pushes if p.ids is not None)
        return self._planned(calls, taken, pushing, sent)

    def _planned(self, calls: list, taken: list, pushing: bool, sent: int) -> PushPlan:
        """The plan of a step's push ``calls`` of the gradients ``taken`` (:meth:`_pushed`: what
        success and failure do), which learns the servers that applied theirs before a failure."""
        done, failed = self._pushed(taken, pushing, sent)
        took: list[str] = []

        def partly(oks: list[bool]) -> None:  # (before failed(): the servers that applied theirs)
            took[:] = [server for (server, _, _), ok in zip(calls, oks) if ok]

        return PushPlan(calls, done, partial(failed, took), partly=partly)

    def _bags_push_plan(self, taken: list) -> PushPlan:
        """:meth:`_push_plan` of one lookup's gradient in the bags' form (``taken``: its
        ``BagsGradient``): each server that lookup sent ids to gets them back with the gradient
        of the bags holding ids there (``_push_bags``: the server makes each position's
        gradient of them and applies it as :meth:`_push_plan`'s rows would be, summed per row
        in position order, or added position by position for SGD), every other server an
        empty push (a step all the same).
        A server that applied this step already (the retry of a failed step) is left out."""
        bags = taken[0]
        calls = []
        for k, server in enumerate(self._server_names):
            share = bags.shares.get(k)
            if share is None:
                if server not in self._took:
                    calls.append((server, _handlers._push_rows,
                                  RowsPush(self.name, self._trainer, self._step, torch.empty(0, dtype=torch.long),
                                           torch.zeros(0, self.embedding_dim), self._token)))
                continue
            ids, first = share
            grad = bags.grad
            if len(self._server_names) > 1:  # only the bags with ids there: traffic does not grow with the servers
                has = bag_ends(first, ids.numel())[1:] > first
                if not bool(has.all()):
                    first, grad = first[has], grad[has]
            calls.append((server, _handlers._push_bags,
                          BagsPush(self.name, self._trainer, self._step, ids, first, grad, self._token)))
        sent = 0
        for _, _, push in calls:
            if isinstance(push, BagsPush):
                sent += push.ids.nbytes + push.first.nbytes + push.grads.nbytes
        return self._planned(calls, taken, True, sent)

    def _pushed(self, taken: list, pushing: bool, sent: int) -> tuple[Callable[[], None], Callable[..., None]]:
        """A push of ``taken`` planned (``pushing``: it is a step of the table; ``sent``: its
        bytes): what to do once it succeeded (count the step) and when it failed, ``failed(took)``
        (keep the gradients for a retry; ``took``: the servers that answered that they applied
        their part, whose rows are not kept and which the retry leaves out: their step is done,
        so it is not applied there twice)."""
        def failed(took: Any = ()) -> None:
            kept = taken
            if took:
                applied = [self._server_names.index(s) for s in took]
                kept = []
                for uniq, rows in map(row_gradients, taken):
                    stay = ~torch.isin(self._server_of(uniq), torch.tensor(applied))
                    kept.append((uniq[stay], rows[stay]))
            with self._pending_lock:  # kept for a retry (or zero_grad), with any recorded meanwhile
                if took and not self._held:  # (a backward since makes the retry a step everywhere)
                    self._took = self._took | set(took)
                self._held = kept + self._held
                # back "on the parameter", as PSModel puts them: a zero_grad() that ran while the
                # push was in flight (a local optimizer's, which does not wait for it) came before
                # the failure was known, and must not drop them; a later one does
                if taken and self.grad_marker.grad is None:
                    self.grad_marker.grad = torch.zeros_like(self.grad_marker)

        if pushing:
            set_plain(self, "_pushes", self._pushes + 1)  # (a prefetch sent before misses it: PrefetchQueue.fresh)
        set_plain(self, "_pushed_bytes", self._pushed_bytes + sent)

        def done() -> None:
            set_plain(self, "_step", self._step + 1)
            if self._took:
                set_plain(self, "_took", frozenset())

        return done, failed

    def _geo_step(self, ids: torch.Tensor, grad: torch.Tensor, has_grad: bool) -> PushPlan | None:
        """geo: step the cached rows locally (an optimizer step only with a gradient:
        ``has_grad``); every ``geo_push_every`` calls push ``row - row when fetched`` for the
        rows cached since the last push, and drop them: a later lookup fetches the merged rows,
        so a push carries only the rows touched in its interval. Each row's local optimizer
        state stays (as a local sparse optimizer keeps it). Returns the push's plan
        (:meth:`_geo_push_plan`) when this call pushes, else None."""
        geo = self._geo
        geo.calls += 1
        if has_grad:
            uniq, summed = coalesce(ids, grad)
            evicted = geo.missing(uniq)
            if bool(evicted.any()):  # looked up before a push dropped them (a step() between forward and backward)
                with torch.no_grad():
                    self._rows_of(uniq[evicted])
            geo.step(uniq, summed)
        if geo.calls % self.geo_push_every == 0:
            return self._geo_push_plan()
        return None

    def _geo_flush_plan(self) -> PushPlan | None:
        """geo: the push of the deltas of the rows trained since the last push (as
        :meth:`flush` pushes them), None when there are none (or not geo)."""
        if self._geo is None or not self._geo.trained():
            return None
        return self._geo_push_plan()

    def _geo_push(self) -> None:
        """geo: push the deltas of every cached row now and drop them (their next lookup
        fetches the merged rows)."""
        plan = self._geo_push_plan()
        if plan is not None:
            run_push_plans([plan], self.timeout)

    def _geo_push_plan(self) -> PushPlan | None:
        """geo: the push of every cached row's delta (None with none cached), which drops those
        rows once the servers took it; a failed push keeps them (the next push carries their
        deltas again), server by server: the rows of a server that took its push are dropped
        (their deltas were added there: pushing them again would add them twice)."""
        geo = self._geo
        ids, deltas = geo.deltas()
        if not ids.numel():
            return None
        calls = []
        for _, server, mine in self._by_server_of(ids):
            part = ids[mine]
            if part.numel():
                calls.append((server, _handlers._push_row_deltas, RowDeltasPush(self.name, part, deltas[mine])))
        self._pushed_bytes += sum(p.ids.numel() * p.ids.element_size() + p.deltas.numel() * p.deltas.element_size()
                                  for _, _, p in calls)

        def partly(oks: list[bool]) -> None:
            taken = [push.ids for (_, _, push), ok in zip(calls, oks) if ok]
            if taken:
                geo.drop(torch.cat(taken))

        def done() -> None:
            geo.drop(ids)
            settled()

        def settled() -> None:
            geo.sending = torch.empty(0, dtype=torch.long)

        geo.sending = ids  # (until settled: a table dropped meanwhile counts them pushed)
        return PushPlan(calls, done, settled, partly=partly)
