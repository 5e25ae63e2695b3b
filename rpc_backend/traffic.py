"""Bytes a process's RPC calls carry, each way: :class:`Traffic`.

What is counted. While a :class:`Traffic` is active (``with``), every call this process makes
through ``torch.distributed.rpc``'s ``rpc_async``, ``rpc_sync`` and ``remote`` (from any
thread), per peer worker: the message sent, with its payload, and the answer's payload when it
arrives (``remote``: no answer value travels). A payload is what torch RPC hands TensorPipe for
a Python call: the pickle of the function and its arguments (or of the answer) with tensors and
RRefs left out of it, plus the bytes of each tensor as RPC sends it (its whole storage, or a
compact copy of a view whose storage is at least 8 KB and at least twice the view's bytes).
Measured on the very objects sent and received, whatever their shapes; a pickle here differs
from RPC's own by a few bytes per tensor (RPC writes a reference to its tensor table).

Not counted:

* what carries a payload: TensorPipe's framing of each message (its descriptor, and torch's
  table of the tensors' dtypes, sizes and strides), then TCP/IP headers and acknowledgements,
  which a link's counters include (tutorials/performance.md measures them on a veth);
* torch's own C++ messages (distributed autograd's gradients, RRef bookkeeping), and the calls
  this process answers (the caller counts those);
* rpc_backend's heartbeats (:mod:`rpc_backend.watch`): a few hundred bytes per peer per second
  whatever the job does, not part of any step; nor its one question per peer about its build
  (:mod:`rpc_backend.builds`, sent with torch's own ``rpc_async``).

Cost: none while no Traffic is active (torch's functions are left as they are); while one is,
each call's arguments and each answer are pickled once more, without their tensors: 20-60 us of
CPU per message for ``make demo``'s messages on a loaded 2-core machine, about 1% of its step.
(A torch operator called by RPC, ``rpc_async(w, torch.add, ...)``, travels as a TorchScript
call; its tensors are counted the same, the rest is sized as a pickle all the same.)

Example (the caller's side of a training loop)::

    with Traffic() as traffic:
        for batch in batches:
            train_step(batch)
    traffic.sent["ps0"], traffic.received["ps0"]      # payload bytes to and from ps0
    sum(traffic.sent.values()) / len(batches)         # bytes sent per step, to every peer
"""

from __future__ import annotations

import collections
import copyreg
import io
import pickle
import threading
from functools import partial
from typing import Any

import torch
import torch.distributed.rpc as rpc

#: torch RPC sends a compact copy of a view whose storage is at least this many bytes and at
#: least COMPACT_MIN_MULTIPLE times the view's (measured on torch 2.13; see
#: remote_module/_proxy/wire.py, which follows the same rule)
COMPACT_MIN_STORAGE_BYTES = 8 * 1024
COMPACT_MIN_MULTIPLE = 2
#: seconds leaving a Traffic waits, at most, for answers already in to be counted
SETTLE_S = 10.0

_PATCHED = ("rpc_async", "rpc_sync", "remote")
_lock = threading.Lock()
_active: tuple[Traffic, ...] = ()  # the counters now active (replaced whole, under _lock)
_originals: dict[str, Any] = {}  # torch's functions while ours are installed
_installed: dict[str, Any] = {}  # ours, by the same names


_sizing = threading.local()  # .tensors: those the pickle being sized left out, in order


def _tensor_left_out(tensor: torch.Tensor) -> tuple:
    _sizing.tensors.append(tensor)
    return (int, (len(_sizing.tensors),))  # (a small stand-in, as RPC's pickler writes a table index)


def _rref_left_out(rref: Any) -> tuple:
    return (int, (0,))


class _Sizer(pickle.Pickler):
    """Pickles an object as torch RPC's pickler does (its default protocol, tensors and RRefs
    reduced through the dispatch table, by exact type), leaving tensors and RRefs out. Only
    those call back into Python (a ``persistent_id`` would be called for every object, which
    made sizing several times slower)."""

    dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _tensor_left_out, rpc.PyRRef: _rref_left_out,
                      rpc.RRef: _rref_left_out}


def _walk(obj: Any, out: list[torch.Tensor], depth: int = 0) -> None:
    """Tensors inside ``obj`` (containers, attributes), for what does not pickle here."""
    if depth > 20:
        return
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _walk(value, out, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            _walk(value, out, depth + 1)
    elif hasattr(obj, "__dict__"):
        _walk(vars(obj), out, depth + 1)


def payload_parts(obj: Any) -> tuple[int, list[torch.Tensor]]:
    """``(bytes of obj's pickle with its tensors left out, those tensors)``; the bytes are -1
    where ``obj`` does not pickle here (its tensors are then found by walking it)."""
    tensors: list[torch.Tensor] = []
    _sizing.tensors = tensors
    buf = io.BytesIO()
    try:
        _Sizer(buf).dump(obj)
        return buf.tell(), tensors
    except Exception:
        tensors = []
        _walk(obj, tensors)
        return -1, tensors
    finally:
        _sizing.tensors = None


def tensor_wire_bytes(tensor: torch.Tensor) -> int:
    """The bytes torch RPC sends for ``tensor``: its storage's, or the view's own for a view
    that uses little of a big storage (see the module docstring)."""
    own = tensor.numel() * tensor.element_size()
    try:
        storage = tensor.untyped_storage().nbytes()
    except Exception:  # no storage (sparse, ...): its elements
        return own
    if storage >= COMPACT_MIN_STORAGE_BYTES and storage >= COMPACT_MIN_MULTIPLE * own:
        return own
    return storage


def payload_bytes(obj: Any) -> int:
    """Bytes of ``obj`` as a payload: its pickle without tensors, plus the tensors' bytes."""
    pickled, tensors = payload_parts(obj)
    return max(pickled, 0) + sum(tensor_wire_bytes(t) for t in tensors)


def _not_counted() -> tuple:
    from rpc_backend import watch

    return (watch._beat,)


def _peer_name(to: Any) -> str:
    if isinstance(to, rpc.WorkerInfo):
        return to.name
    if isinstance(to, str):
        return to
    try:
        return rpc.get_worker_info(to).name
    except Exception:
        return str(to)


class Traffic:
    """Per peer worker, what this process's RPC calls carried while active (``with``; see the
    module docstring for what is counted): ``messages`` sent, payload bytes ``sent``, payload
    bytes ``received`` in answers (``answers`` of them), all ``collections.Counter``; and
    ``unsized``, the payloads that did not pickle here (their tensors alone counted). A call
    sent while active is counted with its answer, even one that arrives later. Several may be
    active at once (each counts every call). A copy (``copy.copy``, ``copy.deepcopy``,
    ``pickle``) is a snapshot of the counts so far: a Traffic of its own, not active, that
    does not count the answers still on their way to this one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counted = threading.Condition(self._lock)
        #: answers of calls made while active not counted yet (torch wakes a waiter on a
        #: future before it runs the future's callbacks, where answers are counted)
        self._uncounted: dict[int, Any] = {}
        self.messages: collections.Counter = collections.Counter()
        self.sent: collections.Counter = collections.Counter()
        self.received: collections.Counter = collections.Counter()
        self.answers: collections.Counter = collections.Counter()
        self.unsized = 0

    _COUNTS = ("messages", "sent", "received", "answers")

    def __getstate__(self) -> dict:
        with self._lock:  # the counts as of now, not the lock or the answers still on their way
            state = {name: collections.Counter(getattr(self, name)) for name in self._COUNTS}
            state["unsized"] = self.unsized
        return state

    def __setstate__(self, state: dict) -> None:
        Traffic.__init__(self)
        for name in self._COUNTS:
            getattr(self, name).update(state[name])
        self.unsized = state["unsized"]

    def __enter__(self) -> Traffic:
        global _active
        with _lock:
            if self in _active:
                raise RuntimeError("this Traffic is already counting: enter a new Traffic() for a nested count")
            if not _active:
                _install()
            _active = (*_active, self)
        return self

    def __exit__(self, *exc: Any) -> None:
        global _active
        with _lock:
            _active = tuple(t for t in _active if t is not self)
            if not _active:
                _uninstall()
        self.settle()

    def settle(self, timeout: float = SETTLE_S) -> None:
        """Wait (at most ``timeout`` seconds) until every answer that has arrived is counted:
        a call waited for here may still be running its future's callbacks. Leaving the
        ``with`` does it; answers still on their way are counted when they arrive."""
        # the condition only turns false through _answer_counted, which notifies
        with self._counted:
            self._counted.wait_for(lambda: not any(f.done() for f in self._uncounted.values()), timeout)

    def _expect(self, fut: Any) -> None:
        with self._lock:
            self._uncounted[id(fut)] = fut

    def _answer_counted(self, fut: Any) -> None:
        with self._counted:
            self._uncounted.pop(id(fut), None)
            self._counted.notify_all()

    def _add(self, counter: collections.Counter, peer: str, nbytes: int, unsized: bool, message: bool) -> None:
        with self._lock:
            counter[peer] += nbytes
            self.unsized += unsized
            if message:
                self.messages[peer] += 1
            else:
                self.answers[peer] += 1


def _count(counters: tuple[Traffic, ...], peer: str, obj: Any, sent: bool) -> None:
    pickled, tensors = payload_parts(obj)
    nbytes = max(pickled, 0) + sum(tensor_wire_bytes(t) for t in tensors)
    for traffic in counters:
        traffic._add(traffic.sent if sent else traffic.received, peer, nbytes, pickled < 0, sent)


def _answered(counters: tuple[Traffic, ...], peer: str, fut: Any) -> None:
    try:
        try:
            value = fut.value()
        except Exception:  # the call failed: no answer to count
            return
        _count(counters, peer, value, sent=False)
    finally:
        for traffic in counters:
            traffic._answer_counted(fut)


def _as_sent(value: Any, kind: type) -> Any:
    """``args``/``kwargs`` as torch sends them; what torch would refuse (or the callee fail on,
    ``args=5``) is sized as given, and the error stays torch's or the callee's."""
    if value is None:
        return kind()
    try:
        return kind(value)
    except (TypeError, ValueError):
        return value


def _counting(name: str, original: Any) -> Any:
    skip = _not_counted()

    def call(to: Any, func: Any, args: Any = None, kwargs: Any = None, *rest: Any, **kw: Any) -> Any:
        counters = _active
        if not counters or func in skip:
            return original(to, func, args, kwargs, *rest, **kw)
        peer = _peer_name(to)
        message = (func, _as_sent(args, tuple), _as_sent(kwargs, dict))
        result = original(to, func, args, kwargs, *rest, **kw)  # (raised: nothing was sent)
        _count(counters, peer, message, sent=True)
        if name == "rpc_async":
            for traffic in counters:
                traffic._expect(result)
            result.add_done_callback(partial(_answered, counters, peer))
        elif name == "rpc_sync":
            _count(counters, peer, result, sent=False)
        return result

    call.__wrapped__ = original  # type: ignore[attr-defined]
    return call


def _install() -> None:
    for name in _PATCHED:
        if name in _originals:  # ours is still in place, beneath another patch (see _uninstall)
            continue
        _originals[name] = getattr(rpc, name)
        _installed[name] = _counting(name, _originals[name])
        setattr(rpc, name, _installed[name])


def _uninstall() -> None:
    for name, original in list(_originals.items()):
        if getattr(rpc, name) is _installed[name]:
            setattr(rpc, name, original)
            del _originals[name], _installed[name]
        # else: someone patched over ours; ours stays beneath theirs and, with no Traffic
        # active, only forwards (and is reused by the next Traffic)
