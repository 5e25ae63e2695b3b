"""Slicing a parameter into blocks for parameter servers: the transpiler's rule, as pure
functions (no RPC).

A parameter of ``numel`` elements is cut, in row-major order, into at most ``num_servers``
blocks of at least ``min_block_size`` elements each (fewer for a small parameter; one for a
parameter smaller than ``min_block_size``). A parameter of two or more dimensions is cut on
whole rows, so each block is a run of rows. Every block but the last has the same size; the
last holds the rest.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple, Sequence

import torch

from remote_module._core import positive_int


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
