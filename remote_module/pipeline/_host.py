"""The RPC handlers of a pipeline: a stage's host runs one micro-batch and hands the output on.

A micro-batch travels as a chain of calls. The caller calls stage 0's host with
:func:`_step`; that host runs its module on the micro-batch and calls stage 1's host with the
output (``_step`` again), and so on; the last stage's host calls the caller back with
:func:`_deliver`, which leaves the output in the caller's inbox. An intermediate activation
therefore goes from host to host and never through the caller. Each call is answered only when
the rest of the chain has been (the handlers are ``async_execution``), with ``None`` or a
:data:`Failure` naming the stage that failed, so the caller's one call per micro-batch says
how the whole chain went.

Inside a ``dist_autograd.context()`` every hop is an RPC carrying tensors, which torch
records, so ``dist_autograd.backward`` runs back along the chain.

What each stage keeps:

- **one micro-batch at a time, in micro-batch order** (:class:`_Turns`, one per module): the
  micro-batches of a forward queue on stage 0 while later stages run the earlier ones, which
  is how they overlap. They arrive on concurrent handler threads, in any order; a stage
  admits micro-batch i of a forward only after micro-batch i-1 (so a stateful stage, e.g.
  BatchNorm's running statistics, sees them as a local model would), different forwards
  first come first served;
- **the deadline**: every hop carries the seconds left. A host gives the next hop what is left
  minus a margin and waits for its answer half a margin longer than that, so a frozen or dead
  stage is reported, by name, by the stage before it, before the caller's own timeout fires;
- **cancellation**: after a failure the caller marks the run cancelled on every stage's host
  (:func:`_cancel`); micro-batches still waiting for their turn fail at once instead of running.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import Any, NamedTuple

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from remote_module._core import (
    CallTimeout,
    HostStore,
    RemoteFailure,
    capture,
    device_map_to,
    host_device,
    hosted_module,
    move_cpu_tensors,
    rpc_timeout_argument,
    tensors_to_cpu,
)

_clock = time.monotonic


class Stage(NamedTuple):
    """A stage as the hosts address it: its worker, its module's key there, its device."""

    worker: str
    key: Any  # an int (remote_module._core.store), or the RRef of a scripted module
    device: str


class Route(NamedTuple):
    """What every hop of one forward carries: who called, which run, the stages, the margin."""

    caller: str
    run: int
    stages: tuple[Stage, ...]
    margin: float  # seconds each hop keeps back for its answer to travel
    micro_batches: int  # in this forward
    unpack: bool = True  # a stage's tuple output is the next stage's arguments (False: its one argument)


#: A failed chain: (stage index, worker, what was raised there, whether it was a cancellation).
Failure = tuple[int, str, RemoteFailure, bool]


class Cancelled(RuntimeError):
    """A micro-batch not run because another one of the same forward had failed."""


# ---- one micro-batch at a time per stage -----------------------------------------------


class _Waiter:
    __slots__ = ("key", "mb")

    def __init__(self, key: tuple, mb: int) -> None:
        self.key, self.mb = key, mb


class _Turns:
    """A module's lock for micro-batches: one at a time; those of one stage of one forward in
    micro-batch order, different forwards first come first served; a wait ends at a deadline
    or when its forward is cancelled."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: list[_Waiter] = []  # in arrival order
        self._busy = False
        # (caller, run, stage index) -> the micro-batch whose turn it is (absent: 0)
        self._next: collections.OrderedDict[tuple, int] = collections.OrderedDict()

    def _first_ready(self) -> _Waiter | None:
        for waiter in self._queue:
            if self._next.get(waiter.key, 0) == waiter.mb:
                return waiter
        return None

    def enter(self, route: Route, index: int, mb: int, deadline: float) -> bool:
        """Wait until micro-batch ``mb`` may run stage ``index`` of ``route``'s forward: the
        module is free and micro-batch ``mb - 1`` has had its turn. False when ``deadline``
        (monotonic) passed or the forward was cancelled first (see :func:`_is_cancelled`)."""
        me = _Waiter((route.caller, route.run, index), mb)
        with self._cond:
            self._queue.append(me)
            while True:
                # A cancelled forward is refused even when it is its turn: admitting it would
                # record its next micro-batch's turn, which no one would ever take or forget.
                if _is_cancelled(route.caller, route.run) or deadline - _clock() <= 0:
                    self._queue.remove(me)
                    self._cond.notify_all()
                    return False
                if not self._busy and self._first_ready() is me:
                    break
                self._cond.wait(min(deadline - _clock(), 3600.0))
            self._queue.remove(me)
            self._busy = True
            if mb + 1 < route.micro_batches:
                self._next[me.key] = mb + 1
                self._next.move_to_end(me.key)
                while len(self._next) > _CANCELLED_KEPT:  # forwards that stopped here without a cancel
                    self._next.popitem(last=False)
            else:
                self._next.pop(me.key, None)
            return True

    def leave(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def cancel(self, caller: str, run: int) -> None:
        """Forget ``run``'s order here and wake its waiters (they see it cancelled)."""
        with self._cond:
            for key in [k for k in self._next if k[:2] == (caller, run)]:
                del self._next[key]
            self._cond.notify_all()


_turns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> _Turns
# A scripted module reaches Python as a new wrapper on every lookup; its turns are kept by the
# TorchScript object's hash (equal for every wrapper of it), for the life of the process.
_script_turns: dict[int, _Turns] = {}
_turns_lock = threading.Lock()


def _module_and_turns(key: Any) -> tuple[Any, _Turns]:
    """The stage's module (see remote_module._core.hosted_module) and its turns."""
    module = hosted_module(key)
    with _turns_lock:
        if isinstance(key, rpc.PyRRef):
            table: Any = _script_turns
            ident: Any = hash(key.local_value())
        else:
            table, ident = _turns, module
        turns = table.get(ident)
        if turns is None:
            turns = table[ident] = _Turns()
    return module, turns


# ---- cancelled runs --------------------------------------------------------------------

_CANCELLED_KEPT = 4096  # the most recent cancellations this host remembers
_cancelled: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
_cancelled_lock = threading.Lock()


def _cancel(caller: str, run: int) -> None:
    """Handler: micro-batches of ``run`` that have not started on this host will not."""
    with _cancelled_lock:
        _cancelled[(caller, run)] = None
        while len(_cancelled) > _CANCELLED_KEPT:
            _cancelled.popitem(last=False)
    with _turns_lock:
        every = [*_turns.values(), *_script_turns.values()]
    for turns in every:
        turns.cancel(caller, run)


def _is_cancelled(caller: str, run: int) -> bool:
    with _cancelled_lock:
        return (caller, run) in _cancelled


# ---- running a stage -------------------------------------------------------------------


def _portable(out: Any, device: torch.device, dest: str) -> Any:
    """``out`` as it may travel to ``dest``: tensors off the CPU only where a device map to
    ``dest`` is set (RPC refuses them otherwise), else on the CPU."""
    if device.type == "cpu" or device_map_to(dest):
        return out
    return tensors_to_cpu(out)


def _as_arguments(out: Any, unpack: bool = True) -> tuple:
    """A stage's output as the next stage's positional arguments: a tuple unpacked when
    ``unpack``, else the output as one argument (what ``nn.Sequential`` passes on)."""
    return out if unpack and isinstance(out, tuple) else (out,)


def _run_stage(route: Route, index: int, mb: int, deadline: float, grad: bool, args: tuple) -> Any:
    stage = route.stages[index]
    module, turns = _module_and_turns(stage.key)
    if not turns.enter(route, index, mb, deadline):
        if _is_cancelled(route.caller, route.run):
            raise Cancelled(f"micro-batch {mb} was cancelled: another micro-batch of this forward failed")
        raise CallTimeout(
            f"micro-batch {mb} waited for its turn on pipeline stage {index} (worker {stage.worker!r}) "
            "until its deadline: the stage was busy with, or waiting for, earlier micro-batches"
        )
    try:
        if _is_cancelled(route.caller, route.run):
            raise Cancelled(f"micro-batch {mb} was cancelled: another micro-batch of this forward failed")
        device = host_device(stage.device)
        args = move_cpu_tensors(args, device)  # as a proxy's call does: at any depth
        with torch.set_grad_enabled(grad):
            return module(*args)
    finally:
        turns.leave()


def _failed(index: int, worker: str, exc: BaseException) -> Failure:
    return (index, worker, capture(exc), isinstance(exc, Cancelled))


# ---- handlers --------------------------------------------------------------------------


@rpc.functions.async_execution
def _step(route: Route, index: int, mb: int, budget: float, grad: bool, args: tuple) -> Future:
    """Handler: run stage ``index`` on micro-batch ``mb``, then hand the output on.

    Answered with ``None`` when the rest of the chain succeeded, else with a :data:`Failure`.
    ``budget`` is the seconds this stage and the rest of the chain may take.
    """
    answer: Future = Future()
    deadline = _clock() + budget
    worker = route.stages[index].worker
    try:
        out = _run_stage(route, index, mb, deadline, grad, args)
        last = index + 1 == len(route.stages)
        dest = route.caller if last else route.stages[index + 1].worker
        out = _portable(out, host_device(route.stages[index].device), dest)
    except BaseException as exc:  # the stage's own failure, whatever it is
        answer.set_result(_failed(index, worker, exc))
        return answer
    if last:  # a failed delivery is reported as this stage's: the caller is no stage
        what, blame, blamed = f"the caller {dest!r} (delivering micro-batch {mb})", index, worker
        handler, hop_args = _deliver, (route.run, mb, out)
    else:
        what, blame, blamed = f"pipeline stage {index + 1} on worker {dest!r}", index + 1, dest
        handler = _step
    left = deadline - _clock() - route.margin
    if left <= 0:  # the time ran out here, waiting for the turn or running: this stage is named
        late = CallTimeout(
            f"pipeline stage {index} on worker {worker!r} finished micro-batch {mb} too late to hand it "
            f"on to {what}: the pipeline's timeout ran out"
        )
        answer.set_result(_failed(index, worker, late))
        return answer
    if not last:
        hop_args = (route, index + 1, mb, left, grad, _as_arguments(out, route.unpack))
    wait = left + route.margin / 2
    try:
        sent = rpc.rpc_async(dest, handler, hop_args, timeout=rpc_timeout_argument(wait))
    except BaseException as exc:  # nothing was sent (e.g. an output that does not pickle)
        answer.set_result(_failed(index, worker, exc))
        return answer
    give_up = _clock() + wait

    def settle(fut: Future) -> None:
        try:
            answer.set_result(fut.value())
        except BaseException as exc:  # the hop itself failed: dead or frozen host, shutdown
            if _clock() >= give_up - 0.05:
                failure: BaseException = CallTimeout(f"{what} did not answer micro-batch {mb} within {wait:.3g} s")
            else:
                failure = RuntimeError(f"{what} could not be reached with micro-batch {mb}: {exc}")
            answer.set_result(_failed(blame, blamed, failure))

    sent.add_done_callback(settle)
    return answer


# ---- the caller's inbox ----------------------------------------------------------------

#: The outputs of each open run, by run, then micro-batch (strong entries, popped at the end).
_inbox = HostStore()


def open_inbox(run: int) -> None:
    """Caller side: accept the outputs of ``run``."""
    _inbox.put(run, {})


def close_inbox(run: int) -> dict[int, Any]:
    """Caller side: the outputs of ``run`` by micro-batch; later deliveries are dropped."""
    return _inbox.pop(run, {})


def _deliver(run: int, mb: int, out: Any) -> None:
    """Handler on the caller: the last stage's output for micro-batch ``mb`` of ``run`` (under
    the inbox's lock, so that a run closed meanwhile never sees it)."""
    _inbox.update(run, lambda box: box.__setitem__(mb, out))
