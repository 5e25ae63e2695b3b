"""The least a prefetched training step of a sharded bag table can do, written plainly for
``bench_step_cpu``: the bound of what the step's work itself costs each side, beside the
library's step and the anchor's.

Two forms, each a step of ``bench_embedding``'s job (sum bags, SGD, one server, async, the next
batch's lookup sent with this step's push in one call, answered once the push is applied):

- :class:`TrainerRows` (the form the library uses): the trainer deduplicates the ids, computes
  the unique rows' gradients in backward and sends them; the server adds them and pools the
  next lookup.
- :class:`ServerRows`: the trainer sends the pooled bags' gradient; the server adds each
  position's gradient to its row, for the lookup it answered last (its ids and bags; as local
  sparse SGD does, with no deduplication), and pools the next.

Each checks the ids it sends (in range) and records its output for backward with one autograd
node, as any correct step must; nothing else (no retries, no failure handling, no modes, no
checks of the offsets). The server keeps each form's rows in this module (:data:`_TABLES`).

:class:`Contract` is the bags' form plus what the library promises of every step beyond the
work, each done the least way: the next batch's ids and offsets copied when its lookup is sent
and compared at its forward (a prefetch is used only for equal arguments: the caller may change
them in place meanwhile), a deadline per message on the library's watcher (a late server is
named within the call's timeout; sent with no timer of torch's), the push carrying its lookup's
ids and the trainer's step and token (a retry is not applied twice), every answer ``(ok, value)``
(a server's error caught and sent back), the gradient held until its push lands (a failed push
keeps it for a retry), a post-accumulate hook on the marker (what one backward recorded counts until
``zero_grad()``), and the servers' optimizer's settings read and its ``step()`` called (LR
schedulers read and count them)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

from remote_module._core import schedule
from remote_module.ps._optimizer import PSOptimizer
from remote_module.ps.tables.server._pooling import check_ids

_TABLES: dict[str, dict[str, Any]] = {}


def _start(name: str, weight: torch.Tensor, lr: float) -> None:
    """(On the server) a form's rows, ``weight``, trained with SGD at ``lr``."""
    _TABLES[name] = {"weight": weight, "lr": lr, "last": None}


def _weight(name: str) -> torch.Tensor:
    return _TABLES[name]["weight"]


def _forget(name: str) -> None:
    _TABLES.pop(name, None)


def _pooled(table: dict, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    ids = ids.long()
    table["last"] = (ids, offsets)
    return nn.functional.embedding_bag(ids, table["weight"], offsets, mode="sum")


def _trainer_rows_step(name: str, uniq: torch.Tensor | None, rows: torch.Tensor | None, ids: torch.Tensor,
                       offsets: torch.Tensor) -> torch.Tensor:
    """(On the server) add the rows' gradients ``rows`` of ``uniq`` (SGD), then pool ``ids``."""
    table = _TABLES[name]
    if uniq is not None:
        table["weight"].index_add_(0, uniq, rows * -table["lr"])  # (index_add_'s alpha takes a slow path)
    return _pooled(table, ids, offsets)


def _server_rows_step(name: str, grad: torch.Tensor | None, ids: torch.Tensor,
                      offsets: torch.Tensor) -> torch.Tensor:
    """(On the server) SGD on the rows of the last lookup from its bags' gradient ``grad``, then
    pool ``ids``. Each position's gradient (times the lr) is added to its row in position order,
    as a local ``nn.EmbeddingBag(sparse=True)`` + ``torch.optim.SGD`` adds its uncoalesced
    sparse gradient (up to float rounding), so no deduplication is needed."""
    table = _TABLES[name]
    if grad is not None:
        last, last_offsets = table["last"]
        bags = torch.searchsorted(last_offsets, torch.arange(last.numel()), right=True) - 1
        table["weight"].index_add_(0, last, grad.index_select(0, bags) * -table["lr"])
    return _pooled(table, ids, offsets)


def _contract_step(name: str, step: int, token: str, push: tuple | None, ids: torch.Tensor,
                   offsets: torch.Tensor) -> tuple[bool, Any]:
    """(On the server) :class:`Contract`'s call: the push ``(ids, offsets, grad)`` of the last
    lookup it made (sent back with it, as the library's pushes carry their ids), applied once
    per ``step`` of the trainer ``token`` (a retry of an applied step is not applied again), then
    the lookup of ``ids``; answered ``(ok, value)``, every error caught (as the library's
    handlers answer, keeping the error's type for the trainer)."""
    try:
        table = _TABLES[name]
        if push is not None and table.get("applied", {}).get(token, -1) < step:
            last, last_offsets, grad = push
            last = last.long()
            bags = torch.searchsorted(last_offsets, torch.arange(last.numel()), right=True) - 1
            table["weight"].index_add_(0, last, grad.index_select(0, bags) * -table["lr"])
            table.setdefault("applied", {})[token] = step
        return True, _pooled(table, ids, offsets)
    except BaseException as exc:  # noqa: BLE001 - answered, as the library's handlers answer
        return False, exc


def _checked(ids: torch.Tensor, rows: int) -> torch.Tensor:
    """``ids`` checked in range (the library's check) and as they travel (int32)."""
    check_ids(ids, rows)
    return ids.to(torch.int32)


class _RowsGradient(torch.autograd.Function):
    """The pooled bags, whose backward computes the unique rows' gradients (kept on ``into``)."""

    @staticmethod
    def forward(ctx: Any, marker: torch.Tensor, pooled: torch.Tensor, inverse: torch.Tensor, bags: torch.Tensor,
                into: dict) -> torch.Tensor:
        ctx.save_for_backward(inverse, bags)
        ctx.into = into
        return pooled.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        inverse, bags = ctx.saved_tensors
        ctx.into["rows"] = torch.zeros(ctx.into["unique"], grad.shape[1]).index_add_(
            0, inverse, grad.index_select(0, bags))
        return torch.zeros(0), None, None, None, None


class _BagsGradient(torch.autograd.Function):
    """The pooled bags, whose backward keeps their gradient on ``into``."""

    @staticmethod
    def forward(ctx: Any, marker: torch.Tensor, pooled: torch.Tensor, into: dict) -> torch.Tensor:
        ctx.into = into
        return pooled.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.into["bags"] = grad
        return torch.zeros(0), None, None


class _Form:
    """A form's trainer side on ``server``: its rows start as ``weight``."""

    def __init__(self, name: str, server: str, weight: torch.Tensor, lr: float) -> None:
        self.name, self.server, self.rows = name, server, weight.shape[0]
        rpc.rpc_sync(server, _start, args=(name, weight, lr))
        self.marker = torch.zeros(0, requires_grad=True)
        self.answer: Any = None  # the next forward's lookup, in flight

    def weight(self) -> torch.Tensor:
        return rpc.rpc_sync(self.server, _weight, args=(self.name,))

    def close(self) -> None:
        rpc.rpc_sync(self.server, _forget, args=(self.name,))


class TrainerRows(_Form):
    """The trainer computes the unique rows' gradients and pushes them (the library's form)."""

    def __init__(self, name: str, server: str, weight: torch.Tensor, lr: float) -> None:
        super().__init__(name, server, weight, lr)
        self.got: dict[str, Any] = {}
        self.plan: tuple | None = None

    def _plan(self, ids: torch.Tensor, offsets: torch.Tensor) -> tuple:
        wire = _checked(ids, self.rows)
        uniq, inverse = torch.unique(ids, return_inverse=True)
        bags = torch.searchsorted(offsets, torch.arange(ids.numel()), right=True) - 1
        return wire, uniq, inverse, bags

    def train(self, batch: tuple, upcoming: tuple) -> float:
        ids, offsets, target = batch
        if self.answer is None:  # (the first step sends its own lookup)
            self.plan = self._plan(ids, offsets)
            self.answer = rpc.rpc_async(self.server, _trainer_rows_step, args=(self.name, None, None, self.plan[0],
                                                                                offsets))
        _, uniq, inverse, bags = self.plan
        self.got["unique"] = uniq.numel()
        out = _RowsGradient.apply(self.marker, self.answer.wait(), inverse, bags, self.got)
        loss = ((out - target) ** 2).sum() / out.shape[1]
        loss.backward()
        self.plan = self._plan(upcoming[0], upcoming[1])
        self.answer = rpc.rpc_async(self.server, _trainer_rows_step,
                                    args=(self.name, uniq, self.got.pop("rows"), self.plan[0], upcoming[1]))
        return loss.item()

    def flush(self) -> None:
        """Wait for the last push (it lands with the lookup it carries)."""
        if self.answer is not None:
            self.answer.wait()


class ServerRows(_Form):
    """The trainer pushes the pooled bags' gradient; the server computes the rows'."""

    def __init__(self, name: str, server: str, weight: torch.Tensor, lr: float) -> None:
        super().__init__(name, server, weight, lr)
        self.got: dict[str, Any] = {}

    def train(self, batch: tuple, upcoming: tuple) -> float:
        ids, offsets, target = batch
        if self.answer is None:
            self.answer = rpc.rpc_async(self.server, _server_rows_step,
                                        args=(self.name, None, _checked(ids, self.rows), offsets))
        out = _BagsGradient.apply(self.marker, self.answer.wait(), self.got)
        loss = ((out - target) ** 2).sum() / out.shape[1]
        loss.backward()
        self.answer = rpc.rpc_async(self.server, _server_rows_step,
                                    args=(self.name, self.got.pop("bags"), _checked(upcoming[0], self.rows),
                                          upcoming[1]))
        return loss.item()

    def flush(self) -> None:
        if self.answer is not None:
            self.answer.wait()


class _Deadline:
    """A message's answer, or its deadline: the first to come settles :attr:`future`, which the
    forward waits on (so a late server fails the wait within the timeout, as the library's
    calls do). The watcher holds it weakly; the answer's callback holds it until then."""

    def __init__(self, sent: Any, seconds: float) -> None:
        self.future: torch.futures.Future = torch.futures.Future()
        self.lock = threading.Lock()
        sent.add_done_callback(self.answered)
        schedule(time.monotonic() + seconds, self)

    def answered(self, sent: Any) -> None:
        with self.lock:
            if self.future.done():
                return
            try:
                self.future.set_result(sent.value())
            except BaseException as exc:  # noqa: BLE001 - the failure is the wait's
                self.future.set_exception(exc)

    def expire(self, now: float) -> None:
        with self.lock:
            if not self.future.done():
                self.future.set_exception(TimeoutError("bound: the server did not answer in time"))


class Contract(ServerRows):
    """The bags' form with the library's per-step promises (see the module docstring)."""

    def __init__(self, name: str, server: str, weight: torch.Tensor, lr: float, timeout: float = 120.0) -> None:
        super().__init__(name, server, weight, lr)
        self.timeout = timeout
        self.optimizer = PSOptimizer([self.marker], {"lr": lr}, "bound")
        self.settings: dict | None = None  # last sent (the bench never changes them)
        self.kept: tuple | None = None  # the copies of the arguments of the lookup in flight
        self.sent: tuple | None = None  # that lookup's ids as sent and its offsets, for its push
        self.pending: tuple | None = None  # the push in flight, until it lands (a failure keeps it)
        self.held: torch.Tensor | None = None  # what the last backward recorded
        self.step, self.token = 0, uuid.uuid4().hex
        self.marker.register_post_accumulate_grad_hook(self._backward_done)

    def _backward_done(self, marker: torch.Tensor) -> None:
        self.held = self.got.pop("bags", None)

    def _send(self, push: tuple | None, ids: torch.Tensor, offsets: torch.Tensor) -> None:
        self.kept = (ids.clone(), offsets.clone())
        self.pending = push
        wire = _checked(ids, self.rows)
        self.sent = (wire, self.kept[1])
        sent = rpc.rpc_async(self.server, _contract_step, args=(self.name, self.step, self.token, push, wire, offsets),
                             timeout=0)  # (no torch timer: the deadline is the watcher's, as the library's)
        self.answer = _Deadline(sent, self.timeout).future

    def train(self, batch: tuple, upcoming: tuple) -> float:
        ids, offsets, target = batch
        if self.answer is None:
            self._send(None, ids, offsets)
        kept_ids, kept_offsets = self.kept
        if not (ids.dtype == kept_ids.dtype and ids.shape == kept_ids.shape and torch.equal(ids, kept_ids)
                and offsets.shape == kept_offsets.shape and torch.equal(offsets, kept_offsets)):
            raise AssertionError("bound: a forward of other arguments than its lookup's")
        ok, pooled = self.answer.wait()
        if not ok:
            raise pooled  # (a failed push: it stays pending, for a retry)
        if self.pending is not None:
            self.step += 1
        self.pending = None
        out = _BagsGradient.apply(self.marker, pooled, self.got)
        loss = ((out - target) ** 2).sum() / out.shape[1]
        loss.backward()
        settings = self.optimizer.current_settings()
        if settings != self.settings:
            self.settings = settings
        self.optimizer.step()
        grad, self.held = self.held, None
        self._send(None if grad is None else (*self.sent, grad), upcoming[0], upcoming[1])
        return loss.item()
