"""Where shards live: a per-process store of local tensors by shard id, and the RPC handlers
that fill, read, transform and empty it.

A shard id is ``(caller worker name, serial, index)``, chosen by the caller, so a caller can
release the outputs of a call that failed or timed out without having heard back. A release
that arrives before what it releases (the call was late) leaves a tombstone, and the late
tensor is dropped on arrival instead of being kept forever.

Handlers (module-level, pickled by reference; run through ``remote_module._core.fanout``):

- :func:`_keep`: store a tensor sent by the caller (``distribute``);
- :func:`_run_fn`: run a user function with the shard's mesh position, store what it returns
  (``from_local``); :func:`_adopt`: store the value of an RRef owned here;
- :func:`_forward`: run a ``LocalModule`` shard on stored inputs, store its outputs;
- :func:`_fetch`: a stored tensor, to the caller (``full_tensor``/``local_shards``);
- :func:`_redistribute`: make a new local tensor from this rank's and its peers' (the peers
  answer :func:`_piece`), worker to worker;
- :func:`_release`: forget shards.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from remote_module._core import (
    HostStore,
    call_all_async,
    device_map_to,
    host_device,
    hosted_module,
    map_leaves,
    move_cpu_tensors,
    tensors_to_cpu,
)

# Imported with the store on purpose (it imports torch.distributed.tensor, ~1 s): a worker pays
# for it on its first shard call, not inside a redistribute whose nested fetches have a budget.
from remote_module.sharded import _placements as pl
from remote_module.sharded._mesh import run_as

ShardId = tuple  # (caller name, serial, index)

#: Tombstones kept at most (releases of shards never stored; oldest forgotten first).
_MAX_TOMBSTONES = 100_000


class Meta(NamedTuple):
    """What the caller learns of a stored tensor without fetching it."""

    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def from_wire(wire: tuple) -> "Meta":
        """The Meta of :func:`meta_of`'s wire form."""
        return Meta(torch.Size(wire[0]), dtype_named(wire[1]), wire[2])


_dtype_names: dict[torch.dtype, str] = {}
_dtypes_by_name: dict[str, torch.dtype] = {}


def dtype_named(name: str) -> torch.dtype:
    """The dtype :func:`meta_of` named ``name`` (``"float32"``)."""
    dtype = _dtypes_by_name.get(name)
    if dtype is None:
        dtype = getattr(torch, name)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name!r} names no torch dtype")
        _dtypes_by_name[name] = dtype
    return dtype


class Ref(NamedTuple):
    """Stands, in a call's arguments, for the stored tensor ``sid`` on the host."""

    sid: ShardId


def meta_of(t: torch.Tensor) -> tuple:
    """A stored tensor's :class:`Meta` as it travels: plain ints, a dtype name and a bool (a
    ``torch.Size`` and a ``torch.dtype`` cost far more to pickle)."""
    dtype = t.dtype
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).rpartition(".")[2]
    return tuple(t.shape), name, t.requires_grad


def _keep_shard(sid: ShardId, t: torch.Tensor) -> tuple:
    """Hold ``t`` as shard ``sid`` (dropped when ``sid`` was released before it arrived); its
    :class:`Meta` as it travels."""
    try:
        _store.put(sid, t)
    except KeyError:
        raise RuntimeError(f"shard id {sid} is already in use on this worker") from None
    return meta_of(t)


def _shard(sid: ShardId) -> torch.Tensor:
    t = _store.get(sid)
    if t is None:
        raise LookupError(
            f"shard {sid} does not exist on worker {rpc.get_worker_info().name!r}: its RemoteTensor "
            "was released (garbage-collected) or never stored here"
        )
    return t


#: This process's shards by shard id; a release of a shard not stored yet (its call was late)
#: leaves a tombstone, and the late tensor is dropped on arrival.
_store = HostStore(max_tombstones=_MAX_TOMBSTONES)


def _resolved(obj: Any) -> Any:
    """``obj`` with every :class:`Ref` (at any depth of lists, tuples, named tuples, dicts)
    replaced by its tensor: the same walk the caller made to put the Refs there."""
    return map_leaves(lambda ref: _shard(ref.sid), obj, Ref)


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied when it is a view into a larger storage or not contiguous, so that
    sending it carries its own elements only."""
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def portable(t: torch.Tensor, dest: str) -> torch.Tensor:
    """``t`` as it may travel to ``dest``: off the CPU only where a device map to ``dest`` is set."""
    if t.device.type == "cpu" or device_map_to(dest):
        return compact(t)
    return compact(tensors_to_cpu(t))


def flatten(out: Any, path: str = "output") -> tuple[list[Any], Any]:
    """The leaves of a (nested) tuple/list output, in order, and its structure: ``None`` for a
    leaf, ``("tuple" | "list", [children])`` for a container."""
    if isinstance(out, (tuple, list)) and not hasattr(out, "_fields"):
        leaves: list[Any] = []
        children = []
        for i, item in enumerate(out):
            sub, spec = flatten(item, f"{path}[{i}]")
            leaves.extend(sub)
            children.append(spec)
        return leaves, ("tuple" if isinstance(out, tuple) else "list", children)
    return [out], None


def unflatten(spec: Any, leaves: Sequence[Any]) -> Any:
    """The inverse of :func:`flatten`."""
    return _rebuild(spec, iter(leaves))


def _rebuild(spec: Any, it: Any) -> Any:
    # A module-level function, not a closure: a recursive closure is a reference cycle that
    # kept ``leaves`` (the caller's RemoteTensors) alive until the cyclic GC ran.
    if spec is None:
        return next(it)
    kind, children = spec
    items = [_rebuild(c, it) for c in children]
    return tuple(items) if kind == "tuple" else items


# ---- handlers ------------------------------------------------------------------------------


def _keep(sid: ShardId, t: torch.Tensor) -> tuple:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"a shard must be a tensor, got {type(t).__name__}")
    return _keep_shard(sid, t)


def _run_fn(sid: ShardId, fn: Any, args: tuple, kwargs: dict, rank: int, size: int, grad: bool) -> tuple:
    t = run_as(rank, size, grad, fn, *args, **kwargs)
    if not isinstance(t, torch.Tensor):
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"from_local: {name}(...) must return a tensor on every worker, got {type(t).__name__}: {t!r:.80}"
        )
    return _keep_shard(sid, t)


def _adopt(sid: ShardId, rref: rpc.RRef) -> tuple:
    t = rref.local_value()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"from_local: an RRef must hold a tensor, got RRef[{type(t).__name__}]")
    return _keep_shard(sid, t)


def _dropping(drop: tuple | None) -> None:
    """Release what a call carried for this worker (see ``_tensor._Releaser.take``)."""
    if drop is not None:
        _store.release(drop[0], False)
        _store.release(drop[1], True)


def _fetch(sid: ShardId, dest: str, drop: tuple | None = None) -> torch.Tensor:
    _dropping(drop)
    return portable(_shard(sid), dest)


def _release(sids: Sequence[ShardId], unsure: bool = False) -> None:
    _store.release(sids, unsure)


def _forward(
    key: Any, device: str, rank: int, size: int, args: tuple, kwargs: dict, sids: Sequence[ShardId], grad: bool,
    drop: tuple | None = None,
) -> tuple[Any, list[tuple]]:
    """Run the shard module on its local inputs; store its outputs under ``sids`` (one per
    declared output placement). Returns the output structure and each output's meta."""
    if drop is not None:
        _dropping(drop)
    module = hosted_module(key)
    args = tuple([_shard(a.sid) if type(a) is Ref else _resolved(a) for a in args])
    if kwargs:
        kwargs = _resolved(kwargs)
    dev = host_device(device)
    if dev.type != "cpu":
        args, kwargs = move_cpu_tensors(args, dev), move_cpu_tensors(kwargs, dev)
    out = run_as(rank, size, grad, module, *args, **kwargs)
    if type(out) is torch.Tensor and len(sids) == 1:  # the common case: one tensor
        return None, [_keep_shard(sids[0], out)]
    leaves, spec = flatten(out)
    if len(leaves) != len(sids):
        raise ValueError(
            f"the shard module on mesh rank {rank} returned {len(leaves)} output(s), but out_placements "
            f"declares {len(sids)}: pass one placement per output tensor (outputs are the tensors of the "
            "returned tuple/list, flattened in order)"
        )
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"output {i} of the shard module on mesh rank {rank} is {type(leaf).__name__}: {leaf!r:.80}; "
                "every output with a declared placement must be a tensor"
            )
    metas = [_keep_shard(sid, t) for sid, t in zip(sids, leaves)]
    return spec, metas


def _piece(sid: ShardId, src: Any, dst: Any, rank: int, size: int, dest: str) -> torch.Tensor:
    return portable(pl.piece_for(src, dst, rank, size, _shard(sid)), dest)


@rpc.functions.async_execution
def _redistribute(
    sid: ShardId, new_sid: ShardId, src: Any, dst: Any, rank: int, peers: Sequence[tuple[str, ShardId]], seconds: float,
    grad: bool = True,
) -> Future:
    """This rank's tensor under ``dst``, from its own under ``src`` and pieces from ``peers``
    (``(worker, shard id)`` per rank), fetched concurrently, worker to worker; in the caller's
    grad mode ``grad``."""
    own = _shard(sid)
    size = len(peers)
    me = rpc.get_worker_info().name
    if not pl.needs_peers(src, dst):
        done: Future = Future()
        # compact: a slice of a replicated tensor would keep the whole of it alive on this worker
        new = run_as(rank, size, grad, pl.combine, src, dst, rank, size, [], own)
        done.set_result(_keep_shard(new_sid, compact(new)))
        return done
    calls = [(w, _piece, (psid, src, dst, rank, size, me)) for p, (w, psid) in enumerate(peers) if p != rank]
    fetched = call_all_async(calls, timeout=seconds)

    def finish(fut: Future) -> tuple:
        try:
            got = fut.value()
        except BaseException as exc:
            # Raised without the traceback that holds ``fut``, which holds ``exc`` where the
            # cycle collector cannot see it (this frame, and ``own`` with it, would be kept).
            exc.__traceback__ = None
            failure: BaseException | None = exc
        else:
            failure = None
        del fut
        if failure is not None:
            raise failure
        others = iter(got)
        pieces = [pl.piece_for(src, dst, rank, size, own) if p == rank else next(others) for p in range(size)]
        pieces = [t.to(own.device) for t in pieces]
        new = run_as(rank, size, grad, pl.combine, src, dst, rank, size, pieces, own)
        return _keep_shard(new_sid, compact(new))

    return fetched.then(finish)
