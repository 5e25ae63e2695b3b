"""Host-side batching: concurrent ``forward`` calls to one hosted module joined into one forward.

``RemoteModule(..., batching=BatchPolicy(dim=0, max_batch=64, max_wait_ms=2.0))`` makes the host
keep a :class:`Batcher` for the module. A call joins a batch only while the module is in eval
mode (in training mode batch norm and dropout act on the batch), and only when it records
nothing: made under ``torch.no_grad()`` (or inference mode) by a process with no distributed
autograd context, and run on the host outside one too. Every other call runs alone, as without batching.

What joins: calls whose arguments have the same structure (the same positional count and keyword
names, in the same order), whose tensors agree in dtype, device, number of dimensions and every
size but ``dim``'s, and whose other arguments are equal plain values (``None``, ``bool``,
``int``, ``float``, ``str``). A call with any other kind of argument, or with a tensor without a
``dim``, or larger along ``dim`` than ``max_batch``, runs alone. Joined calls' tensors are
concatenated along ``dim`` (``torch.cat``) in the order the calls arrived, the module runs once
under ``torch.no_grad()``, and every tensor of the output (at any depth of tuples, lists and
dicts) is split along ``dim`` by the calls' sizes; each call gets a copy of its part.

**Checked once per kind of call.** The first joined batch of each join key also runs its first
call alone and compares (the same structure, shapes and dtypes; floating values within
``rtol=1e-4, atol=1e-5``; both 4 ulps for float16 and bfloat16). Where the call alone gets
something else than its part of the joined output, such calls run alone from then on (one
``RuntimeWarning`` on the host, saying which part differed): for example a flattened output
whose size along ``dim`` is the batch's by chance, or a sequence-first model joined along its
sequence (``dim=0`` where its batch is dim 1), whose rows are not independent along ``dim``.
The check costs one forward per kind of call.

Each call keeps the call contract:

- **its own result**: a joined forward that raises, or whose output cannot be split (a value
  that is not a tensor, or a tensor whose size along ``dim`` is not the batch's), is run again
  for each of its calls alone, so a bad input fails only its own call. Calls with arguments
  like those of an output that did not split (the same join key) run per call from then on,
  and every call of a module once that happened for several kinds of arguments (one
  ``RuntimeWarning`` on the host);
- **its own deadline**: the caller's, as for any call; a call waits on the host at most
  ``max_wait_ms`` for a batch to fill, plus the forwards queued before it;
- **order**: calls that share one message (one caller's ``forward_async`` calls) run in the
  order they were made: a batch never takes a call whose earlier sibling it passed over.

A batching module's forward must treat its rows independently and have no side effects beyond
its output: the host may run a call's rows more than once (the check above; a joined forward
that raised or did not split, whose calls then run alone).

The result of a joined call equals the same slice of the joined batch run on the local module
bit for bit (the module runs that batch); against its unbatched result it agrees within the
float tolerance of a different batch size (torch's kernels may block a matrix product
differently: about 1e-6 relative for float32).

Example (the host joins 8 callers' batch-1 calls)::

    mlp = RemoteModule("server/cpu", MLP, batching=BatchPolicy(max_batch=64, max_wait_ms=2))
    with torch.no_grad():
        y = mlp(torch.randn(1, 1024))       # joined with other callers' calls on the host
"""

from __future__ import annotations

import math
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.futures import Future

_clock = time.monotonic

#: how many join keys (argument structures) may give outputs that cannot be split before a
#: batcher runs every call of its module alone
_MAX_UNSPLIT = 8
#: kinds of calls remembered as checked: past this many, all are forgotten (each is checked again
#: once; a plain argument that varies, a step or an id, makes a new kind of every value)
_MAX_VERIFIED = 1024

#: the values other than tensors that calls may share (equal in each) and still join
_PLAIN = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class BatchPolicy:
    """How a hosted module joins concurrent calls (see :mod:`remote_module._proxy.batching`).

    Args:
        dim: the batch dimension of every tensor argument and output (may be negative).
        max_batch: the largest joined size along ``dim``; a call larger than it runs alone.
        max_wait_ms: how long the first call of a batch waits for others (0: only calls
            already queued join it).
    """

    dim: int = 0
    max_batch: int = 64
    max_wait_ms: float = 2.0

    def __post_init__(self) -> None:
        if type(self.dim) is not int:
            raise TypeError(f"BatchPolicy: dim must be an int, got {self.dim!r}")
        if type(self.max_batch) is not int or self.max_batch < 1:
            raise ValueError(f"BatchPolicy: max_batch must be an int of at least 1, got {self.max_batch!r}")
        if (isinstance(self.max_wait_ms, bool) or not isinstance(self.max_wait_ms, (int, float))
                or not math.isfinite(self.max_wait_ms) or self.max_wait_ms < 0):
            raise ValueError(f"BatchPolicy: max_wait_ms must be a finite number >= 0, got {self.max_wait_ms!r}")


def checked_policy(batching: Any) -> BatchPolicy | None:
    """``batching`` as given to ``RemoteModule``: None or a :class:`BatchPolicy`."""
    if batching is None or isinstance(batching, BatchPolicy):
        return batching
    raise TypeError(f"batching must be a remote_module.BatchPolicy or None, got {batching!r}")


# ---- joining ------------------------------------------------------------------------------


def _leaves(value: Any, dim: int, out: list) -> Any:
    """The join key of an argument (its structure; tensors by all but their size along ``dim``);
    appends each tensor to ``out``. Raises ``_Alone`` for a value that cannot join."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or not -value.dim() <= dim < value.dim() or value.requires_grad:
            raise _Alone
        d = dim % value.dim()
        out.append(value)
        shape = tuple(value.shape)
        return ("T", value.dtype, value.device, shape[:d] + shape[d + 1:], type(value))
    if type(value) in _PLAIN:  # (a float by its bits: 0.0 and -0.0 differ)
        return ("V", type(value), value.hex() if type(value) is float else value)
    if type(value) in (tuple, list):
        return (type(value), tuple(_leaves(v, dim, out) for v in value))
    if type(value) is dict and all(type(k) is str for k in value):
        return (dict, tuple((k, _leaves(v, dim, out)) for k, v in value.items()))
    raise _Alone


class _Alone(Exception):
    """A call that cannot join a batch."""


def join_key(args: tuple, kwargs: dict, dim: int) -> tuple[Any, list[torch.Tensor]] | None:
    """The key under which a call joins others (None: it runs alone) and its tensors, in order."""
    tensors: list[torch.Tensor] = []
    try:
        key = (_leaves(args, dim, tensors), _leaves(kwargs, dim, tensors))
        if not tensors:
            return None
    except _Alone:
        return None
    return key, tensors


def _rebuild(value: Any, tensors: list[torch.Tensor], at: list[int]) -> Any:
    """``value`` with its tensors replaced, in order, from ``tensors``."""
    if isinstance(value, torch.Tensor):
        at[0] += 1
        return tensors[at[0] - 1]
    if type(value) in (tuple, list):
        return type(value)(_rebuild(v, tensors, at) for v in value)
    if type(value) is dict:
        return {k: _rebuild(v, tensors, at) for k, v in value.items()}
    return value


def unsplittable(out: Any, sizes: list[int], dim: int, path: str = "output") -> str:
    """Why a joined output cannot be split by the calls' ``sizes`` (the first part that fails,
    named by its path in the output): a value that is not a tensor (or a tuple, list or str-keyed
    dict of them), or a tensor whose size along ``dim`` is not the batch's; "" when it can
    (:func:`split_output`)."""
    if isinstance(out, torch.Tensor):
        if out.dim() == 0 or not -out.dim() <= dim < out.dim():
            return f"{path} is a tensor of shape {tuple(out.shape)}, without a dim {dim}"
        if out.shape[dim] != sum(sizes):
            return (f"{path} is a tensor of shape {tuple(out.shape)}: its size along dim {dim} is "
                    f"{out.shape[dim]}, the joined batch's {sum(sizes)}")
        return ""
    if type(out) in (tuple, list):
        return next((w for i, v in enumerate(out) if (w := unsplittable(v, sizes, dim, f"{path}[{i}]"))), "")
    if type(out) is dict and all(type(k) is str for k in out):
        return next((w for k, v in out.items() if (w := unsplittable(v, sizes, dim, f"{path}[{k!r}]"))), "")
    return f"{path} is a {type(out).__name__}, not a tensor"


def _tolerance(dtype: torch.dtype) -> float:
    """The check's ``rtol`` for floating ``dtype``: 1e-4, or 4 ulps of a coarser dtype (float16,
    bfloat16: another batch size may take another kernel, which rounds otherwise)."""
    return max(1e-4, 4 * torch.finfo(dtype).eps)


def differs(alone: Any, part: Any, path: str = "output") -> str:
    """How a call's output run alone differs from its part of a joined output (""
    when they agree: the same structure, shapes and dtypes, floating values within
    ``rtol=1e-4, atol=1e-5`` (both 4 ulps for a coarser dtype: float16, bfloat16), other values
    equal)."""
    if isinstance(alone, torch.Tensor) and isinstance(part, torch.Tensor):
        if alone.shape != part.shape or alone.dtype != part.dtype:
            return (f"{path}: alone a tensor of shape {tuple(alone.shape)} ({alone.dtype}), its slice of the "
                    f"joined batch {tuple(part.shape)} ({part.dtype})")
        if alone.is_floating_point() or alone.is_complex():
            rtol = _tolerance(alone.dtype)
            atol = 1e-5 if rtol == 1e-4 else rtol
            if not torch.allclose(alone, part, rtol=rtol, atol=atol, equal_nan=True):
                return (f"{path}: values differ beyond rtol={rtol:.3g}, atol={atol:.3g} (the rows are not "
                        "independent along this dim)")
        elif not torch.equal(alone, part):
            return f"{path}: values differ (the rows are not independent along this dim)"
        return ""
    if type(alone) is not type(part):
        return f"{path}: alone a {type(alone).__name__}, joined a {type(part).__name__}"
    if type(alone) in (tuple, list):
        if len(alone) != len(part):
            return f"{path}: alone {len(alone)} items, joined {len(part)}"
        return next((w for i, (a, b) in enumerate(zip(alone, part)) if (w := differs(a, b, f"{path}[{i}]"))), "")
    if type(alone) is dict:
        if alone.keys() != part.keys():
            return f"{path}: alone keys {sorted(alone)}, joined {sorted(part)}"
        return next((w for k in alone if (w := differs(alone[k], part[k], f"{path}[{k!r}]"))), "")
    return "" if alone == part else f"{path}: {alone!r} alone, {part!r} joined"


def split_output(out: Any, sizes: list[int], dim: int) -> list[Any]:
    """Each call's part of a joined output (copies), split along ``dim`` by ``sizes``; ``out``
    is one that :func:`unsplittable` passed (tensors, or tuples, lists and str-keyed dicts of
    them, each with the joined batch's size along ``dim``)."""
    if isinstance(out, torch.Tensor):
        return [part.clone() for part in torch.split(out, sizes, dim)]
    if type(out) in (tuple, list):
        parts = [split_output(v, sizes, dim) for v in out]
        return [type(out)(p[i] for p in parts) for i in range(len(sizes))]
    parts_of = {k: split_output(v, sizes, dim) for k, v in out.items()}
    return [{k: p[i] for k, p in parts_of.items()} for i in range(len(sizes))]


# ---- the host's batcher -----------------------------------------------------------------


class Pending:
    """One call waiting for a batch: its arguments (already on the module's device), join key,
    size along ``dim``, the message it came in (``group``) and its Future."""

    __slots__ = ("args", "kwargs", "key", "tensors", "size", "group", "future", "arrived")

    def __init__(self, args: tuple, kwargs: dict, key: Any, tensors: list, size: int, group: Any) -> None:
        self.args, self.kwargs, self.key, self.tensors, self.size = args, kwargs, key, tensors, size
        self.group, self.future, self.arrived = group, Future(), _clock()


class Batcher:
    """The batches of one hosted module: calls queue (:meth:`submit`), and a thread of its own
    joins and runs them. ``run(module_args, module_kwargs)`` runs the module (the caller wraps
    grad mode and device handling); each Pending's Future gets ``("ok", output)`` or
    ``("error", exception)``."""

    def __init__(self, policy: BatchPolicy, run: Callable[[tuple, dict], Any], name: str) -> None:
        self.policy, self._run, self._name = policy, run, name
        self._queue: list[Pending] = []
        self._cond = threading.Condition()
        self._closed = False
        self._splits = True  # False once outputs of _MAX_UNSPLIT keys could not be split: all calls run alone
        self._unsplit: set = set()  # join keys whose joined output could not be split: they run alone
        self._verified: set = set()  # join keys whose first joined batch matched its first call alone
        # what happened to the calls that reached this batcher (see stats())
        self._counts = {"joined_forwards": 0, "joined_calls": 0, "alone_in_queue": 0, "run_again_alone": 0,
                        "not_joinable": 0, "in_training_mode": 0}
        self._thread = threading.Thread(target=self._loop, name=f"remote_module batcher {name}", daemon=True)
        self._thread.start()

    def submit(self, args: tuple, kwargs: dict, group: Any = None) -> Future | None:
        """Queue a call that may join a batch; its Future, or None when it runs alone (its
        arguments cannot join, or batching is off for this module)."""
        keyed = join_key(args, kwargs, self.policy.dim) if self._splits else None
        key, tensors = keyed if keyed is not None else (None, None)
        size = None if tensors is None else tensors[0].shape[self.policy.dim]
        if (tensors is None or key in self._unsplit or size > self.policy.max_batch
                or any(t.shape[self.policy.dim] != size for t in tensors)):
            self.count("not_joinable")
            return None
        p = Pending(args, kwargs, key, tensors, size, group)
        with self._cond:
            if self._closed:
                return None
            self._queue.append(p)
            self._cond.notify()
        return p.future

    def count(self, what: str, n: int = 1) -> None:
        with self._cond:
            self._counts[what] += n

    def stats(self) -> dict:
        """What this batcher did so far: ``joined_forwards`` (forwards of joined calls) and
        ``joined_calls`` (the calls they answered), ``alone_in_queue`` (calls that queued and
        found no company), ``run_again_alone`` (calls of a joined forward that raised, did not
        split or failed its check, each then run alone), ``not_joinable`` (calls that reached the
        host able to record nothing but with arguments that cannot join, or of a refused kind),
        ``in_training_mode`` (such calls while the module was in training mode), and
        ``refused_kinds`` and ``checked_kinds`` (kinds of calls refused, and checked and joined: at
        most ``_MAX_VERIFIED`` remembered)."""
        with self._cond:
            return {**self._counts, "refused_kinds": len(self._unsplit), "checked_kinds": len(self._verified)}

    def close(self) -> None:
        """Stop the thread once the queue is run (the module is gone, or the process ends)."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _take(self) -> list[Pending] | None:
        """The next batch (waits for it); None once closed with nothing queued."""
        wait_s = self.policy.max_wait_ms / 1000.0
        with self._cond:
            while True:
                if not self._queue:
                    if self._closed:
                        return None
                    self._cond.wait()
                    continue
                first = self._queue[0]
                batch = self._fill(first)
                left = first.arrived + wait_s - _clock()
                if self._closed or left <= 0 or sum(p.size for p in batch) >= self.policy.max_batch:
                    taken = {id(p) for p in batch}
                    self._queue = [p for p in self._queue if id(p) not in taken]
                    return batch
                self._cond.wait(left)

    def _fill(self, first: Pending) -> list[Pending]:
        """Calls that join ``first``, in arrival order: the same key, within ``max_batch``, never
        past a passed-over call of the same message."""
        batch, total, passed = [first], first.size, set()
        for p in self._queue[1:]:
            if p.key == first.key and p.group not in passed and total + p.size <= self.policy.max_batch:
                batch.append(p)
                total += p.size
            elif p.group is not None:
                passed.add(p.group)
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                if not self._splits or batch[0].key in self._unsplit:  # (queued before its kind was refused)
                    self._each_alone(batch, "not_joinable")
                elif len(batch) == 1:
                    self.count("alone_in_queue")
                    self._alone(batch[0])
                else:
                    self._joined(batch)
            except BaseException as exc:  # (e.g. a warning made an error): the thread lives on
                for p in batch:
                    if not p.future.done():
                        p.future.set_result(("error", exc))

    def _alone(self, p: Pending) -> None:
        try:
            out = self._run(p.args, p.kwargs)
        except BaseException as exc:  # the call's own failure
            p.future.set_result(("error", exc))
        else:
            p.future.set_result(("ok", out))

    def _each_alone(self, batch: list[Pending], counted: str = "run_again_alone") -> None:
        self.count(counted, len(batch))
        for p in batch:
            self._alone(p)

    def _joined(self, batch: list[Pending]) -> None:
        dim = self.policy.dim
        first = batch[0]
        sizes = [p.size for p in batch]
        try:
            joined = [torch.cat([p.tensors[i] for p in batch], dim) for i in range(len(first.tensors))]
            args, kwargs = _rebuild((first.args, first.kwargs), joined, [0])
            out = self._run(args, kwargs)
            why = unsplittable(out, sizes, dim)
            parts = None if why else split_output(out, sizes, dim)
        except BaseException:  # which call's input? each runs alone and fails alone
            self._each_alone(batch)
            return
        if why:
            self._refuse(first.key, f"its output cannot be split by the calls' sizes: {why}")
            self._each_alone(batch)
            return
        if first.key not in self._verified:
            # the first joined batch of its kind: its first call also runs alone, and must get
            # what it gets joined (a flattened output whose size happens to match the batch's, or
            # rows that are not independent along dim, would be split wrong without a word)
            # (the first call's answer is then its run alone, output or error: never a third run)
            try:
                alone = ("ok", self._run(first.args, first.kwargs))
            except BaseException as exc:  # the call's own failure, alone
                alone, why = ("error", exc), f"its first call alone raised {type(exc).__name__}: {exc}"
            else:
                try:
                    why = differs(alone[1], parts[0])
                except BaseException as exc:
                    why = f"comparing it with its part raised {type(exc).__name__}: {exc}"
            if why:
                self._refuse(first.key, f"a call alone does not get its part of the joined output: {why}")
                self.count("run_again_alone")
                first.future.set_result(alone)
                self._each_alone(batch[1:])
                return
            if len(self._verified) >= _MAX_VERIFIED:
                self._verified.clear()
            self._verified.add(first.key)
        self.count("joined_forwards")
        self.count("joined_calls", len(batch))
        for p, part in zip(batch, parts):
            p.future.set_result(("ok", part))

    def _refuse(self, key: Any, why: str) -> None:
        """Calls of ``key`` run alone from now on (all calls, once ``_MAX_UNSPLIT`` keys were
        refused); the first refusal warns, saying why."""
        if key in self._unsplit:
            return
        if not self._unsplit:
            _warn(f"remote_module batching of {self._name} (dim={self.policy.dim}): {why}. Calls with such "
                  f"arguments run one by one from now on (all its calls, once {_MAX_UNSPLIT} kinds of arguments "
                  "were refused).", RuntimeWarning, stacklevel=1)
        self._unsplit.add(key)
        if len(self._unsplit) >= _MAX_UNSPLIT:
            self._splits = False


def _warn(message: str, category: type, stacklevel: int) -> None:
    """``warnings.warn``, never raising here (a host run with ``-W error``: the batch is answered)."""
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    except Exception:
        pass


#: module key -> its Batcher (host side)
_batchers: dict[Any, Batcher] = {}
_lock = threading.Lock()


def start_batching(key: Any, module: Any, policy: BatchPolicy, run: Callable[[tuple, dict], Any]) -> None:
    """Give the module held under ``key`` a batcher (stopped when the module is freed)."""
    batcher = Batcher(policy, run, type(module).__qualname__)
    with _lock:
        old = _batchers.get(key)
        _batchers[key] = batcher
    if old is not None:
        old.close()

    def stop(k: Any = key, b: Batcher = batcher) -> None:
        with _lock:
            if _batchers.get(k) is b:
                del _batchers[k]
        b.close()

    weakref.finalize(module, stop)


def batcher_of(key: Any) -> Batcher | None:
    """The batcher of the module held under ``key`` (None: it does not batch)."""
    return _batchers.get(key) if _batchers else None
