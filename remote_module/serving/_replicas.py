"""``ReplicatedModule``: one module served from several hosts, with failover.

The module is built on the first replica and its state copied to the others (so replicas are
equal because they were loaded, never because seeds agreed). A call goes to the live replica
with the fewest calls outstanding; what happens to it then:

- **a replica lost** (its process killed: the connection resets, and its calls in flight fail
  with an RPC error rather than an answer): the replica is dropped for good (the world is
  static) and the call is sent to another, within the call's own timeout;
- **a replica frozen** (no answer): once a call to it has waited ``hedge_ms``, the replica is
  set aside (no new calls go to it) and the call is also sent to another; the first answer
  wins. The replica is taken back as soon as any call to it answers (a thawed process answers
  the calls it was sent), or a probe does: a set-aside replica is probed until it answers;
- **the module raised**: that is the call's answer (every replica holds the same state, so
  another would raise the same): it is raised, and the call is not sent again.

Only inference is served: a call made with grad on, or in a process with a distributed
autograd context alive, raises ``RuntimeError`` (it would train one replica and leave the
others behind) and sends nothing.
"""

from __future__ import annotations

import inspect
import math
import threading
import time
import warnings
import weakref
from typing import Any, Sequence

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.futures import Future

from remote_module._core import (
    CallTimeout,
    dist_autograd_contexts_exist,
    map_tensors,
    register_rpc_reducer,
    schedule,
    settle_elsewhere,
)
from remote_module._proxy import checked_policy
from remote_module.remote_module import RemoteModule

_clock = time.monotonic

#: seconds between probes of a set-aside replica (each probe waits this long for its answer)
PROBE_S = 1.0
#: the hedge delay when none is given
DEFAULT_HEDGE_MS = 200.0

_INFERENCE_ONLY = (
    "ReplicatedModule serves inference: call it under torch.no_grad() (or inference mode), outside "
    "distributed autograd. A call that records gradients would train one replica and leave the "
    "others behind; train a RemoteModule and load its state_dict into the replicas instead."
)


def _probe() -> bool:
    """(On a replica's host) answers at once: the replica's process runs."""
    return True


class _Replica:
    """One replica: its proxy, whether it is lost or set aside, and its calls in flight."""

    __slots__ = ("proxy", "index", "lost", "late", "late_since", "outstanding", "probing")

    def __init__(self, proxy: RemoteModule, index: int) -> None:
        self.proxy, self.index = proxy, index
        self.lost: str | None = None  # why it was dropped
        self.late = False  # set aside: a call to it waited hedge_ms
        self.late_since = 0.0  # when it was set aside: only an answer to an RPC sent since takes it back
        self.outstanding = 0
        self.probing = False


class _Call:
    """One call to the replicated module: its arguments, deadline, the replicas tried, and the
    caller's Future; ``expire`` (the watcher's) hedges or times it out."""

    def __init__(self, owner: ReplicatedModule, args: tuple, kwargs: dict, timeout: float) -> None:
        self.owner, self.args, self.kwargs = owner, args, kwargs
        self.made = _clock()
        self.deadline = self.made + timeout
        self.timeout = timeout
        self.future: Future = Future()
        self.tried: list[_Replica] = []
        self.in_flight = 0
        self.done = False
        self.hedge_at = math.inf
        self.errors: list[str] = []

    def expire(self, now: float) -> None:
        self.owner._expire(self, now)


class ReplicatedModule(nn.Module):
    """``module_cls(*args, **kwargs)`` on every worker of ``replicas`` (``"worker/device"``
    strings, as ``RemoteModule`` takes), served with failover (see
    :mod:`remote_module.serving._replicas`).

    Args:
        replicas: where the replicas live, one per worker (at least one).
        module_cls, args, kwargs: as ``RemoteModule`` takes them.
        timeout: seconds allowed for each call, whatever replicas it tries (None: the RPC
            agent's default), and for the replicas' own calls (state, train/eval).
        hedge_ms: how long a call waits for a replica before it is also sent to another and
            the replica is set aside (default 200 ms: well above a forward's usual time;
            choose about a few times your p99).
        batching: a :class:`~remote_module.BatchPolicy`: every replica joins concurrent calls.

    ``forward`` blocks; ``forward_async`` returns a ``torch.futures.Future``. ``state_dict()``
    returns the replicas' state (checked equal on every live replica; ``RuntimeError`` naming
    the first that differs), ``load_state_dict`` loads it into every live replica,
    ``train()``/``eval()`` reach every live replica. ``replica_states()`` says which replicas
    are live, set aside or lost, and why. Sent over RPC (an argument of a call), it arrives as
    the same replicas served from the receiver, which learns their health for itself; plain
    ``pickle`` and ``torch.save`` cannot carry it (save its ``state_dict()``).

    Example (worker0 calls; server1..server3 serve)::

        model = ReplicatedModule(["server1/cpu", "server2/cpu", "server3/cpu"], MLP, (1024,)).eval()
        with torch.no_grad():
            y = model(x)                      # answered by one replica, failing over if it dies
    """

    def __init__(self, replicas: Sequence[str], module_cls: Any, args: tuple | None = None,
                 kwargs: dict | None = None, *, timeout: float | None = None, hedge_ms: float = DEFAULT_HEDGE_MS,
                 batching: Any = None) -> None:
        super().__init__()
        if isinstance(replicas, str) or not isinstance(replicas, Sequence) or not replicas:
            raise ValueError(f"replicas must be a non-empty list of remote devices, got {replicas!r}")
        if (isinstance(hedge_ms, bool) or not isinstance(hedge_ms, (int, float)) or not math.isfinite(hedge_ms)
                or hedge_ms <= 0):
            raise ValueError(f"hedge_ms must be a finite number of milliseconds > 0, got {hedge_ms!r}")
        batching = checked_policy(batching)
        first = RemoteModule(replicas[0], module_cls, args, kwargs, timeout=timeout, batching=batching)
        others = []
        for device in replicas[1:]:
            others.append(RemoteModule.create_async(device, module_cls, args, kwargs, timeout=timeout,
                                                    batching=batching))
        proxies = [first] + [f.wait() for f in others]
        workers = [p.on for p in proxies]
        if len(set(workers)) != len(workers):
            raise ValueError(f"replicas must be on different workers, got {workers}")
        state = first.state_dict()
        for p in proxies[1:]:  # equal because loaded (never because seeds agreed)
            p.load_state_dict(state)
        self._serve(proxies, hedge_ms / 1000.0, first.training)

    def _serve(self, proxies: list[RemoteModule], hedge_s: float, training: bool) -> None:
        """Serve from ``proxies`` (every one of them live, as far as this process knows)."""
        for p in proxies:  # (this module warns of training mode itself: a replica's own first call
            p._warned_training_batch = True  # would ask its host, blocking, maybe a dead or frozen one)
        self.__dict__["_replicas"] = [_Replica(p, i) for i, p in enumerate(proxies)]  # (not submodules)
        self.__dict__["_lock"] = threading.Lock()
        self.__dict__["_next"] = 0
        self.hedge_s = hedge_s
        self.timeout_s = proxies[0]._timeout_s()
        self.training = training

    # ---- calls ---------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_async(*args, **kwargs).wait()

    def forward_async(self, *args: Any, **kwargs: Any) -> Future:
        if torch.is_grad_enabled() or dist_autograd_contexts_exist():
            raise RuntimeError(_INFERENCE_ONLY)
        if self.training and not self.__dict__.get("_warned_training"):
            self.__dict__["_warned_training"] = True
            warnings.warn(
                "ReplicatedModule is in training mode (nn.Module's default): its replicas run dropout and batch "
                "norm as in training, and a batching policy joins nothing. Call .eval() on it to serve.",
                UserWarning, stacklevel=2)
        sig = self._replicas[0].proxy.forward_signature
        if sig is not None:
            sig.bind(None, *args, **kwargs) if _takes_self(sig) else sig.bind(*args, **kwargs)
        # a hedge or a resend sends the arguments again, later: as they are now, not as the caller
        # may have refilled them by then (a RemoteModule pickles them at once)
        args, kwargs = map_tensors(lambda t: t.detach().clone(), (args, kwargs))
        call = _Call(self, args, kwargs, self.timeout_s)
        schedule(call.deadline, call)
        self._send(call)
        return call.future

    def _pick(self, call: _Call) -> _Replica | None:
        """The live replica to try next: not set aside and not yet tried by this call, fewest
        calls outstanding (ties in turn); else a set-aside one not yet tried; else None."""
        with self._lock:
            live = [r for r in self._replicas if r.lost is None and r not in call.tried]
            if not live:
                return None
            ready = [r for r in live if not r.late] or live
            start = self._next
            self.__dict__["_next"] = start + 1
            best = min(ready, key=lambda r: (r.outstanding, (r.index - start) % len(self._replicas)))
            best.outstanding += 1
            call.tried.append(best)
            call.in_flight += 1
            return best

    def _send(self, call: _Call, elsewhere: bool = False) -> None:
        replica = self._pick(call)
        if replica is None:
            if call.in_flight == 0:
                with self._lock:  # a replica tried and not lost only ran out of the call's time
                    timed_out = any(r.lost is None for r in call.tried)
                if timed_out and _clock() < call.deadline:
                    return  # (torch's RPC timeout, in whole ms, ends a moment early: the watcher fails
                    # the call at its deadline, as every other timeout)
                self._finish(call, self._timeout(call) if timed_out else RuntimeError(self._none_left(call)),
                             elsewhere=elsewhere)
            return
        now = _clock()
        call.hedge_at = now + self.hedge_s
        if call.hedge_at < call.deadline:
            schedule(call.hedge_at, call)
        try:
            with torch.no_grad():  # (hedges and resends leave from threads where grad is on)
                sent = replica.proxy._attempt(call.args, call.kwargs, max(call.deadline - now, 0.001))
        except BaseException as exc:  # (arguments that cannot be sent: nothing went anywhere)
            with self._lock:
                replica.outstanding -= 1
                call.in_flight -= 1
            self._finish(call, exc, elsewhere=elsewhere)
            return
        sent.add_done_callback(lambda fut: self._answered(call, replica, fut, now))

    def _answered(self, call: _Call, replica: _Replica, fut: Future, sent_at: float) -> None:
        with self._lock:
            replica.outstanding -= 1
            call.in_flight -= 1
        try:
            value, raised = fut.value()
        except BaseException as exc:  # no answer: the replica is lost, or late past the deadline
            self._replica_failed(replica, exc)
            call.errors.append(f"{replica.proxy.on}: {exc}")
            if call.done:
                return
            if _clock() < call.deadline:
                self._send(call)
            elif call.in_flight == 0:
                self._finish(call, self._timeout(call))
            return
        self._taken_back(replica, sent_at)
        self._finish(call, raised, value)  # (the module's own error is the call's answer)

    def _expire(self, call: _Call, now: float) -> None:
        """(The watcher) a call's hedge time or deadline."""
        if call.done:
            return
        if now >= call.deadline:
            self._finish(call, self._timeout(call), elsewhere=True)
            return
        if now >= call.hedge_at:
            call.hedge_at = math.inf
            last = call.tried[-1] if call.tried else None
            if last is not None:
                self._set_aside(last)
            self._send(call, elsewhere=True)

    def _finish(self, call: _Call, error: BaseException | None, value: Any = None, elsewhere: bool = False) -> None:
        """Settle the caller's Future; ``elsewhere`` (on the process-wide watcher thread): on a
        settler thread, so that a callback that blocks holds up no other deadline."""
        with self._lock:
            if call.done:
                return
            call.done = True
        if elsewhere:
            future = call.future
            settle_elsewhere([(lambda: future.set_exception(error)) if error is not None
                              else (lambda: future.set_result(value))])
        elif error is not None:
            call.future.set_exception(error)
        else:
            call.future.set_result(value)

    def _timeout(self, call: _Call) -> CallTimeout:
        tried = ", ".join(r.proxy.on for r in call.tried) or "none"
        return CallTimeout(f"ReplicatedModule call failed: no answer within {call.timeout:g} s "
                           f"(timeout={call.timeout:g} s; replicas tried: {tried})")

    def _none_left(self, call: _Call) -> str:
        lost = "; ".join(f"{r.proxy.on}: {r.lost}" for r in self._replicas if r.lost is not None)
        return f"ReplicatedModule call failed: no live replica left to try (lost: {lost or 'none'})" + (
            f"; errors: {' | '.join(call.errors)}" if call.errors else "")

    # ---- replicas' health --------------------------------------------------------------------

    def _replica_failed(self, replica: _Replica, exc: BaseException) -> None:
        """An RPC to ``replica`` failed without an answer: lost, unless it only timed out."""
        if _timed_out(exc):
            self._set_aside(replica)
            return
        with self._lock:
            _lost(replica, exc)

    def _set_aside(self, replica: _Replica) -> None:
        with self._lock:
            if replica.lost is not None or replica.late:
                return
            replica.late = True
            replica.late_since = _clock()
            start = not replica.probing
            replica.probing = True
        if start:
            self._probe(replica)

    def _taken_back(self, replica: _Replica, sent_at: float) -> None:
        """An answer from ``replica`` to an RPC sent at ``sent_at``: a set-aside replica is taken
        back when the RPC left after it was set aside (an answer already on its way when the
        replica froze says nothing of it now)."""
        with self._lock:
            if replica.late and sent_at >= replica.late_since:
                replica.late = False

    def _probe(self, replica: _Replica) -> None:
        """Probe a set-aside replica until it answers (taken back) or fails (lost)."""
        me = weakref.ref(self)
        try:
            sent = rpc.rpc_async(replica.proxy._dest(), _probe, timeout=PROBE_S)
        except BaseException as exc:  # (RPC is down: nothing more to learn)
            with self._lock:
                replica.probing = False
                _lost(replica, exc)
            return

        def probed(fut: Future) -> None:
            owner = me()
            if owner is None:
                return
            try:
                fut.value()
            except BaseException as exc:
                timed_out = _timed_out(exc)
                if timed_out and replica.late and replica.lost is None:
                    owner._probe(replica)  # still frozen: probe again
                    return
                with owner._lock:
                    replica.probing = False
                    if not timed_out:
                        _lost(replica, exc)
                return
            with owner._lock:
                replica.probing = False
                replica.late = False

        sent.add_done_callback(probed)

    def replica_states(self) -> list[dict]:
        """Each replica's worker and state: ``"live"``, ``"set aside"`` (late, being probed) or
        ``"lost"`` (with why), and its calls outstanding."""
        with self._lock:
            return [{"worker": r.proxy.on, "state": "lost" if r.lost else "set aside" if r.late else "live",
                     "why": r.lost, "outstanding": r.outstanding} for r in self._replicas]

    def _on_live(self, do: Any) -> list:
        """``do(proxy)`` on every live replica, even after one raised (a load that fails loads
        the same part of the state on every replica first: they stay equal). A replica found
        gone (its process killed before any call noticed) is dropped, as a call would drop it;
        any other error is raised once every replica was reached."""
        with self._lock:
            replicas = [r for r in self._replicas if r.lost is None]
        results, error = [], None
        for r in replicas:
            try:
                results.append(do(r.proxy))
            except Exception as exc:  # noqa: BLE001 (raised below unless the replica is gone)
                if not self._gone(r):
                    error = error or exc
        if error is not None:
            raise error
        if not results:
            lost = "; ".join(f"{r.proxy.on}: {r.lost}" for r in self._replicas)
            raise RuntimeError(f"ReplicatedModule: no live replica left (lost: {lost})")
        return results

    def _gone(self, replica: _Replica) -> bool:
        """(After an RPC to ``replica`` failed) probe it: lost when the probe fails without
        timing out (the connection is gone); False when it answers or is only late."""
        try:
            rpc.rpc_sync(replica.proxy._dest(), _probe, timeout=PROBE_S)
            return False
        except Exception as exc:  # noqa: BLE001
            if _timed_out(exc):
                return False
            with self._lock:
                _lost(replica, exc)
            return True

    # ---- state, modes --------------------------------------------------------------------

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The replicas' state (as the local module's ``state_dict`` names it, under ``prefix``),
        checked equal on every live replica."""
        if args:
            raise TypeError("ReplicatedModule.state_dict takes keyword arguments only")
        states = self._on_live(lambda p: (p.on, p.state_dict()))
        (first_on, first), rest = states[0], states[1:]
        for on, state in rest:
            if state.keys() != first.keys() or any(not torch.equal(state[k], first[k]) for k in first):
                raise RuntimeError(f"ReplicatedModule: the replicas on {first_on} and {on} hold different states")
        out = destination if destination is not None else type(first)()
        for k, v in first.items():
            out[prefix + k] = v
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load ``state_dict`` into every live replica (what the first returns is returned)."""
        return self._on_live(lambda p: p.load_state_dict(state_dict, strict=strict, assign=assign))[0]

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        """(A parent module's ``load_state_dict``) this module's keys, under ``prefix``, loaded
        into every replica; keys missing or unexpected reported to the parent (which raises for
        them when ``strict``)."""
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        result = self._on_live(lambda p: p.load_state_dict(mine, strict=False))[0]
        missing_keys.extend(prefix + k for k in result.missing_keys)
        unexpected_keys.extend(prefix + k for k in result.unexpected_keys)
        for k in list(state_dict):
            if k.startswith(prefix):
                state_dict.pop(k)

    def _apply(self, fn: Any, recurse: bool = True) -> ReplicatedModule:
        # (a model's to(dtype)/double()/half()/...: each live replica casts its module on its
        # host, as a RemoteModule does; device moves stay where the replicas were made)
        self._on_live(lambda p: p._apply(fn, recurse))
        return super()._apply(fn, recurse)

    def train(self, mode: bool = True) -> ReplicatedModule:
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {mode!r}")
        self._on_live(lambda p: p.train(mode))
        self.training = mode
        return self

    def __getstate__(self) -> Any:
        raise TypeError(
            "a ReplicatedModule travels only inside RPC messages (as an argument or result of a call), where "
            "it stays the same remote replicas; pickle and torch.save cannot carry it: save its state_dict()")

    def extra_repr(self) -> str:
        return ", ".join(f"{s['worker']}: {s['state']}" for s in self.replica_states())


def _timed_out(exc: BaseException) -> bool:
    """Whether an RPC's error says it ran out of time (the peer may only be late), rather than
    that its connection is gone."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _lost(replica: _Replica, exc: BaseException) -> None:
    """(Under the module's lock) ``replica`` is lost, for the first line of ``exc``."""
    if replica.lost is None:
        text = str(exc)
        replica.lost = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _reduce(model: ReplicatedModule) -> tuple:
    """RPC reducer: a ReplicatedModule travels as its replicas' proxies (every replica, lost ones
    included: the receiver learns their health for itself) and its settings."""
    return _rebuild, ([r.proxy for r in model._replicas], model.hedge_s, model.training, type(model))


def _rebuild(proxies: list, hedge_s: float, training: bool, cls: type) -> ReplicatedModule:
    """RPC receiver side of :func:`_reduce`: the same remote modules, served from here."""
    model = cls.__new__(cls)
    nn.Module.__init__(model)
    model._serve(proxies, hedge_s, training)
    return model


register_rpc_reducer(ReplicatedModule, _reduce)


def _takes_self(sig: inspect.Signature) -> bool:
    params = list(sig.parameters)
    return bool(params) and params[0] == "self"
