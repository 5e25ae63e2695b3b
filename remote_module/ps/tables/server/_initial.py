"""A table's initial rows: a row's first value depends only on the table's seed, its name and
the row id (:func:`initial_rows`), so eager and lazy blocks, any split of the rows over servers
and every run give the same rows, and tables of other names or seeds independent ones. The
padding row (``padding_idx``) starts as zeros, as ``nn.Embedding`` creates it. Its hash
(:func:`mix64`) also places ids in the admission sketch (``tables.lifetime._admission``)."""

from __future__ import annotations

import hashlib
import math

import torch

# splitmix64 (Steele, Lea and Flood 2014), its published constants: the stream's increment
# and its finaliser's multipliers, as the int64s with the same 64 bits
_U64 = 1 << 64


def _as_int64(c: int) -> int:
    """The unsigned 64-bit constant ``c`` as the int64 with the same bits."""
    return c - _U64 if c >= 1 << 63 else c


_GAMMA = _as_int64(0x9E3779B97F4A7C15)
_MIX1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX2 = _as_int64(0x94D049BB133111EB)
# elements made at a time: temporaries of ~128 KB, which malloc reuses (a server kept ~30 MB
# more of its RSS after an eager 500,000 x 16 block made 2**18 at a time)
_CHUNK = 1 << 14


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``x``'s 64 bits by ``s`` (torch's ``>>`` is arithmetic:
    it copies the sign bit in, which the mask clears)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors, element-wise (a bijection of the 64 bits;
    multiplications wrap modulo 2**64, as torch's int64 arithmetic does)."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def row_key(seed: int, name: str) -> int:
    """A table's 64-bit key (as an int64), from its seed and name: a BLAKE2b digest, the same
    in every process (Python's ``hash()`` of a str is salted per process)."""
    digest = hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def initial_rows(key: int, ids: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32,
                 padding_idx: int | None = None) -> torch.Tensor:
    """The first values of rows ``ids`` of the table with :func:`row_key` ``key``: ``N(0, 1)``
    (as ``nn.Embedding`` initialises its weight), row ``padding_idx`` zeros.

    Each row has its own 64-bit key, ``mix64(id * GAMMA ^ key)``; its element ``j`` takes the
    uniform bits of output ``j`` of the splitmix64 stream seeded by that key, and Box-Muller
    turns elements ``2k, 2k + 1`` into two normals. All in whole-tensor int64 / float64 ops,
    so a row depends only on (key, id): not on the block, server, batch or process.

    Example::

        >>> rows = initial_rows(row_key(0, "items"), torch.tensor([5, 70_000]), 16)
        >>> torch.equal(rows[1], initial_rows(row_key(0, "items"), torch.tensor([70_000]), 16)[0])
        True
    """
    ids = ids.reshape(-1).long()
    width = dim + dim % 2  # normals come in pairs
    out = torch.empty(ids.numel(), dim, dtype=dtype)
    columns = torch.arange(1, width + 1, dtype=torch.long) * _GAMMA  # the stream's offsets
    per_chunk = max(1, _CHUNK // width)
    for start in range(0, ids.numel(), per_chunk):
        part = ids[start:start + per_chunk]
        row = mix64(part * _GAMMA ^ key)
        bits = mix64(row.unsqueeze(1) + columns)
        # 53 uniform bits -> (0, 1), never 0 (its log is taken)
        u = (_shr(bits, 11).to(torch.float64) + 0.5) * 2.0 ** -53
        radius = (-2.0 * u[:, 0::2].log()).sqrt()
        angle = (2 * math.pi) * u[:, 1::2]
        pairs = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=2)
        out[start:start + per_chunk] = pairs.reshape(part.numel(), width)[:, :dim]
    if padding_idx is not None:
        out[ids == padding_idx] = 0
    return out
