"""LocalModule: one module per worker of a mesh, each run on its local shards, outputs
combined by declared placements."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed.rpc as rpc
from torch import nn

from remote_module._core import (
    map_leaves,
    records_outside_context,
    retyped,
    timeout_seconds,
    unwarned_state,
    wait_for_earlier_calls,
    warn_untrained,
)
from remote_module.remote_module import RemoteModule
from remote_module.sharded import _host
from remote_module.sharded import _placements as pl
from remote_module.sharded._mesh import check_mesh
from remote_module.sharded._tensor import RemoteTensor, each_carrying_releases, new_sids, release_later
from rpc_backend.options import positive_seconds

_clock = time.monotonic


def _placement_list(value: Any, what: str, allow_none: bool) -> tuple | None:
    """A sequence of placements (``None`` entries where ``allow_none``); a bare placement is a
    sequence of one."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        value = (value,)
    out = []
    for i, p in enumerate(value):
        if p is None and allow_none:
            out.append(None)
        else:
            out.append(pl.check_placement(p, f"{what}[{i}]"))
    return tuple(out)


def _constructor_args(args: Any, kwargs: Any, n: int) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` for each of ``n`` ranks: the same for all, or ``args(rank)``."""
    if callable(args):
        if kwargs is not None:
            raise TypeError("LocalModule: when args is a callable rank -> (args, kwargs), pass kwargs=None")
        per_rank = []
        for r in range(n):
            got = args(r)
            if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], (tuple, list))
                    and (got[1] is None or isinstance(got[1], dict))):
                raise TypeError(
                    f"LocalModule: args({r}) must return a pair (args tuple, kwargs dict or None), got {got!r:.120}"
                )
            per_rank.append((tuple(got[0]), dict(got[1] or {})))
        return per_rank
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            f"LocalModule: args must be a tuple or a callable rank -> (args, kwargs), got {type(args).__name__}"
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"LocalModule: kwargs must be a dict or None, got {type(kwargs).__name__}")
    return [(tuple(args), dict(kwargs or {}))] * n


class _Hosts(NamedTuple):
    """What a forward needs of its shards that stays fixed in one process."""

    pid: int  # the process these were looked up in
    caller: str
    shards: tuple  # the shard proxies
    infos: tuple  # each shard's WorkerInfo (a WorkerInfo given to a call spares two name lookups)
    keys: tuple  # each shard module's key on its host
    devices: tuple  # each shard's device


class _PerRank:
    """An input given to each rank separately (its shard, or its part of a caller tensor)."""

    __slots__ = ("items",)

    def __init__(self, items: list) -> None:
        self.items = items


def _for_rank(value: Any, rank: int) -> Any:
    """What rank ``rank`` receives for an input: its own item, or the value with every
    RemoteTensor in it replaced by a reference to the rank's local shard."""
    if isinstance(value, _PerRank):
        return value.items[rank]
    return map_leaves(lambda rt: _host.Ref(rt._sids[rank]), value, RemoteTensor)


class LocalModule(nn.Module):
    """One ``module_cls`` instance on every worker of ``mesh``, each run on its local shards.

    Calling it with ``RemoteTensor`` inputs runs ``forward`` on every worker concurrently, on
    that worker's local shards (inside, :func:`mesh_rank`/:func:`mesh_size` say which), and
    returns ``RemoteTensor`` outputs with the declared ``out_placements``; no shard data passes
    through the caller. Outputs keep the module's structure: a tensor gives a RemoteTensor, a
    (nested) tuple or list gives the same structure of them; ``out_placements`` has one
    placement per output tensor, flattened in order (a bare placement for a single output).

    ``in_placements`` has one entry per positional input: a placement (a caller tensor is
    distributed by it; a RemoteTensor with another placement is redistributed, worker to
    worker) or ``None`` (the input as it is: a RemoteTensor's local shards, any other value
    sent to every worker as it is). Without ``in_placements`` every input is taken as it is.
    Keyword arguments are taken as they are.

    ``args``/``kwargs`` build the module on every worker; ``args`` may instead be a callable
    ``rank -> (args, kwargs)``, evaluated here. It is an ``nn.Module``: ``shards`` is an
    ``nn.ModuleList`` of ``RemoteModule`` proxies, so ``state_dict()`` keys are
    ``shards.<rank>.<the shard module's own key>``, ``train()``/``eval()`` reach every shard,
    and :meth:`remote_parameters` lists every shard's parameters (for ``DistributedOptimizer``).
    Inside ``dist_autograd.context()`` a loss computed from an output's ``full_tensor()``
    trains every shard. Outside one nothing is recorded across RPC: a forward with grad enabled
    whose shards have trainable parameters (or whose inputs require grad) warns once per
    LocalModule with a ``UserWarning`` saying what to do; under ``torch.no_grad()`` it is silent.

    Example (worker0 drives; worker1 and worker2 only join RPC and wait; ``Masked`` is importable
    on every worker)::

        class Masked(nn.Module):                      # mylib.py
            def forward(self, x):
                mask = torch.zeros(10)
                mask[[1, 2] if mesh_rank() == 0 else [4, 5, 6]] = 1
                return (x * mask).sum() / mask.sum()

        # worker0
        mesh = ["worker1", "worker2"]
        x = from_local(mylib.arange_plus_rank, mesh, Shard(0))      # arange(10) + rank per worker
        lm = LocalModule(mesh, Masked, out_placements=[Partial("sum")])
        out = lm(x)                                                 # RemoteTensor, Partial(sum)
        out.local_shards(), out.full_tensor()                       # [1.5, 6.0], 7.5
    """

    def __init__(
        self,
        mesh: Sequence[Any],
        module_cls: Any,
        args: tuple | Callable[[int], tuple[tuple, dict | None]] = (),
        kwargs: dict | None = None,
        *,
        out_placements: Any,
        in_placements: Any = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        self._warned_untrained = False  # the one warning of training outside dist autograd (_core.untrained)
        # This process's lookups (never pickled: see __getstate__): the hosts' WorkerInfos and
        # keys, and the placements checked per (input or output, ndim, dtype).
        self._hosts_cache: _Hosts | None = None
        self._wanted_cache: dict[tuple, tuple] = {}
        self._out_cache: dict[tuple, tuple] = {}
        workers, devices = check_mesh(mesh)
        self.mesh = workers
        self.timeout = None if timeout is None else positive_seconds(timeout, "timeout")
        if out_placements is None:
            raise TypeError("LocalModule: out_placements is required (one placement per output tensor)")
        self.out_placements = _placement_list(out_placements, "out_placements", allow_none=False)
        self.in_placements = _placement_list(in_placements, "in_placements", allow_none=True)
        per_rank = _constructor_args(args, kwargs, len(workers))
        pending = [
            RemoteModule.create_async(f"{w}/{d}", module_cls, a, k, timeout=self.timeout)
            for w, d, (a, k) in zip(workers, devices, per_rank)
        ]
        shards = []
        for r, fut in enumerate(pending):  # all sent first: one round trip in all
            try:
                shards.append(fut.wait())
            except Exception as exc:
                raise retyped(exc, f"creating LocalModule shard {r} on worker {workers[r]!r} failed: {exc}") from exc
        self.shards = nn.ModuleList(shards)

    def extra_repr(self) -> str:
        out = [pl.describe(p) for p in self.out_placements]
        text = f"mesh={list(self.mesh)}, out_placements={out}"
        if self.in_placements is not None:
            text += f", in_placements={[None if p is None else pl.describe(p) for p in self.in_placements]}"
        return text

    def _hosts(self) -> "_Hosts":
        """The caller's name and what the shards' calls need, looked up once per process
        (a copy sent to another process looks them up again there)."""
        hosts = self._hosts_cache
        if hosts is None or hosts.pid != os.getpid():
            hosts = _Hosts(
                os.getpid(),
                rpc.get_worker_info().name,
                tuple(self.shards),
                tuple(rpc.get_worker_info(s.on) for s in self.shards),
                tuple(s._target().key for s in self.shards),
                tuple(s.device for s in self.shards),
            )
            self._hosts_cache = hosts
        return hosts

    def __getstate__(self) -> dict:
        """As ``nn.Module``'s, less the once-warned flag and this process's lookups: a copy sent
        over RPC warns on its own and looks its hosts up there."""
        state = unwarned_state(self)
        state.update(_hosts_cache=None, _wanted_cache={}, _out_cache={})
        return state

    def remote_parameters(self, recurse: bool = True) -> list[rpc.RRef]:
        """RRefs of every shard's parameters, shard by shard, for ``DistributedOptimizer``.

        Example::

            from torch.distributed.optim import DistributedOptimizer

            opt = DistributedOptimizer(torch.optim.SGD, lm.remote_parameters(), lr=0.1)
        """
        return [p for shard in self.shards for p in shard.remote_parameters(recurse)]

    def requires_grad_(self, requires_grad: bool = True) -> "LocalModule":
        """Set ``requires_grad`` of every shard's parameters on their workers, as
        ``nn.Module.requires_grad_`` does for a local module, and return this LocalModule.

        ``nn.Module.requires_grad_`` walks ``parameters()``, which holds each shard proxy's
        ``remote_requires_grad`` handle: that handle sets the shard's flag on its worker, so a
        model holding this LocalModule reaches the shards too (one message per shard).

        Example::

            col.requires_grad_(False)      # freeze every shard
        """
        return super().requires_grad_(requires_grad)

    # ---- forward -----------------------------------------------------------------------

    def _input(self, i: int, value: Any, placement: Any, temps: list) -> Any:
        """Input ``i`` as the ranks receive it: a :class:`_PerRank` (each rank its own value),
        or a value sent to every rank, in which RemoteTensors (at any depth of lists, tuples
        and dicts) stand for their local shards."""
        if placement is None:
            map_leaves(lambda rt: self._check_mesh(f"input {i}", rt), value, RemoteTensor)
            return value
        if isinstance(value, RemoteTensor):
            self._check_mesh(f"input {i}", value)
            want = self._wanted(i, placement, value.ndim, value.dtype)
            if value.placement != want:
                value = value.redistribute(want, timeout=self.timeout)
                temps.append(value)
            return _PerRank([_host.Ref(sid) for sid in value._sids])
        if isinstance(value, torch.Tensor):
            # What distribute() would store, sent with the call instead (nothing to store or free).
            want = self._wanted(i, placement, value.dim(), value.dtype)
            return _PerRank([_host.compact(part) for part in pl.local_parts(value, want, len(self.mesh))])
        raise TypeError(
            f"LocalModule input {i} has in_placements[{i}] = {pl.describe(placement)}, so it must be a tensor or "
            f"a RemoteTensor, got {type(value).__name__}: {value!r:.80}; declare None to pass it as it is"
        )

    def _wanted(self, i: int, placement: Any, ndim: int, dtype: torch.dtype) -> Any:
        """``placement`` (``in_placements[i]``) normalised for an ``ndim``-d input of ``dtype``
        and checked, once per (input, ndim, dtype) for as long as ``in_placements[i]`` is that
        same object."""
        cache = self._wanted_cache
        found = cache.get((i, ndim, dtype))
        if found is None or found[0] is not placement:
            want = pl.normalized(placement, ndim, f"in_placements[{i}]")
            pl.check_op_dtype(want, dtype, f"in_placements[{i}]")
            found = cache[(i, ndim, dtype)] = (placement, want)
        return found[1]

    def _check_mesh(self, what: str, value: RemoteTensor) -> RemoteTensor:
        if tuple(value.mesh) != tuple(self.mesh):
            raise ValueError(
                f"LocalModule {what} lives on mesh {list(value.mesh)}, but this LocalModule's mesh is "
                f"{list(self.mesh)}: inputs must be on the module's mesh (same workers, same order)"
            )
        return value

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run every shard on its local inputs; RemoteTensor outputs by ``out_placements``."""
        made = _clock()
        n = len(self.mesh)
        if self.in_placements is not None and len(inputs) != len(self.in_placements):
            raise ValueError(
                f"LocalModule expects {len(self.in_placements)} input(s) (one per in_placements entry), "
                f"got {len(inputs)}"
            )
        placements = self.in_placements or (None,) * len(inputs)
        temps: list[RemoteTensor] = []  # kept alive until the shards have run
        hosts = self._hosts()
        per_input = [self._input(i, v, p, temps) for i, (v, p) in enumerate(zip(inputs, placements))]
        for k, v in kwargs.items():
            map_leaves(lambda rt, k=k: self._check_mesh(f"keyword argument {k!r}", rt), v, RemoteTensor)
        # after the checks: a call refused before any shard runs does not use up the one warning
        for shard in self.shards:  # a flag set as p.requires_grad = flag over parameters()
            shard._sync_requires_grad()
        grad = torch.is_grad_enabled()
        if grad and records_outside_context(self, any(s.remote_trainable for s in self.shards), inputs, kwargs):
            warn_untrained(self, f"LocalModule on mesh {list(self.mesh)}", "LocalModule", "local_module")
        seconds = timeout_seconds(self.timeout)
        deadline = made + seconds
        wait_for_earlier_calls(hosts.shards, deadline, lambda r, shard: f"LocalModule shard {r} on worker {shard.on!r}",
                               f"the timeout ({seconds:g} s)")
        count = len(self.out_placements)
        sids = new_sids(n, count, hosts.caller)
        args = [(hosts.keys[r], hosts.devices[r], r, n, tuple(_for_rank(v, r) for v in per_input),
                 {k: _for_rank(v, r) for k, v in kwargs.items()} if kwargs else {}, sids[r], grad)
                for r in range(n)]
        left = deadline - _clock()
        try:
            results = each_carrying_releases(hosts.infos, _host._forward, args, max(left, 0.001))
        except BaseException:
            release_later(self.mesh, sids, unsure=True)
            raise
        finally:
            del temps
        spec = results[0][0]
        for r in range(1, n):
            if results[r][0] != spec:
                release_later(self.mesh, sids)
                raise ValueError(
                    f"the shard modules returned differently structured outputs: mesh rank 0 returned {spec!r} "
                    f"and mesh rank {r} returned {results[r][0]!r} (None is a tensor; every rank must return the "
                    "same structure)"
                )
        outs = []
        try:
            for j in range(count):
                outs.append(self._output(j, [results[r][1][j] for r in range(n)], [sids[r][j] for r in range(n)]))
        except BaseException:
            release_later(self.mesh, [[sids[r][j] for j in range(len(outs), count)] for r in range(n)])
            raise
        return outs[0] if spec is None else _host.unflatten(spec, outs)

    def _output(self, j: int, metas: list[tuple], sids: list) -> RemoteTensor:
        """Output ``j`` from its shards' metadata as the hosts sent it (``_host.meta_of``); the
        declared placement is normalised and checked once per (output, ndim, dtype) for as long
        as ``out_placements[j]`` is that same object."""
        shape, dtype_name, _ = metas[0]
        cache = self._out_cache
        found = cache.get((j, len(shape), dtype_name))
        placement = self.out_placements[j]
        try:
            if found is None or found[0] is not placement:
                dtype = _host.dtype_named(dtype_name)
                want = pl.normalized(placement, len(shape), "placement")
                pl.check_op_dtype(want, dtype)
                found = cache[(j, len(shape), dtype_name)] = (placement, want, dtype)
            if any(m[1] != dtype_name for m in metas):
                raise ValueError(
                    "every worker's shard must have one dtype, got "
                    + ", ".join(f"{w}: {_host.dtype_named(m[1])}" for w, m in zip(self.mesh, metas))
                )
            return RemoteTensor._of_shards(self.mesh, found[1], [m[0] for m in metas], found[2],
                                           any(m[2] for m in metas), sids, self.timeout)
        except ValueError as exc:  # the caller releases this output's shards with the rest
            raise ValueError(f"LocalModule output {j} ({pl.describe(placement)}): {exc}") from None
