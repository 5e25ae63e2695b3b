"""RemotePipeline: stages on several workers, micro-batches flowing host to host."""

from __future__ import annotations

import itertools
import math
import threading
import time
from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.futures import Future

from remote_module._core import (
    CallTimeout,
    answer_margin,
    before_rref_deletion_at_shutdown,
    call_async,
    positive_int,
    records_outside_context,
    retyped,
    send_and_forget,
    timeout_seconds,
    to_exception,
    unwarned_state,
    wait_for_earlier_calls,
    warn_untrained,
)
from remote_module.pipeline import _host
from remote_module.remote_module import RemoteModule
from rpc_backend.options import positive_seconds

_clock = time.monotonic
_runs = itertools.count(1)  # run ids, unique in this process (hosts key cancellations by caller + run)


class _Forwards:
    """The forwards running in this process, so that a graceful ``rpc.shutdown()`` answers them:
    it waits (each bounded by its deadline) before this process deletes its RRefs, which would
    free the stage modules on their hosts while micro-batches still run there."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._deadlines: dict[int, float] = {}  # run -> deadline (monotonic; math.inf: none)

    def started(self, run: int, deadline: float) -> None:
        with self._cond:
            self._deadlines[run] = deadline

    def ended(self, run: int) -> None:
        with self._cond:
            self._deadlines.pop(run, None)
            self._cond.notify_all()

    def wait_until_none(self) -> None:
        """Wait until no forward runs here, at most until the latest deadline among them."""
        with self._cond:
            while self._deadlines:
                remaining = max(self._deadlines.values()) + 1.0 - _clock()
                if remaining <= 0:
                    return
                self._cond.wait(min(remaining, 1.0))


_forwards = _Forwards()


#: The most micro-batches of one forward in flight at once (each waiting one holds an RPC
#: thread of its host; torch's default is 16 per process).
MAX_IN_FLIGHT = 12


def _window(stages: int) -> int:
    """Micro-batches in flight per forward: enough to keep every stage busy with one queued
    behind it at stage 0, and never more than :data:`MAX_IN_FLIGHT`."""
    return max(2, min(stages + 2, MAX_IN_FLIGHT))


def _checked_stage(index: int, item: Any) -> Any:
    if isinstance(item, RemoteModule):
        return item
    if isinstance(item, tuple) and len(item) == 4 and isinstance(item[0], str):
        return item
    raise TypeError(
        f"stages[{index}] must be a RemoteModule or a tuple (remote_device, module_cls, args, kwargs), "
        f"got {type(item).__name__}: {item!r}"
    )


def _batched(out: Any) -> bool:
    """Whether ``out`` is a last stage's output that concatenates on dim 0."""
    if isinstance(out, torch.Tensor):
        return out.dim() > 0
    return isinstance(out, tuple) and len(out) > 0 and all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in out)


def _described(out: Any) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor with {out.dim()} dimensions" if out.dim() == 0 else "a tensor"
    if isinstance(out, tuple):
        return "a tuple of " + ", ".join(
            type(t).__name__ if not isinstance(t, torch.Tensor) else f"tensor({t.dim()}-d)" for t in out
        )
    return type(out).__name__


def _concatenated(outputs: list[Any], where: str) -> Any:
    """The last stage's outputs (``where``: that stage and its worker) concatenated on dim 0."""
    if len(outputs) == 1:  # one micro-batch: returned as the stage returned it, as nn.Sequential
        return outputs[0]  # would (an LSTM's (output, (h, c)), a dict, a 0-d loss)
    first = outputs[0]
    for mb, out in enumerate(outputs):
        same = isinstance(out, torch.Tensor) if isinstance(first, torch.Tensor) else (
            isinstance(out, tuple) and isinstance(first, tuple) and len(out) == len(first)
        )
        if not _batched(out) or not same:
            raise TypeError(
                f"the last pipeline stage ({where}) must return, for every micro-batch, a tensor or a tuple "
                f"of tensors of the same arity, each with a batch dimension (they are concatenated over "
                f"micro-batches on dim 0); micro-batch {mb} of {len(outputs)} returned {_described(out)}"
                + ("" if mb == 0 else f" and micro-batch 0 {_described(first)}")
                + ": return a batch (e.g. per-sample values, not their sum) or use chunks=1"
            )
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs)
    return tuple(torch.cat(parts) for parts in zip(*outputs))


class RemotePipeline(nn.Module):
    """A model split into stages on several workers, run as a pipeline of micro-batches.

    ``forward(x)`` splits ``x`` on dim 0 into ``chunks`` micro-batches (as
    ``torch.tensor_split`` does: the last may be smaller; fewer when the batch is smaller than
    ``chunks``), sends each to stage 0's host and returns the last stage's outputs concatenated,
    equal to running the stages in order locally. Each stage's host runs one micro-batch at a
    time and sends its output straight to the next stage's host, so while stage 1 runs
    micro-batch i, stage 0 runs i+1; the caller sends only the micro-batches and receives only
    the last stage's output. A stage's output is passed on as the next stage's positional
    arguments (a tuple is unpacked; with ``unpack_tuples=False`` it is one argument, as
    ``nn.Sequential`` passes it). With several micro-batches the last stage returns a tensor or
    a tuple of tensors, each with a batch dimension; with one, whatever it returns is returned
    as is (an ``LSTM``'s ``(output, (h, c))``, as ``nn.Sequential`` returns it).
    Extra positional tensors (``forward(x, y)``) are split alike and given to stage 0.

    Stages run in the caller's grad mode. Inside ``dist_autograd.context()`` the whole chain is
    recorded: ``dist_autograd.backward`` reaches every stage's parameters, and
    ``DistributedOptimizer(opt, pipe.remote_parameters(), ...)`` steps them. Outside one
    nothing is recorded across RPC (``loss.backward()`` reaches no stage): a forward with grad
    enabled whose stages have trainable parameters (or whose inputs require grad) warns once
    per pipeline with a ``UserWarning`` saying what to do; under ``torch.no_grad()`` it is silent.

    It is an ``nn.Module`` whose children are the stage proxies (``pipe.stages``, an
    ``nn.ModuleList``): ``train()``/``eval()`` reach every stage and ``state_dict()`` keys are
    ``stages.<i>.<the stage module's own key>``.

    Failures: an exception raised in a stage's ``forward`` reaches the caller with its type,
    naming the stage index and its worker; a stage whose worker died or froze is named within
    ``timeout``. The micro-batches not yet run are then cancelled, and ``forward`` raises once
    every micro-batch is settled. A graceful ``rpc.shutdown()`` on the caller first lets the
    forwards running in its other threads finish (each bounded by its ``timeout``).
    ``dist_autograd.backward`` and ``DistributedOptimizer.step`` take no timeout in torch's API:
    the RPC agent's applies there.

    Args:
        stages: ``RemoteModule`` proxies, or tuples ``(remote_device, module_cls, args, kwargs)``
            from which proxies are created (concurrently).
        chunks: the number of micro-batches per forward.
        timeout: seconds one ``forward`` may take (``None``: the RPC agent's default). It also
            bounds the creation of stages given as tuples.
        unpack_tuples: whether a tuple a stage returns becomes the next stage's positional
            arguments (``True``) or its one argument (``False``, what ``split_sequential``
            uses: every cut then passes what ``nn.Sequential`` passes between its layers).

    Example (worker0 drives; worker1 and worker2 only join RPC and wait)::

        # worker1, worker2 (make_options: rpc_backend's, whose transport sleeps when idle):
        # rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=make_options())
        # rpc.shutdown()
        # worker0:
        pipe = RemotePipeline(
            [("worker1/cpu", nn.Linear, (16, 32), None), ("worker2/cpu", nn.Linear, (32, 4), None)],
            chunks=4,
        )
        with dist_autograd.context() as ctx:
            loss = pipe(torch.randn(64, 16)).sum()
            dist_autograd.backward(ctx, [loss])
    """

    def __init__(
        self, stages: Sequence[Any], chunks: int = 1, *, timeout: float | None = None, unpack_tuples: bool = True
    ) -> None:
        super().__init__()
        self._warned_untrained = False  # the one warning of training outside dist autograd (_core.untrained)
        chunks = positive_int(chunks, "chunks", wrong_type=ValueError,
                              message="{what} must be a positive int (micro-batches per forward), got {value!r}")
        if not isinstance(unpack_tuples, bool):
            raise TypeError(f"unpack_tuples must be True or False, got {unpack_tuples!r}")
        self.unpack_tuples = unpack_tuples
        self.timeout = None if timeout is None else positive_seconds(timeout, "timeout")
        self.chunks = chunks
        try:
            items = list(stages)
        except TypeError:
            raise TypeError(f"stages must be a list of RemoteModule or tuples, got {type(stages).__name__}") from None
        if not items:
            raise ValueError("a RemotePipeline needs at least one stage, got an empty list")
        items = [_checked_stage(i, item) for i, item in enumerate(items)]
        pending: dict[int, Future] = {}
        for i, item in enumerate(items):
            if isinstance(item, tuple):
                device, cls, args, kwargs = item
                pending[i] = RemoteModule.create_async(device, cls, args, kwargs, timeout=self.timeout)
        for i, fut in pending.items():  # all sent first, then awaited: one round trip in all
            try:
                items[i] = fut.wait()
            except Exception as exc:
                raise retyped(exc, f"creating pipeline stage {i} ({items[i][0]!r}) failed: {exc}") from exc
        self.stages = nn.ModuleList(items)

    def extra_repr(self) -> str:
        return f"chunks={self.chunks}"

    def __getstate__(self) -> dict:
        """As ``nn.Module``'s, less the once-warned flag: a copy sent over RPC warns on its own."""
        return unwarned_state(self)

    def remote_parameters(self, recurse: bool = True) -> list[rpc.RRef]:
        """RRefs of every stage's parameters, stage by stage, for ``DistributedOptimizer``.

        Example::

            from torch.distributed.optim import DistributedOptimizer

            opt = DistributedOptimizer(torch.optim.SGD, pipe.remote_parameters(), lr=0.05)
        """
        return [p for stage in self.stages for p in stage.remote_parameters(recurse)]

    def requires_grad_(self, requires_grad: bool = True) -> "RemotePipeline":
        """Set ``requires_grad`` of every stage's parameters on their hosts, as
        ``nn.Sequential.requires_grad_`` does for its layers, and return the pipeline.

        ``nn.Module.requires_grad_`` walks ``parameters()``, which holds each stage proxy's
        ``remote_requires_grad`` handle: that handle sets the stage's flag on its host, so a
        model holding the pipeline reaches the stages too (one message per stage).

        Example::

            pipe.requires_grad_(False)     # freeze every stage (e.g. a frozen feature extractor)
        """
        return super().requires_grad_(requires_grad)

    # ---- forward -----------------------------------------------------------------------

    def _seconds(self) -> float:
        """This pipeline's timeout in seconds (``math.inf``: none)."""
        return timeout_seconds(self.timeout)

    def forward(self, x: torch.Tensor, *more: torch.Tensor) -> Any:
        """Run the micro-batches of ``x`` (and ``more``, split alike) through the stages."""
        made = _clock()
        inputs = (x, *more)
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise TypeError(
                    f"RemotePipeline.forward takes tensors with a batch dimension (dim 0), got "
                    f"{'x' if i == 0 else f'more[{i - 1}]'} = {type(t).__name__}"
                    + (" with no dimensions" if isinstance(t, torch.Tensor) else "")
                )
        batch = inputs[0].shape[0]
        if any(t.shape[0] != batch for t in inputs):
            raise ValueError(
                f"every input must have the same size on dim 0 (the batch), got {[t.shape[0] for t in inputs]}"
            )
        for stage in self.stages:  # a flag set as p.requires_grad = flag over parameters()
            stage._sync_requires_grad()
        if records_outside_context(self, any(s.remote_trainable for s in self.stages), inputs):
            workers = ", ".join(repr(s.on) for s in self.stages)
            warn_untrained(self, f"RemotePipeline (stages on {workers})", "pipeline", "pipe")
        n = max(1, min(self.chunks, batch))
        micro = list(zip(*(torch.tensor_split(t, n) for t in inputs)))
        seconds = self._seconds()
        deadline = made + seconds
        wait_for_earlier_calls(self.stages, deadline, lambda i, stage: f"pipeline stage {i} on worker {stage.on!r}",
                               f"the pipeline's timeout ({seconds:g} s)")
        route = _host.Route(
            rpc.get_worker_info().name,
            next(_runs),
            tuple(_host.Stage(s.on, s._target().key, s.device) for s in self.stages),
            answer_margin(seconds),
            n,
            self.unpack_tuples,
        )
        # Here, not in __init__: a pipeline that arrived over RPC runs in a process where no
        # __init__ ran (registering again is a no-op).
        before_rref_deletion_at_shutdown(_forwards.wait_until_none)
        _host.open_inbox(route.run)
        _forwards.started(route.run, deadline)
        try:
            failures = self._run(route, micro, deadline)
        finally:
            outputs = _host.close_inbox(route.run)
            _forwards.ended(route.run)
        if failures:
            raise failures[0]
        missing = [i for i in range(n) if i not in outputs]
        if missing:  # cannot happen while the chain answers only after delivering
            raise RuntimeError(f"pipeline micro-batches {missing} were answered but never delivered")
        last = f"stage {len(route.stages) - 1} on worker {route.stages[-1].worker!r}"
        return _concatenated([outputs[i] for i in range(n)], last)

    def _run(self, route: _host.Route, micro: list[tuple], deadline: float) -> list[BaseException]:
        """Send every micro-batch, wait until all are settled; the failures, first one first."""
        n = len(micro)
        first = route.stages[0]
        grad = torch.is_grad_enabled()
        # Sent from this thread only: the distributed autograd context is this thread's.
        flight = _InFlight(route, n, _window(len(route.stages)), self._unanswered)
        while (mb := flight.next_to_send()) is not None:
            left = deadline - _clock()
            if left < 0.001:
                flight.record(False, CallTimeout(
                    f"pipeline micro-batch {mb} of {n} was not sent: the pipeline's timeout "
                    f"({self._seconds():g} s) ran out first"
                ))
                break
            try:
                fut = call_async(
                    first.worker,
                    _host._step,
                    (route, 0, mb, left - route.margin, grad, micro[mb]),
                    timeout=None if left == math.inf else left,  # None here: the agent's, which is none
                    label=f"pipeline micro-batch {mb} of {n} (stage 0 on worker {first.worker!r})",
                )
            except Exception as exc:  # not sent (RPC shut down meanwhile): the ones sent still settle
                flight.record(False, exc)
                break
            flight.sent(mb, fut)
        return flight.failures_once_settled()

    def _unanswered(self, worker: str, mb: int, n: int, exc: BaseException) -> BaseException:
        """The error for a micro-batch whose call to stage 0 itself failed: stage 0's host did
        not answer in time (later stages' failures are reported by the stage before them,
        earlier), or could not be reached (dead, or RPC shut down)."""
        what = f"pipeline stage 0 on worker {worker!r}"
        if isinstance(exc, CallTimeout):
            error: BaseException = CallTimeout(
                f"{what} did not answer micro-batch {mb} of {n} within the pipeline's timeout "
                f"({self._seconds():g} s)"
            )
        else:
            reason = exc.__cause__ if exc.__cause__ is not None else exc  # the RPC's own error
            error = retyped(exc, f"{what} could not be reached with micro-batch {mb} of {n}: {reason}")
        error.__cause__ = exc
        return error


class _InFlight:
    """The micro-batches of one forward between their sending and their settling.

    At most ``window`` are in flight: a micro-batch waiting for its turn holds one of its
    host's RPC threads, and a host whose threads all wait could not take the answers and
    cancellations that free them. Failures are kept in the order they came, each marked as a
    cancellation or not; the first one stops the sending and cancels the run on every stage's
    host (once).
    """

    def __init__(self, route: _host.Route, n: int, window: int,
                 unanswered: Callable[[str, int, int, BaseException], BaseException]) -> None:
        self.route, self.n, self.window = route, n, window
        self._unanswered = unanswered
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._failures: list[tuple[bool, BaseException]] = []  # (was it a cancellation, error), by time
        self._cancelled = False
        self._next = 0
        self._outstanding = 0

    def next_to_send(self) -> int | None:
        """The next micro-batch to send, once a slot is free; None when all were sent or the
        run failed."""
        with self._changed:
            while not self._cancelled and self._outstanding >= self.window:
                self._changed.wait()
            if self._cancelled or self._next >= self.n:
                return None
            mb, self._next = self._next, self._next + 1
            return mb

    def sent(self, mb: int, fut: Future) -> None:
        """Micro-batch ``mb`` was sent: ``fut`` settles it."""
        with self._changed:
            self._outstanding += 1
        fut.add_done_callback(partial(self._settled, mb))

    def _settled(self, mb: int, fut: Future) -> None:
        try:
            try:
                value = fut.value()
                if value is None:
                    return
                index, worker, failure, was_cancel = value
                where = f"in pipeline stage {index} on worker {worker!r} (micro-batch {mb} of {self.n})"
                error = to_exception(failure, where)
            except BaseException as exc:  # stage 0 unreachable, or the caller's own timeout
                was_cancel, error = False, self._unanswered(self.route.stages[0].worker, mb, self.n, exc)
            self.record(was_cancel, error)
        finally:  # a failure is recorded before the sender sees a free slot
            with self._changed:
                self._outstanding -= 1
                self._changed.notify_all()

    def record(self, was_cancel: bool, error: BaseException) -> None:
        """A failure; the first one cancels the run on every stage's host."""
        with self._lock:
            self._failures.append((was_cancel, error))
            first_failure, self._cancelled = not self._cancelled, True
        if first_failure:
            for worker in {s.worker for s in self.route.stages}:
                send_and_forget(worker, _host._cancel, (self.route.caller, self.route.run), timeout=5)

    def failures_once_settled(self) -> list[BaseException]:
        """Wait until every sent micro-batch settled (each by its deadline at the latest); the
        failures, those that are not cancellations first."""
        with self._changed:
            while self._outstanding > 0:
                self._changed.wait()
            real = [e for was_cancel, e in self._failures if not was_cancel]
            return real or [e for _, e in self._failures]
