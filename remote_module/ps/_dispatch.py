"""Dispatchers: which server owns each block. A dispatcher is a callable
``(block_names, servers) -> list of servers``, one per block; any callable of that shape
may replace the two here."""

from __future__ import annotations

import zlib
from typing import Sequence


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
