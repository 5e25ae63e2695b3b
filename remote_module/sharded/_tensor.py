"""RemoteTensor: a tensor sharded over a mesh of workers, each shard held where it was made;
:func:`distribute` and :func:`from_local` make one."""

from __future__ import annotations

import itertools
import queue
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed.rpc as rpc
from torch.distributed.tensor import Partial, Replicate, Shard

from remote_module._core import call_all, nested_seconds, send_and_forget, send_to_each, timeout_seconds, wait_plain
from remote_module.sharded import _host
from remote_module.sharded import _placements as pl
from remote_module.sharded._host import Meta, ShardId
from remote_module.sharded._mesh import check_mesh

_serials = itertools.count(1)


def new_sids(n: int, count: int = 1, caller: str | None = None) -> list[list[ShardId]]:
    """``count`` fresh shard ids for each of ``n`` ranks: ``ids[rank][i]``."""
    caller = caller if caller is not None else rpc.get_worker_info().name
    base = [next(_serials) for _ in range(count)]
    return [[(caller, s, rank) for s in base] for rank in range(n)]


# ---- freeing shards when their RemoteTensor goes -------------------------------------------


#: Seconds a release waits for a call to the same worker to carry it before it is sent alone.
RELEASE_DELAY_S = 0.05


class _Releaser:
    """Frees shards on their workers without a message of their own where possible.

    A finalizer only queues (it may run in any thread, inside a dist autograd context or while
    torch holds a lock). The next call this process makes to that worker with a shard handler
    (a forward, a fetch) carries the queued releases (:meth:`take`); what no call has taken
    within :data:`RELEASE_DELAY_S` is sent by a background thread, one message per worker."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # finalizers put here: no lock taken
        # Re-entrant: a finalizer may run (and queue) inside this lock, e.g. while the thread starts.
        self._lock = threading.RLock()
        self._pending: dict[str, tuple[list[ShardId], list[ShardId]]] = {}  # worker -> (sure, unsure)
        self._thread: threading.Thread | None = None

    def later(self, worker: str, sids: Sequence[ShardId], unsure: bool = False) -> None:
        self._queue.put((worker, tuple(sids), unsure))
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="remote_module-shard-release", daemon=True)
                    self._thread.start()

    def _absorb_locked(self) -> None:
        while True:
            try:
                worker, sids, unsure = self._queue.get_nowait()
            except queue.Empty:
                return
            sure_ids, unsure_ids = self._pending.setdefault(worker, ([], []))
            (unsure_ids if unsure else sure_ids).extend(sids)

    def take(self, worker: str) -> tuple[list[ShardId], list[ShardId]] | None:
        """The releases queued for ``worker`` (sure, unsure), for a call to carry; None if none."""
        if self._thread is None:
            return None
        with self._lock:
            self._absorb_locked()
            return self._pending.pop(worker, None)

    def give_back(self, worker: str, taken: tuple[list[ShardId], list[ShardId]] | None) -> None:
        """Releases a call took but may not have delivered (it failed): queue them again. A
        release delivered twice is harmless."""
        if taken is not None:
            for unsure, sids in ((False, taken[0]), (True, taken[1])):
                if sids:
                    self.later(worker, sids, unsure)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            self._queue.put(first)  # absorbed below, with whatever follows it
            time.sleep(RELEASE_DELAY_S)  # a call to the worker may take them meanwhile
            with self._lock:
                self._absorb_locked()
                pending, self._pending = self._pending, {}
            for worker, (sure_ids, unsure_ids) in pending.items():
                for unsure, sids in ((False, sure_ids), (True, unsure_ids)):
                    if sids:
                        # the world gone (RPC down) takes the shards with it: nothing to free then
                        send_and_forget(worker, _host._release, (sids, unsure))


_releaser = _Releaser()


def _carrying_releases(names: Sequence[str], send: Callable[[list], list[Any]]) -> list[Any]:
    """``send(taken)`` with ``taken[i]`` the releases queued for worker ``names[i]`` (see
    :meth:`_Releaser.take`), for each call to carry as its last argument; they are queued again
    when the calls fail."""
    taken = [_releaser.take(name) for name in names]
    try:
        return send(taken)
    except BaseException:
        for name, t in zip(names, taken):
            _releaser.give_back(name, t)
        raise


def call_carrying_releases(calls: list[tuple], timeout: float | None) -> list[Any]:
    """``call_all(calls)`` where each call's last argument is the releases queued for its
    worker."""
    names = [w.name if isinstance(w, rpc.WorkerInfo) else w for w, _, _ in calls]
    return _carrying_releases(
        names, lambda taken: call_all([(w, h, (*args, t)) for (w, h, args), t in zip(calls, taken)], timeout=timeout))


def each_carrying_releases(infos: Sequence[rpc.WorkerInfo], handler: Callable[..., Any], args: list[tuple],
                           seconds: float) -> list[Any]:
    """:func:`call_carrying_releases` for one handler and checked ``WorkerInfo``s (see
    ``send_to_each``): ``handler(*args[r], releases for infos[r])`` on every ``infos[r]``."""
    return _carrying_releases(
        [info.name for info in infos],
        lambda taken: wait_plain(send_to_each(infos, handler, [(*a, t) for a, t in zip(args, taken)], seconds)))


def release_later(mesh: Sequence[str], sids: Sequence[Sequence[ShardId]], unsure: bool = False) -> None:
    """Free ``sids[rank]`` on ``mesh[rank]``: carried by the next call there, or sent soon."""
    for worker, ids in zip(mesh, sids):
        if ids:
            _releaser.later(worker, list(ids), unsure)


# ---- RemoteTensor ------------------------------------------------------------------------


def _global_shape(placement: Any, shapes: list[tuple]) -> torch.Size:
    """:func:`pl.global_shape` for shapes as tuples of ints (a shard's metadata as it travels),
    without a ``torch.Size`` per rank; a shape that does not fit gets its error."""
    first = shapes[0]
    dim = pl.shard_dim_or_none(placement)
    if dim is None:
        if all(s == first for s in shapes):
            return torch.Size(first)
    elif 0 <= dim < len(first):
        head, tail = first[:dim], first[dim + 1:]
        if all(len(s) == len(first) and s[:dim] == head and s[dim + 1:] == tail for s in shapes):
            return torch.Size((*head, sum(s[dim] for s in shapes), *tail))
    return pl.global_shape(placement, shapes, "the RemoteTensor")



class RemoteTensor:
    """A tensor sharded over a mesh of workers: one local tensor per worker, held there.

    The caller holds only the mesh, the placement (torch's ``Shard(dim)``, ``Replicate()`` or
    ``Partial(op)``), the global shape and dtype and each worker's local shape, all known
    without fetching data. Shards stay on their workers until :meth:`full_tensor` or
    :meth:`local_shards` fetches them; :meth:`redistribute` moves data worker to worker.
    When the RemoteTensor is garbage-collected its shards are freed on their workers.

    Made by :func:`distribute`, :func:`from_local` and ``LocalModule``; not constructed directly.

    Example (worker0 drives; worker1 and worker2 only join RPC and wait)::

        x = distribute(torch.arange(10.0), ["worker1", "worker2"], Shard(0))
        x.shape, x.local_shapes          # torch.Size([10]), (torch.Size([5]), torch.Size([5]))
        x.redistribute(Replicate()).full_tensor()     # tensor([0., 1., ..., 9.])
    """

    __slots__ = (
        "mesh", "placement", "shape", "dtype", "requires_grad", "local_shapes", "timeout", "_sids", "__weakref__",
    )

    def __init__(self, *, _mesh: tuple[str, ...], _placement: Any, _metas: Sequence[Meta], _sids: Sequence[ShardId],
                 _timeout: float | None = None) -> None:
        # Frees the shards even when the checks below fail.
        weakref.finalize(self, release_later, _mesh, [[sid] for sid in _sids]).atexit = False
        _metas = [Meta.from_wire(m) if not isinstance(m, Meta) else m for m in _metas]
        ndim = len(_metas[0].shape)
        placement = pl.normalized(_placement, ndim, "placement")
        dtypes = {m.dtype for m in _metas}
        if len(dtypes) > 1:
            raise ValueError(
                "every worker's shard must have one dtype, got "
                + ", ".join(f"{w}: {m.dtype}" for w, m in zip(_mesh, _metas))
            )
        pl.check_op_dtype(placement, _metas[0].dtype)
        self.shape = pl.global_shape(placement, [m.shape for m in _metas], "the RemoteTensor")
        self.mesh = _mesh
        self.placement = placement
        self.dtype = _metas[0].dtype
        self.requires_grad = any(m.requires_grad for m in _metas)
        self.local_shapes = tuple(torch.Size(m.shape) for m in _metas)
        self.timeout = _timeout
        self._sids = tuple(_sids)

    @classmethod
    def _of_shards(cls, mesh: tuple[str, ...], placement: Any, shapes: list[tuple], dtype: torch.dtype,
                   requires_grad: bool, sids: Sequence[ShardId], timeout: float | None) -> "RemoteTensor":
        """A RemoteTensor of shards whose metadata the caller checked (``placement`` normalised
        and valid for ``dtype``; ``shapes`` as tuples of ints): no checks, no conversions."""
        self = cls.__new__(cls)
        weakref.finalize(self, release_later, mesh, [[sid] for sid in sids]).atexit = False
        self.shape = _global_shape(placement, shapes)
        self.mesh = mesh
        self.placement = placement
        self.dtype = dtype
        self.requires_grad = requires_grad
        self.local_shapes = tuple(map(torch.Size, shapes))
        self.timeout = timeout
        self._sids = tuple(sids)
        return self

    @property
    def placements(self) -> tuple:
        """The placement as torch's ``placements`` tuple for a 1-D mesh."""
        return (self.placement,)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def __repr__(self) -> str:
        return (
            f"RemoteTensor(shape={tuple(self.shape)}, dtype={self.dtype}, placement={pl.describe(self.placement)}, "
            f"mesh={list(self.mesh)})"
        )

    def __reduce__(self) -> Any:
        raise TypeError(
            "a RemoteTensor cannot be pickled or sent over RPC (its shards belong to this caller); send "
            "rt.full_tensor(), or pass it to a LocalModule, whose shards read their local pieces"
        )


    # ---- fetching -------------------------------------------------------------------

    def local_shards(self, timeout: float | None = None) -> list[torch.Tensor]:
        """Every worker's local tensor, in mesh order, fetched to the caller (copies).

        Example::

            a, b = distribute(torch.arange(5.0), ["worker1", "worker2"], Shard(0)).local_shards()
            # a == tensor([0., 1., 2.]), b == tensor([3., 4.])
        """
        me = rpc.get_worker_info().name
        calls = [(w, _host._fetch, (sid, me)) for w, sid in zip(self.mesh, self._sids)]
        return call_carrying_releases(calls, self._timeout(timeout))

    def full_tensor(self, timeout: float | None = None) -> torch.Tensor:
        """The global tensor on the caller: Shard -> the shards concatenated in mesh order,
        Replicate -> one copy (the first worker's; while autograd records, every copy is
        fetched so that each worker's graph gets a gradient), Partial -> the shards reduced.

        Inside ``dist_autograd.context()`` the fetch is recorded: a loss computed from it
        sends gradients back to every worker's graph.

        Example::

            total = out.full_tensor()     # out: Partial(sum) -> the sum of the workers' values
        """
        me = rpc.get_worker_info().name
        pairs = list(zip(self.mesh, self._sids))
        # Replicate: one copy is the value; while autograd records, every replica is fetched and
        # the others get a zero gradient (dist autograd waits for one at every send in the
        # context, and a replica made by redistribute holds pieces sent by the other workers)
        graded = isinstance(self.placement, Replicate) and self.requires_grad and torch.is_grad_enabled()
        if isinstance(self.placement, Replicate) and not graded:
            pairs = pairs[:1]
        tensors = call_carrying_releases([(w, _host._fetch, (sid, me)) for w, sid in pairs], self._timeout(timeout))
        device = tensors[0].device
        tensors = [t.to(device) for t in tensors]
        if graded:
            return pl.first_replica(tensors)
        return pl.assemble(self.placement, tensors)

    # ---- moving between placements ------------------------------------------------------

    def redistribute(self, placement: Any, timeout: float | None = None) -> "RemoteTensor":
        """This tensor under another placement, moving data worker to worker (never through
        the caller): Shard/Partial -> Replicate (all-gather / all-reduce), Replicate -> Shard
        or Partial (local slicing, no traffic), Shard(i) -> Shard(j) (all-to-all), Partial ->
        Shard (reduce-scatter), Shard -> Partial, Partial -> Partial(other op).

        Example::

            y = out.redistribute(Replicate())    # Partial(sum) -> every worker holds the sum
            z = y.redistribute(Shard(0))         # each keeps its rows; nothing travels
        """
        dst = pl.normalized(pl.check_placement(placement, "redistribute(placement)"), self.ndim, "redistribute")
        pl.check_op_dtype(dst, self.dtype, "redistribute(placement)")
        if dst == self.placement:
            return self
        n = len(self.mesh)
        new = [ids[0] for ids in new_sids(n)]
        peers = list(zip(self.mesh, self._sids))
        seconds = timeout_seconds(self._timeout(timeout))
        inner = nested_seconds(seconds)
        grad = torch.is_grad_enabled()
        calls = [
            (w, _host._redistribute, (sid, new[r], self.placement, dst, r, peers, inner, grad))
            for r, (w, sid) in enumerate(peers)
        ]
        try:
            metas = call_all(calls, timeout=self._timeout(timeout))
        except BaseException:
            release_later(self.mesh, [[sid] for sid in new], unsure=True)
            raise
        return RemoteTensor(_mesh=self.mesh, _placement=dst, _metas=metas, _sids=new, _timeout=self.timeout)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout


def _stored(
    mesh: tuple[str, ...], placement: Any, calls: list, sids: list[ShardId], timeout: float | None
) -> RemoteTensor:
    """Run ``calls`` (one per rank, each storing ``sids[rank]``) and wrap what they stored."""
    try:
        metas = call_all(calls, timeout=timeout)
    except BaseException:
        release_later(mesh, [[sid] for sid in sids], unsure=True)
        raise
    return RemoteTensor(_mesh=mesh, _placement=placement, _metas=metas, _sids=sids, _timeout=timeout)


def distribute(
    tensor: torch.Tensor, mesh: Sequence[Any], placement: Any, *, timeout: float | None = None
) -> RemoteTensor:
    """Put a caller's tensor onto the workers of ``mesh``: ``Shard(dim)`` splits it as
    ``torch.tensor_split`` does (uneven sizes allowed), ``Replicate()`` copies it to every
    worker, ``Partial(op)`` gives shares that reduce back to it. ``placement`` is one placement
    or a sequence of one. Inside ``dist_autograd.context()`` the sends are recorded.

    Example (worker0 drives; worker1 and worker2 only join RPC and wait)::

        x = distribute(torch.randn(6, 4), ["worker1", "worker2"], Shard(0))   # 3 rows each
        w = distribute(torch.randn(4, 4), ["worker1", "worker2"], Replicate())
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"distribute: tensor must be a torch.Tensor, got {type(tensor).__name__}: {tensor!r:.80}")
    workers, _ = check_mesh(mesh)
    p = pl.normalized(pl.check_placement(placement), tensor.dim(), "distribute")
    pl.check_op_dtype(p, tensor.dtype, "distribute")
    timeout_seconds(timeout)
    parts = pl.local_parts(tensor, p, len(workers))
    sids = [ids[0] for ids in new_sids(len(workers))]
    calls = [(w, _host._keep, (sid, _host.compact(part))) for w, sid, part in zip(workers, sids, parts)]
    return _stored(workers, p, calls, sids, timeout)


def from_local(
    fn: Callable[..., torch.Tensor] | Sequence[rpc.RRef],
    mesh: Sequence[Any],
    placement: Any,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    timeout: float | None = None,
) -> RemoteTensor:
    """Wrap tensors made on the workers: ``fn(*args, **kwargs)`` runs on every worker of
    ``mesh`` (concurrently; ``mesh_rank()``/``mesh_size()`` valid inside) and the tensor it
    returns stays there as that worker's shard. Or pass one ``RRef[Tensor]`` per worker, each
    owned by its mesh worker. ``fn`` is a module-level function (RPC sends it by reference).

    Example (worker0 drives; ``mylib.rows`` is importable on every worker)::

        # mylib.py
        def rows(width):
            return torch.full((2, width), float(mesh_rank()))
        # worker0
        x = from_local(mylib.rows, ["worker1", "worker2"], Shard(0), args=(3,))   # shape (4, 3)
    """
    workers, _ = check_mesh(mesh)
    p = pl.check_placement(placement)
    timeout_seconds(timeout)
    n = len(workers)
    sids = [ids[0] for ids in new_sids(n)]
    if isinstance(fn, (list, tuple)):
        rrefs = list(fn)
        if len(rrefs) != n:
            raise ValueError(f"from_local: expected one RRef per mesh worker ({n}), got {len(rrefs)}")
        for r, rref in enumerate(rrefs):
            if not isinstance(rref, rpc.PyRRef):
                raise TypeError(f"from_local: item {r} must be an RRef[Tensor], got {type(rref).__name__}")
            if rref.owner_name() != workers[r]:
                raise ValueError(
                    f"from_local: RRef {r} is owned by {rref.owner_name()!r}, but mesh rank {r} is {workers[r]!r}; "
                    "each worker's shard must be owned by that worker (order the RRefs as the mesh)"
                )
        calls = [(w, _host._adopt, (sid, rref)) for w, sid, rref in zip(workers, sids, rrefs)]
    elif callable(fn):
        if args is not None and not isinstance(args, (tuple, list)):
            raise TypeError(f"from_local: args must be a tuple, got {type(args).__name__}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"from_local: kwargs must be a dict or None, got {type(kwargs).__name__}")
        grad = torch.is_grad_enabled()
        calls = [
            (w, _host._run_fn, (sid, fn, tuple(args or ()), dict(kwargs or {}), r, n, grad))
            for r, (w, sid) in enumerate(zip(workers, sids))
        ]
    else:
        raise TypeError(
            f"from_local takes a module-level function or a list of RRef[Tensor] (one per mesh worker), "
            f"got {type(fn).__name__}: {fn!r:.80}"
        )
    return _stored(workers, p, calls, sids, timeout)


__all__ = ["RemoteTensor", "distribute", "from_local", "Shard", "Replicate", "Partial"]
