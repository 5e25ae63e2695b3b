"""Placement on parameter servers: slicing a parameter (or a table's rows) into blocks, the
transpiler's rule as pure functions, and dispatchers, which say which server owns each block
(:func:`place` checks what one answers). A dispatcher is a callable ``(block_names, servers) ->
list of servers``, one per block; any callable of that shape may replace the two here.

A parameter of ``numel`` elements is cut, in row-major order, into at most ``num_servers``
blocks of at least ``min_block_size`` elements each (fewer for a small parameter; one for a
parameter smaller than ``min_block_size``). A parameter of two or more dimensions is cut on
whole rows, so each block is a run of rows. Every block but the last has the same size; the
last holds the rest.
"""

from __future__ import annotations

import math
import operator
import zlib
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed.rpc as rpc

from remote_module._core import positive_int, worker_names


class Block(NamedTuple):
    """One block of a parameter: its ``index`` among the parameter's blocks, its ``offset`` and
    ``size`` in elements of the flattened (row-major) parameter."""

    index: int
    offset: int
    size: int


def _index(value: object, what: str) -> int:
    """``value`` as an ``int``, if it is an integer of any kind ``operator.index`` accepts
    (``int``, ``numpy.int64``, a 0-d integer tensor...), as ``nn.Embedding`` takes its sizes;
    ``TypeError`` for a bool, a float or anything else."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{what} must be an int (or an integer such as numpy.int64), got {type(value).__name__} "
                    f"{value!r}: pass a whole number as an int")


def slice_blocks(
    shape: Sequence[int], num_servers: int, min_block_size: int = 8192, slice_var_up: bool = True
) -> list[Block]:
    """The blocks of a parameter of ``shape`` spread over ``num_servers`` servers.

    ``split = min(num_servers, max(1, numel // min_block_size))`` blocks of
    ``ceil(numel / split)`` elements, rounded up to whole rows (``prod(shape[1:])``) for two or
    more dimensions; then ``split = ceil(numel / block)``. ``slice_var_up=False``: one block.

    Example::

        >>> [b.size for b in slice_blocks((10000, 8), 3)]
        [26672, 26672, 26656]
        >>> slice_blocks((100,), 3)
        [Block(index=0, offset=0, size=100)]
    """
    try:
        dims = [int(d) for d in shape]
    except TypeError:
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape must have non-negative sizes, got {tuple(dims)}")
    positive_int(num_servers, "num_servers")
    positive_int(min_block_size, "min_block_size")
    if not isinstance(slice_var_up, bool):
        raise TypeError(f"slice_var_up must be True (slice parameters over the servers) or False (one block each), "
                        f"got {slice_var_up!r}")
    numel = math.prod(dims)
    if numel == 0:
        return [Block(0, 0, 0)]
    if not slice_var_up:
        return [Block(0, 0, numel)]
    split = min(num_servers, max(1, numel // min_block_size))
    block = math.ceil(numel / split)
    if len(dims) >= 2:
        row = math.prod(dims[1:])
        block = math.ceil(block / row) * row
    split = math.ceil(numel / block)
    return [Block(i, i * block, min(block, numel - i * block)) for i in range(split)]


def block_name(param_name: str, index: int) -> str:
    """A block's name: ``"<parameter name>.block<index>"``."""
    return f"{param_name}.block{index}"


def block_of(tensor: torch.Tensor, block: Block) -> torch.Tensor:
    """The part of ``tensor`` that ``block`` covers, as a view of ``tensor`` (writing into it
    writes the parameter), for any strides: a block of a tensor of two or more dimensions is a
    run of whole rows, of a 1-D tensor a run of elements, of a 0-dim tensor the tensor itself.
    Its elements in row-major order are the block's elements (``.reshape(-1)``), whatever the
    tensor's memory format (``channels_last``, a transposed parameter): a non-contiguous
    parameter needs no ``view(-1)``, which it does not have.

    Example::

        >>> w = torch.arange(12.0).reshape(3, 4).t()      # non-contiguous, shape (4, 3)
        >>> [block_of(w, b).reshape(-1).tolist() for b in slice_blocks(w.shape, 2, 4)]
        [[0.0, 4.0, 8.0, 1.0, 5.0, 9.0], [2.0, 6.0, 10.0, 3.0, 7.0, 11.0]]
    """
    if tensor.dim() == 0 or (block.offset == 0 and block.size == tensor.numel()):
        return tensor
    if tensor.dim() == 1:
        return tensor[block.offset:block.offset + block.size]
    row = tensor.numel() // tensor.shape[0]
    if block.offset % row or block.size % row:
        raise ValueError(
            f"block {block} of a tensor of shape {tuple(tensor.shape)} is not a run of whole rows of {row} "
            "elements: slice parameters with slice_blocks"
        )
    return tensor[block.offset // row:(block.offset + block.size) // row]


# ---- dispatchers ------------------------------------------------------------------------------

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


def place(split_method: Any, names: Sequence[str], servers: Sequence[str]) -> list[str]:
    """The server of each block of ``names``, as ``split_method`` (a dispatcher) places them,
    checked: one of ``servers`` per block (``ValueError`` naming what it returned otherwise)."""
    if not callable(split_method):
        raise TypeError(f"split_method must be a dispatcher: RoundRobin(), HashName() or a callable "
                        f"(block names, servers) -> one server per block, got {split_method!r}")
    chosen = list(split_method(names, servers))
    if len(chosen) != len(names) or any(c not in servers for c in chosen):
        raise ValueError(
            f"split_method {split_method!r} must return one of the servers {list(servers)} per block "
            f"({len(names)} blocks), got {chosen!r:.200}"
        )
    return chosen
