"""Meshes (ordered lists of workers) and a shard's position in one: :func:`mesh_rank`,
:func:`mesh_size`.

A mesh here is 1-D: an ordered list of worker names; a worker's index in it is its mesh rank.
Items may carry a device (``"worker1/cuda:0"``) where a module is placed (``LocalModule``);
the mesh itself is the worker names. A 2-D mesh (e.g. data-parallel x tensor-parallel) would
need a placement per mesh dimension, shards addressed by a coordinate instead of one rank, and
collectives along one mesh dimension at a time (a redistribute per dimension); none of that
exists yet.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch
import torch.distributed.rpc as rpc

from remote_module._core import is_rpc_initialized, worker_names


def check_mesh(mesh: Any, what: str = "mesh") -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(workers, devices)`` of a mesh given as a sequence of worker names, ranks or
    ``"worker/device"`` strings; ``ValueError``/``TypeError`` naming the bad item."""
    if isinstance(mesh, (str, bytes)) or not isinstance(mesh, Sequence):
        raise TypeError(
            f"{what} must be a list of worker names (e.g. ['worker1', 'worker2']), got {type(mesh).__name__}: {mesh!r}"
        )
    if len(mesh) == 0:
        raise ValueError(f"{what} must name at least one worker, got an empty list")
    if not is_rpc_initialized():
        raise RuntimeError(f"{what}: torch.distributed.rpc is not initialized; call rpc.init_rpc(...) first")
    workers, devices = [], []
    for i, item in enumerate(mesh):
        if isinstance(item, bool) or not isinstance(item, (str, int)):
            raise TypeError(f"{what}[{i}] must be a worker name or rank, got {type(item).__name__}: {item!r}")
        worker, device = item, "cpu"
        if isinstance(item, str) and "/" in item:
            worker, device = item.split("/", 1)
        try:
            name = rpc.get_worker_info(worker).name
        except RuntimeError:
            raise ValueError(
                f"{what}[{i}] = {item!r} is not a worker of this RPC world (workers: {', '.join(worker_names())})"
            ) from None
        if name in workers:
            raise ValueError(f"{what}[{i}] = {item!r} names worker {name!r} twice; each worker appears once in a mesh")
        workers.append(name)
        devices.append(device)
    return tuple(workers), tuple(devices)


# ---- a shard's position, on its worker -----------------------------------------------------

_here = threading.local()


def run_as(rank: int, size: int, grad: bool, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with :func:`mesh_rank` / :func:`mesh_size` answering ``rank`` /
    ``size`` in this thread, and grad mode ``grad`` (both restored after)."""
    saved = getattr(_here, "position", None)
    _here.position = (rank, size)
    was = torch.is_grad_enabled()
    if was != grad:
        torch.set_grad_enabled(grad)
    try:
        return fn(*args, **kwargs)
    finally:
        _here.position = saved
        if was != grad:
            torch.set_grad_enabled(was)


def _position(name: str) -> tuple[int, int]:
    position = getattr(_here, "position", None)
    if position is None:
        raise RuntimeError(
            f"{name}() is only valid while a shard runs on its worker: inside a LocalModule's forward "
            "or a function given to from_local"
        )
    return position


def mesh_rank() -> int:
    """This shard's index in its mesh, while a shard runs on its worker.

    Example (a module run by ``LocalModule`` on every worker of the mesh)::

        class Scaled(nn.Module):
            def forward(self, x):
                return x * (mesh_rank() + 1)      # rank 0 doubles nothing, rank 1 doubles, ...
    """
    return _position("mesh_rank")[0]


def mesh_size() -> int:
    """The number of workers in the mesh, while a shard runs on its worker (see :func:`mesh_rank`).

    Example::

        def make_rows():                          # from_local(make_rows, mesh, Shard(0))
            return torch.full((2, 4), float(mesh_rank()) / mesh_size())
    """
    return _position("mesh_size")[1]
