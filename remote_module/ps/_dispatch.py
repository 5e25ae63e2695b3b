"""Dispatchers: which server owns each block. A dispatcher is a callable
``(block_names, servers) -> list of servers``, one per block; any callable of that shape
may replace the two here."""

from __future__ import annotations

import zlib
from typing import Any, Sequence

import torch.distributed.rpc as rpc

from remote_module._core import worker_names


class RoundRobin:
    """Deal the blocks to the servers in turn, in the order given (the model's parameter
    order, each parameter's blocks in order), continuing across parameters.

    Example::

        >>> RoundRobin()(["w.block0", "w.block1", "b.block0"], ["ps0", "ps1"])
        ['ps0', 'ps1', 'ps0']
    """

    def __call__(self, block_names: Sequence[str], servers: Sequence[str]) -> list[str]:
        _check(servers)
        return [servers[i % len(servers)] for i in range(len(block_names))]

    def __repr__(self) -> str:
        return "RoundRobin()"


class HashName:
    """Send each block to ``servers[crc32(name) % len(servers)]``: the same server for the same
    name in every process and every run (``zlib.crc32`` of the UTF-8 name, not ``hash()``).

    Example::

        >>> HashName()(["w.block0"], ["ps0", "ps1"])
        ['ps0']
    """

    def __call__(self, block_names: Sequence[str], servers: Sequence[str]) -> list[str]:
        _check(servers)
        return [servers[zlib.crc32(name.encode("utf-8")) % len(servers)] for name in block_names]

    def __repr__(self) -> str:
        return "HashName()"


def _check(servers: Sequence[str]) -> None:
    if not servers:
        raise ValueError("a dispatcher needs at least one server, got none")


def check_servers(servers: Any) -> tuple[str, ...]:
    """``servers`` as worker names, checked: a non-empty list of distinct workers of this
    RPC world (``TypeError`` / ``ValueError`` naming the item otherwise)."""
    if isinstance(servers, (str, bytes)) or not isinstance(servers, Sequence) or not servers:
        raise TypeError(f"servers must be a non-empty list of worker names, got {servers!r}")
    names = []
    for i, s in enumerate(servers):
        try:
            names.append(rpc.get_worker_info(s).name)
        except RuntimeError:
            raise ValueError(
                f"servers[{i}] = {s!r} is not a worker of this RPC world (workers: {', '.join(worker_names())})"
            ) from None
    if len(set(names)) != len(names):
        raise ValueError(f"servers name a worker twice: {list(servers)}")
    return tuple(names)
