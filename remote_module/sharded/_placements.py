"""Placement arithmetic on lists of per-rank tensors: pure functions, no RPC.

A sharded remote tensor is a list of local tensors, one per mesh rank, and one of torch's
placements (``torch.distributed.tensor``): ``Shard(dim)`` (the global tensor is the local
ones concatenated on ``dim`` in rank order; sizes may be uneven, as ``torch.tensor_split``
makes them), ``Replicate()`` (every rank holds the whole tensor) or ``Partial(op)`` (the
global tensor is the ``op``-reduction of the local ones, ``op`` in sum / avg / max / min).

Everything the RPC layer does with shards is one of these functions, run on the worker that
holds the data: :func:`split` / :func:`partition` (a caller tensor onto the mesh),
:func:`assemble` (the global tensor from the local ones), and for
``redistribute`` the pair :func:`piece_for` (what rank ``p`` sends to rank ``r``) and
:func:`combine` (what rank ``r`` makes of the pieces). Tests check them without any RPC.

Replicate -> Partial keeps the value exact: for ``sum`` rank 0 keeps the tensor and the other
ranks hold zeros (-0.0 for floats, so even a -0.0 comes back as it was; torch's DTensor divides
by the mesh size instead, which rounds); for ``avg``, ``max`` and ``min`` every rank keeps the
tensor. An average is a sum divided by the mesh size, which rounds (``(x + x + x) / 3`` is not
always ``x``), except where every rank holds the same value bit for bit: there it is that value
(:func:`reduce`), so a value distributed as ``Partial(avg)`` comes back exactly.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

#: The reduce ops a ``Partial`` placement may carry here.
REDUCE_OPS = ("sum", "avg", "max", "min")

Placement = Any  # Shard | Replicate | Partial


def check_placement(placement: Any, what: str = "placement") -> Placement:
    """``placement`` as one torch placement: a ``Shard``, ``Replicate`` or ``Partial``, or a
    sequence holding exactly one of them (torch's ``placements`` for a 1-D mesh)."""
    if isinstance(placement, (list, tuple)):
        if len(placement) != 1:
            raise ValueError(
                f"{what}: a 1-D mesh takes one placement, got a sequence of {len(placement)}: {placement!r}; "
                "pass e.g. Shard(0) or [Shard(0)]"
            )
        placement = placement[0]
    if isinstance(placement, Partial):
        if placement.reduce_op not in REDUCE_OPS:
            raise ValueError(
                f"{what}: Partial({placement.reduce_op!r}) is not supported; reduce ops: {', '.join(REDUCE_OPS)}"
            )
        return placement
    if isinstance(placement, (Shard, Replicate)):
        return placement
    raise TypeError(
        f"{what} must be torch.distributed.tensor.Shard(dim), Replicate() or Partial(op), "
        f"got {type(placement).__name__}: {placement!r}"
    )


def shard_dim(placement: Shard, ndim: int, what: str = "Shard") -> int:
    """The non-negative dim of ``placement`` for a tensor of ``ndim`` dimensions."""
    dim = placement.dim
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{what}: Shard({dim}) is out of range for a tensor with {ndim} dimension(s) "
            f"(valid dims: {-ndim}..{ndim - 1})" if ndim else f"{what}: a 0-d tensor cannot be sharded (Shard({dim}))"
        )
    return dim % ndim


def shard_dim_or_none(placement: Placement) -> int | None:
    """``placement.dim`` for a ``Shard``, else None: by class, without ``isinstance``, which
    goes through torch's opaque-type metaclass (for placements already checked)."""
    return placement.dim if issubclass(type(placement), Shard) else None


def normalized(placement: Placement, ndim: int, what: str = "placement") -> Placement:
    """``placement`` with a ``Shard`` dim made non-negative for an ``ndim``-d tensor."""
    if isinstance(placement, Shard):
        return Shard(shard_dim(placement, ndim, what))
    return placement


def describe(placement: Placement) -> str:
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Partial):
        return f"Partial({placement.reduce_op})"
    return "Replicate()"


def check_op_dtype(placement: Placement, dtype: torch.dtype, what: str = "placement") -> None:
    """``Partial(avg)`` needs a floating or complex dtype (an average of integers is not one)."""
    if isinstance(placement, Partial) and placement.reduce_op == "avg" and not (
        dtype.is_floating_point or dtype.is_complex
    ):
        raise ValueError(f"{what}: Partial(avg) needs a floating-point tensor, got dtype {dtype}")
    if isinstance(placement, Partial) and placement.reduce_op in ("max", "min") and dtype.is_complex:
        raise ValueError(f"{what}: Partial({placement.reduce_op}) is not defined for complex dtype {dtype}")


# ---- local -> global ---------------------------------------------------------------------


def global_shape(placement: Placement, shapes: Sequence[torch.Size], what: str = "tensor") -> torch.Size:
    """The global shape of a tensor whose ranks hold tensors of ``shapes`` under ``placement``;
    ``ValueError`` naming the first rank whose shape does not fit."""
    if not shapes:
        raise ValueError(f"{what}: a mesh needs at least one rank")
    first = torch.Size(shapes[0])
    if isinstance(placement, Shard):
        dim = shard_dim(placement, len(first), what)
        total = 0
        for rank, shape in enumerate(shapes):
            shape = torch.Size(shape)
            if len(shape) != len(first) or any(a != b for i, (a, b) in enumerate(zip(shape, first)) if i != dim):
                raise ValueError(
                    f"{what} is Shard({dim}): every rank's shard must match rank 0's shape {tuple(first)} "
                    f"except on dim {dim}, but rank {rank} holds {tuple(shape)}"
                )
            total += shape[dim]
        return torch.Size(first[:dim] + (total,) + first[dim + 1 :])
    for rank, shape in enumerate(shapes):
        if torch.Size(shape) != first:
            raise ValueError(
                f"{what} is {describe(placement)}: every rank must hold the same shape, but rank 0 holds "
                f"{tuple(first)} and rank {rank} holds {tuple(shape)}"
            )
    return first


_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bit_pattern(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width (a complex element as the last dim's
    two), so that equality is bit for bit: -0.0 differs from 0.0, a NaN equals itself."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_SAME_WIDTH_INT[t.element_size()])


def _same_everywhere(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Where (elementwise) every tensor holds rank 0's value bit for bit."""
    first = _bit_pattern(tensors[0])
    same = torch.ones_like(first, dtype=torch.bool)
    for t in tensors[1:]:
        same = same & (_bit_pattern(t) == first)  # not in place: under vmap the right side is batched
    if tensors[0].is_complex():
        same = same.all(dim=-1)
    return same


class _Average(torch.autograd.Function):
    """The average of ``tensors``: the sum (left to right) divided by their number, except where
    all hold the same value bit for bit: that value, exactly. The gradient is the average's,
    ``grad / n`` to each (as autograd gives for ``sum / n``), wherever the values were equal;
    so is its forward-mode derivative, and ``torch.func.vmap`` maps it as it maps ``sum / n``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*tensors: torch.Tensor) -> torch.Tensor:
        mean = functools.reduce(torch.add, tensors) / len(tensors)
        return torch.where(_same_everywhere(tensors), tensors[0], mean)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.count = len(inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        share = grad / ctx.count
        return (share,) * ctx.count

    @staticmethod
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> torch.Tensor:
        given = [t for t in tangents if t is not None]
        return functools.reduce(torch.add, given) / ctx.count


def _average(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``avg`` of :func:`reduce`: exact where all are equal bit for bit (:class:`_Average`), for
    dense tensors of one dtype; others (sparse, mixed dtypes, whose bits do not compare) as
    ``sum / n``."""
    if any(t.layout != torch.strided or t.dtype != tensors[0].dtype for t in tensors):
        return functools.reduce(torch.add, tensors) / len(tensors)
    return _Average.apply(*tensors)


def reduce(op: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors`` reduced by ``op``, left to right in rank order (a fixed order: the same
    floating-point result every time). ``avg`` is the sum divided by ``len(tensors)``, except
    where every tensor holds the same value bit for bit: that value, so averaging copies of a
    value gives it back exactly (``(x + x + x) / 3`` may round); the gradient is ``1/n`` of the
    output's to each, as for ``sum / n``."""
    if op == "sum":
        return functools.reduce(torch.add, tensors)
    if op == "avg":
        return _average(tensors)
    if op == "max":
        return functools.reduce(torch.maximum, tensors)
    if op == "min":
        return functools.reduce(torch.minimum, tensors)
    raise ValueError(f"unknown reduce op {op!r}; reduce ops: {', '.join(REDUCE_OPS)}")


def assemble(placement: Placement, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The global tensor from the ranks' local ones: Shard -> concatenated in rank order,
    Replicate -> rank 0's, Partial -> reduced."""
    if isinstance(placement, Shard):
        return torch.cat(list(tensors), dim=placement.dim)
    if isinstance(placement, Replicate):
        return tensors[0]
    return reduce(placement.reduce_op, tensors)


class _FirstReplica(torch.autograd.Function):
    """The first of equal replicas as the value; the gradient to it, zeros to the others."""

    @staticmethod
    def forward(ctx: Any, *replicas: torch.Tensor) -> torch.Tensor:
        ctx.count = len(replicas)
        return replicas[0].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        zero = torch.zeros_like(grad)
        return (grad,) + (zero,) * (ctx.count - 1)


def first_replica(replicas: Sequence[torch.Tensor]) -> torch.Tensor:
    """``replicas[0]``'s value (bit for bit); in backward the gradient goes to it and a zero
    gradient to every other replica. Distributed autograd waits for a gradient at every send
    of a context: the other replicas, made from pieces sent worker to worker, must get one."""
    return _FirstReplica.apply(*replicas)


# ---- global -> local ---------------------------------------------------------------------


def split(tensor: torch.Tensor, placement: Shard, n: int) -> list[torch.Tensor]:
    """``tensor`` cut into ``n`` shards on the placement's dim, as ``torch.tensor_split`` cuts
    (the first ``size % n`` shards one longer; some empty when ``n`` exceeds the size)."""
    dim = shard_dim(placement, tensor.dim())
    return list(torch.tensor_split(tensor, n, dim=dim))


def partition(tensor: torch.Tensor, op: str, n: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s share of a replicated ``tensor`` under ``Partial(op)``, so that reducing
    the ``n`` shares (:func:`reduce`) gives ``tensor`` back bit for bit: for sum rank 0 keeps it
    and the others hold zeros; for avg, max and min every rank keeps it."""
    if op == "sum" and rank != 0:
        # -0.0 for floats: x + (-0.0) is x bit for bit, a -0.0 included (+0.0 would turn it to +0.0)
        return (torch.full_like(tensor, -0.0) if tensor.is_floating_point() or tensor.is_complex()
                else torch.zeros_like(tensor))
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; reduce ops: {', '.join(REDUCE_OPS)}")
    return tensor


def local_parts(tensor: torch.Tensor, placement: Placement, n: int) -> list[torch.Tensor]:
    """What each of ``n`` ranks holds when a caller's ``tensor`` is distributed by ``placement``."""
    if isinstance(placement, Shard):
        return split(tensor, placement, n)
    if isinstance(placement, Replicate):
        return [tensor] * n
    return [partition(tensor, placement.reduce_op, n, r) for r in range(n)]


# ---- redistribute: local -> local --------------------------------------------------------


def needs_peers(src: Placement, dst: Placement) -> bool:
    """Whether a rank needs other ranks' data to go from ``src`` to ``dst`` (False: from
    Replicate, and identity)."""
    return not (src == dst or isinstance(src, Replicate))


def piece_for(src: Placement, dst: Placement, rank: int, n: int, local: torch.Tensor) -> torch.Tensor:
    """What a rank holding ``local`` (under ``src``) sends to rank ``rank`` for ``dst``: the
    slice of ``local`` that rank needs when the target is a Shard (an all-to-all or a
    reduce-scatter), the whole of ``local`` otherwise (an all-gather or an all-reduce)."""
    src, dst = normalized(src, local.dim()), normalized(dst, local.dim())
    if isinstance(dst, Shard) and isinstance(src, (Shard, Partial)) and src != dst:
        return torch.tensor_split(local, n, dim=dst.dim)[rank]
    return local


def combine(
    src: Placement, dst: Placement, rank: int, n: int, pieces: Sequence[torch.Tensor], own: torch.Tensor
) -> torch.Tensor:
    """Rank ``rank``'s new local tensor under ``dst``, from ``own`` (its local tensor under
    ``src``) and ``pieces`` (:func:`piece_for` from every rank, in rank order; unused when
    :func:`needs_peers` is False)."""
    src, dst = normalized(src, own.dim()), normalized(dst, own.dim())
    if src == dst:
        return own
    if isinstance(src, Replicate):
        if isinstance(dst, Shard):
            return torch.tensor_split(own, n, dim=dst.dim)[rank]
        return partition(own, dst.reduce_op, n, rank)
    if isinstance(dst, Shard):  # Shard(i) -> Shard(j): pieces are this rank's slice of each shard
        return torch.cat(list(pieces), dim=src.dim) if isinstance(src, Shard) else reduce(src.reduce_op, pieces)
    whole = assemble(src, pieces)  # pieces are whole local tensors
    if isinstance(dst, Replicate):
        return whole
    return partition(whole, dst.reduce_op, n, rank)


def redistribute_locals(src: Placement, dst: Placement, locals_: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's tensor after redistributing ``locals_`` from ``src`` to ``dst``, all in one
    process (the reference the RPC version is tested against)."""
    n = len(locals_)
    out = []
    for r in range(n):
        pieces = [piece_for(src, dst, r, n, t) for t in locals_] if needs_peers(src, dst) else []
        out.append(combine(src, dst, r, n, pieces, locals_[r]))
    return out
