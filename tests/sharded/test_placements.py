"""Property tests (hypothesis) of remote_module/sharded/_placements.py: pure arithmetic on lists of
per-rank tensors, no RPC at all (issue 10: split/concat round trips for uneven sizes, every reduce
op, every redistribute pair).

Exactness: everything is bit-exact (``torch.equal``), a ``Partial(avg)`` made from one value
(``local_parts``, or a redistribute into ``Partial(avg)``) included: an average of equal values
is that value. ``reduce`` of differing values is compared with torch's own (differently
ordered) ``sum`` / ``mean`` within ``2 * n * eps * sum(|x|)`` elementwise. ``torch.equal``
treats -0.0 and 0.0 as equal (``Partial(sum)`` adds +0.0 zeros, which turns a -0.0 into 0.0).

Hypothesis runs derandomized without a database (no profile is registered elsewhere in the
project), so CI sees the same examples every run.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from remote_module.sharded import _placements as pl

DETERMINISTIC = settings(
    max_examples=40,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
FEW = settings(DETERMINISTIC, max_examples=12)

DTYPES = (torch.float32, torch.float64, torch.int64)
FLOATS = (torch.float32, torch.float64)

sizes = st.integers(0, 7)
shapes = st.lists(sizes, min_size=1, max_size=4).map(tuple)
meshes = st.integers(1, 5)
seeds = st.integers(0, 2**31 - 1)


def make(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A reproducible tensor; floats in about [-100, 100] with some 0.0 and -0.0 mixed in."""
    gen = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        return torch.randint(-50, 50, shape, generator=gen, dtype=dtype)
    t = torch.randn(shape, generator=gen, dtype=dtype) * 50
    pick = torch.rand(shape, generator=gen)
    t[pick < 0.05] = 0.0
    t[pick > 0.95] = -0.0
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers, so that equality is bit for bit (-0.0 differs from 0.0)."""
    return {torch.float32: lambda: t.view(torch.int32), torch.float64: lambda: t.view(torch.int64)}.get(
        t.dtype, lambda: t
    )()


@st.composite
def tensors(draw, dtypes=DTYPES, min_ndim: int = 1):
    shape = draw(st.lists(sizes, min_size=min_ndim, max_size=4).map(tuple))
    return make(shape, draw(st.sampled_from(dtypes)), draw(seeds))


# ---- split / assemble ----------------------------------------------------------------------


@DETERMINISTIC
@given(t=tensors(), n=meshes, pick=st.integers(0, 7))
@example(t=torch.arange(3.0), n=5, pick=1)  # more ranks than rows: empty shards
@example(t=torch.arange(14).reshape(7, 2), n=1, pick=0)
def test_split_assemble_round_trip(t, n, pick):
    dim = pick % (2 * t.dim()) - t.dim()  # -ndim .. ndim - 1
    placement = Shard(dim)
    parts = pl.split(t, placement, n)
    assert len(parts) == n
    want = torch.tensor_split(t, n, dim=dim)
    assert [p.shape for p in parts] == [w.shape for w in want]
    size = t.shape[dim]
    assert [p.shape[dim] for p in parts] == [size // n + (k < size % n) for k in range(n)]
    assert pl.global_shape(placement, [p.shape for p in parts]) == t.shape
    assert [p.shape for p in pl.local_parts(t, placement, n)] == [w.shape for w in want]
    for whole in (pl.assemble(placement, parts), pl.assemble(pl.normalized(placement, t.dim()), parts)):
        assert whole.dtype == t.dtype and torch.equal(bits(whole), bits(t))


@DETERMINISTIC
@given(t=tensors(), n=meshes)
def test_replicate_local_parts_round_trip(t, n):
    parts = pl.local_parts(t, Replicate(), n)
    assert len(parts) == n and all(torch.equal(bits(p), bits(t)) for p in parts)
    assert pl.global_shape(Replicate(), [p.shape for p in parts]) == t.shape
    assert torch.equal(bits(pl.assemble(Replicate(), parts)), bits(t))


@pytest.mark.parametrize("op", pl.REDUCE_OPS)
@DETERMINISTIC
@given(data=st.data(), n=meshes)
def test_partial_local_parts_round_trip(op, data, n):
    t = data.draw(tensors(FLOATS if op == "avg" else DTYPES))
    parts = pl.local_parts(t, Partial(op), n)
    assert len(parts) == n
    assert all(p.shape == t.shape and p.dtype == t.dtype for p in parts)
    if op == "sum":  # the documented scheme: rank 0 keeps the value, the others hold zeros
        assert torch.equal(parts[0], t) and all(not p.any() for p in parts[1:])
    else:
        assert all(torch.equal(bits(p), bits(t)) for p in parts)
    back = pl.assemble(Partial(op), parts)
    assert back.dtype == t.dtype
    assert torch.equal(back, t)


@pytest.mark.parametrize(
    "op, dtype, allowed",
    [
        ("sum", torch.int64, True),
        ("sum", torch.complex64, True),
        ("avg", torch.float32, True),
        ("avg", torch.complex128, True),
        ("avg", torch.int64, False),
        ("avg", torch.int32, False),
        ("avg", torch.bool, False),
        ("max", torch.int64, True),
        ("min", torch.float64, True),
        ("max", torch.complex64, False),
        ("min", torch.complex128, False),
    ],
)
def test_check_op_dtype(op, dtype, allowed):
    if allowed:
        pl.check_op_dtype(Partial(op), dtype, "out")
        return
    with pytest.raises(ValueError) as err:
        pl.check_op_dtype(Partial(op), dtype, "out")
    assert f"Partial({op})" in str(err.value) and str(dtype) in str(err.value) and "out" in str(err.value)


def test_check_op_dtype_ignores_shard_and_replicate():
    for placement in (Shard(0), Replicate()):
        for dtype in (torch.int64, torch.complex64, torch.bool):
            pl.check_op_dtype(placement, dtype)


# ---- reduce --------------------------------------------------------------------------------


@pytest.mark.parametrize("op", pl.REDUCE_OPS)
@DETERMINISTIC
@given(shape=shapes, n=meshes, seed=seeds, data=st.data())
def test_reduce_matches_reference_in_fixed_order(op, shape, n, seed, data):
    dtype = data.draw(st.sampled_from(FLOATS if op == "avg" else DTYPES))
    ts = [make(shape, dtype, seed + r) for r in range(n)]
    got = pl.reduce(op, ts)
    assert got.shape == torch.Size(shape) and got.dtype == dtype
    stacked = torch.stack(ts)
    ref = {"sum": stacked.sum, "avg": stacked.mean, "max": stacked.amax, "min": stacked.amin}[op](0)
    if op in ("sum", "avg") and dtype.is_floating_point:
        bound = 2 * n * torch.finfo(dtype).eps * stacked.abs().sum(0)
        assert bool(((got - ref).abs() <= bound).all()), f"{op}: max diff {(got - ref).abs().max()}"
    else:
        assert torch.equal(got, ref)
    # left to right in rank order, bit for bit, and the same on every call
    acc = ts[0]
    for t in ts[1:]:
        acc = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[op](acc, t)
    if op == "avg":
        acc = acc / n
    assert torch.equal(bits(got), bits(acc))
    assert torch.equal(bits(pl.reduce(op, ts)), bits(got))


def test_reduce_unknown_op_names_it():
    with pytest.raises(ValueError, match="'prod'.*sum, avg, max, min"):
        pl.reduce("prod", [torch.ones(2)])
    with pytest.raises(ValueError, match="'prod'"):
        pl.partition(torch.ones(2), "prod", 2, 0)


# ---- redistribute: every pair --------------------------------------------------------------

SRC_KINDS = ("shard", "replicate") + tuple(f"partial-{op}" for op in pl.REDUCE_OPS)
PAIRS = [
    (src, dst)
    for src in SRC_KINDS
    for dst in (("shard-same", "shard-other") if src == "shard" else ("shard",))
    + ("replicate",)
    + tuple(f"partial-{op}" for op in pl.REDUCE_OPS)
]


def placement_of(kind: str, dim: int):
    if kind.startswith("shard"):
        return Shard(dim)
    if kind == "replicate":
        return Replicate()
    return Partial(kind.split("-", 1)[1])


@st.composite
def redistribute_cases(draw, src_kind: str, dst_kind: str):
    """(src, dst, locals): src/dst as given (Shard dims possibly negative), locals any valid
    holding under src: Shard shards of arbitrary uneven sizes, Partial any same-shape tensors."""
    ndim = draw(st.integers(2 if dst_kind == "shard-other" else 1, 4))
    shape = list(draw(st.lists(sizes, min_size=ndim, max_size=ndim)))
    n = draw(meshes)
    avg = "avg" in (src_kind + dst_kind)
    dtype = draw(st.sampled_from(FLOATS if avg else DTYPES))
    seed = draw(seeds)
    i = draw(st.integers(-ndim, ndim - 1))
    if dst_kind == "shard-same":  # the same dim, maybe spelled the other way (-1 vs ndim - 1)
        j = draw(st.sampled_from([i % ndim, i % ndim - ndim]))
    elif dst_kind == "shard-other":
        j = draw(st.sampled_from([d for d in range(-ndim, ndim) if d % ndim != i % ndim]))
    else:
        j = draw(st.integers(-ndim, ndim - 1))
    src, dst = placement_of(src_kind, i), placement_of(dst_kind, j)
    if src_kind == "shard":
        rows = draw(st.lists(sizes, min_size=n, max_size=n))
        locals_ = [make(shape[: i % ndim] + [k] + shape[i % ndim + 1 :], dtype, seed + r) for r, k in enumerate(rows)]
    elif src_kind == "replicate":
        one = make(shape, dtype, seed)
        locals_ = [one.clone() for _ in range(n)]
    else:
        locals_ = [make(shape, dtype, seed + r) for r in range(n)]
    return src, dst, locals_


def pair_test(src_kind: str, dst_kind: str):
    @FEW
    @given(case=redistribute_cases(src_kind, dst_kind))
    def check(case):
        check_redistribute(*case)

    return check


@pytest.mark.parametrize("src_kind, dst_kind", PAIRS, ids=[f"{s}->{d}" for s, d in PAIRS])
def test_redistribute_every_pair(src_kind, dst_kind):
    pair_test(src_kind, dst_kind)()


def check_redistribute(src, dst, locals_):
    n, ndim = len(locals_), locals_[0].dim()
    src, dst = pl.normalized(src, ndim), pl.normalized(dst, ndim)  # as RemoteTensor.redistribute does
    gshape = pl.global_shape(src, [t.shape for t in locals_])
    whole = pl.assemble(src, locals_)
    assert whole.shape == gshape
    identity = src == dst

    assert pl.needs_peers(src, dst) is (not (identity or isinstance(src, Replicate)))

    out = pl.redistribute_locals(src, dst, locals_)
    assert len(out) == n and all(t.dtype == whole.dtype for t in out)

    # the global tensor is unchanged
    back = pl.assemble(dst, out)
    assert torch.equal(back, whole)

    # every rank holds what dst implies
    if identity:
        assert [t.shape for t in out] == [t.shape for t in locals_]
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(out, locals_))
    elif isinstance(dst, Shard):
        want = torch.tensor_split(whole, n, dim=dst.dim)
        assert [t.shape for t in out] == [w.shape for w in want]
        assert all(torch.equal(a, w) for a, w in zip(out, want))
    else:
        assert all(t.shape == gshape for t in out)
        if isinstance(dst, Replicate) or dst.reduce_op in ("max", "min", "avg"):
            assert all(torch.equal(t, whole) for t in out)
        else:  # Partial(sum): rank 0 keeps the value, the others hold zeros
            assert torch.equal(out[0], whole) and all(not t.any() for t in out[1:])

    if not pl.needs_peers(src, dst):
        assert all(torch.equal(pl.combine(src, dst, r, n, [], locals_[r]), out[r]) for r in range(n))
        return
    # what rank p sends rank r: for a Shard target only r's slice on the target dim, and combine
    # uses all of it (the pieces to r add up to r's new tensor); otherwise p's whole tensor
    for r in range(n):
        pieces = [pl.piece_for(src, dst, r, n, t) for t in locals_]
        if isinstance(dst, Shard):
            for p, (piece, t) in enumerate(zip(pieces, locals_)):
                assert torch.equal(piece, torch.tensor_split(t, n, dim=dst.dim)[r])
                assert piece.shape[dst.dim] == out[r].shape[dst.dim]
            used = sum(pc.numel() for pc in pieces) if isinstance(src, Shard) else pieces[0].numel()
            assert used == out[r].numel()
        else:
            assert all(pc.numel() == t.numel() and torch.equal(pc, t) for pc, t in zip(pieces, locals_))
        assert torch.equal(pl.combine(src, dst, r, n, pieces, locals_[r]), out[r])
    if isinstance(dst, Shard):  # over all targets, each rank sends each of its elements once
        for p, t in enumerate(locals_):
            assert sum(pl.piece_for(src, dst, r, n, t).numel() for r in range(n)) == t.numel()


def test_pairs_cover_every_kind():
    assert len(PAIRS) == 37
    assert {d for _, d in PAIRS} == {"shard", "shard-same", "shard-other", "replicate"} | {
        f"partial-{op}" for op in pl.REDUCE_OPS
    }


# ---- validation errors ---------------------------------------------------------------------

GOOD = [Shard(0), Shard(-2), Replicate()] + [Partial(op) for op in pl.REDUCE_OPS]


@pytest.mark.parametrize("placement", GOOD, ids=pl.describe)
def test_check_placement_accepts_one_or_a_sequence_of_one(placement):
    for spelled in (placement, [placement], (placement,)):
        assert pl.check_placement(spelled) == placement


@pytest.mark.parametrize(
    "bad, error, names",
    [
        ([], ValueError, ["sequence of 0", "[]"]),
        ([Shard(0), Replicate()], ValueError, ["sequence of 2", "Shard(dim=0)"]),
        (Partial("prod"), ValueError, ["Partial('prod')", "sum, avg, max, min"]),
        ([Partial("prod")], ValueError, ["Partial('prod')"]),
        (0, TypeError, ["int", "0"]),
        ("Shard(0)", TypeError, ["str", "'Shard(0)'"]),
        (None, TypeError, ["NoneType", "None"]),
        ([None], TypeError, ["NoneType"]),
        (Shard, TypeError, ["type", "Shard"]),
    ],
)
def test_check_placement_refuses_naming_the_value(bad, error, names):
    with pytest.raises(error) as err:
        pl.check_placement(bad, "out_placements[3]")
    msg = str(err.value)
    assert msg.startswith("out_placements[3]")
    assert all(name in msg for name in names), msg


@DETERMINISTIC
@given(ndim=st.integers(0, 4), dim=st.integers(-8, 8))
def test_shard_dim_and_normalized(ndim, dim):
    if -ndim <= dim < ndim:
        assert pl.shard_dim(Shard(dim), ndim) == dim % ndim
        assert pl.normalized(Shard(dim), ndim) == Shard(dim % ndim)
        return
    for call in (lambda: pl.shard_dim(Shard(dim), ndim, "x"), lambda: pl.normalized(Shard(dim), ndim, "x")):
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        assert msg.startswith("x") and f"Shard({dim})" in msg
        assert (f"valid dims: {-ndim}..{ndim - 1}" if ndim else "0-d tensor") in msg, msg


@pytest.mark.parametrize("placement", [Replicate()] + [Partial(op) for op in pl.REDUCE_OPS], ids=pl.describe)
def test_normalized_leaves_non_shard_alone(placement):
    for ndim in range(4):
        assert pl.normalized(placement, ndim) is placement


@DETERMINISTIC
@given(shape=shapes, n=meshes, data=st.data())
def test_global_shape_names_the_first_bad_rank(shape, n, data):
    ndim = len(shape)
    dim = data.draw(st.integers(-ndim, ndim - 1))
    rows = data.draw(st.lists(sizes, min_size=n, max_size=n))
    good = [shape[: dim % ndim] + (k,) + shape[dim % ndim + 1 :] for k in rows]
    assert pl.global_shape(Shard(dim), good) == shape[: dim % ndim] + (sum(rows),) + shape[dim % ndim + 1 :]
    for p in (Replicate(), Partial("max")):
        assert pl.global_shape(p, [shape] * n) == torch.Size(shape)
    if n == 1:
        return
    bad_ranks = data.draw(st.sets(st.integers(1, n - 1), min_size=1))
    first = min(bad_ranks)
    # Shard: another dim differs (or the rank count of dims does)
    other = [d for d in range(ndim) if d != dim % ndim]
    shard_shapes = list(good)
    for r in bad_ranks:
        s = list(good[r])
        if other and data.draw(st.booleans()):
            s[data.draw(st.sampled_from(other))] += 1
        else:
            s.append(1)
        shard_shapes[r] = tuple(s)
    with pytest.raises(ValueError) as err:
        pl.global_shape(Shard(dim), shard_shapes, "input 2")
    msg = str(err.value)
    assert msg.startswith("input 2") and f"rank {first} holds {shard_shapes[first]}" in msg, msg
    # Replicate / Partial: any difference at all
    same = [shape] * n
    for r in bad_ranks:
        same[r] = shape[:-1] + (shape[-1] + 1,)
    for p in (Replicate(), Partial("sum")):
        with pytest.raises(ValueError) as err:
            pl.global_shape(p, same, "input 2")
        assert f"rank {first} holds {same[first]}" in str(err.value) and pl.describe(p) in str(err.value)


def test_global_shape_refusals_without_ranks_or_dims():
    with pytest.raises(ValueError, match="x: a mesh needs at least one rank"):
        pl.global_shape(Replicate(), [], "x")
    with pytest.raises(ValueError, match=r"x: a 0-d tensor cannot be sharded \(Shard\(0\)\)"):
        pl.global_shape(Shard(0), [torch.Size([])], "x")


# ---- Partial(avg) of one value is exact (issue 20) --------------------------------------------

AVG_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)


def special(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values of every magnitude (so that ``(x + x + x) / 3`` rounds for many of them),
    with the largest finite value (whose sum overflows), the smallest subnormal, +-0.0, +-inf
    and NaN mixed in."""
    real = dtype.to_real() if dtype.is_complex else dtype
    info = torch.finfo(real)
    gen = torch.Generator().manual_seed(seed)
    mantissa = torch.rand(4096, generator=gen, dtype=torch.float64) + 1.0
    exponent = torch.randint(-20, 20, (4096,), generator=gen).double()
    sign = torch.randint(0, 2, (4096,), generator=gen).double() * 2 - 1
    values = (sign * mantissa * 2.0**exponent).to(real)
    extra = torch.tensor([info.max, -info.max, info.smallest_normal, info.tiny / 4, 0.0, -0.0, float("inf"),
                          -float("inf"), float("nan")], dtype=torch.float64).to(real)
    values = torch.cat([values, extra])
    if dtype.is_complex:
        values = torch.complex(values, values.flip(0))
    return values


@pytest.mark.parametrize("dtype", AVG_DTYPES, ids=str)
@pytest.mark.parametrize("n", [2, 3, 5, 6, 7])
def test_a_value_distributed_as_partial_avg_comes_back_bit_for_bit(dtype, n):
    for seed in range(5):
        t = special(dtype, seed)
        sum_then_divide = functools.reduce(torch.add, [t] * n) / n
        back = pl.assemble(Partial("avg"), pl.local_parts(t, Partial("avg"), n))
        assert back.dtype == dtype
        assert torch.equal(wide_bits(back), wide_bits(t)), f"{dtype}, n={n}, seed {seed}"
        if n == 3 and seed == 0:  # the plain formula would not have been exact
            assert not torch.equal(wide_bits(sum_then_divide), wide_bits(t))
        redistributed = pl.redistribute_locals(Replicate(), Partial("avg"), [t] * n)
        for dst in (Replicate(), Shard(0)):
            assert torch.equal(wide_bits(pl.assemble(dst, pl.redistribute_locals(Partial("avg"), dst, redistributed))),
                               wide_bits(t))


def wide_bits(t: torch.Tensor) -> torch.Tensor:
    """Bits of any float or complex dtype (NaN equals itself, -0.0 differs from 0.0)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_the_gradient_of_an_average_is_a_share_to_each_rank_equal_values_or_not():
    same = [torch.full((4,), 1.7, requires_grad=True) for _ in range(3)]
    differ = [torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True) * (r + 1) for r in range(3)]
    for tensors in (same, differ):
        leaves = [t if t.is_leaf else t.detach().requires_grad_() for t in tensors]
        out = pl.reduce("avg", leaves)
        out.backward(torch.tensor([3.0, 6.0, 9.0, 1.0]))
        for leaf in leaves:
            assert torch.equal(leaf.grad, torch.tensor([3.0, 6.0, 9.0, 1.0]) / 3)


def test_an_average_works_wherever_sum_over_n_does():
    """The exact average must not lose what ``sum / n`` (what it replaced) did: sparse
    tensors, forward-mode AD and torch.func transforms."""
    x, y = torch.randn(5), torch.randn(5)
    sparse = pl.reduce("avg", [x.to_sparse(), y.to_sparse()])
    assert sparse.is_sparse and torch.equal(sparse.to_dense(), (x + y) / 2)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        a = fwAD.make_dual(x, torch.ones(5))
        b = fwAD.make_dual(y, torch.full((5,), 3.0))
        assert torch.equal(fwAD.unpack_dual(pl.reduce("avg", [a, b])).tangent, torch.full((5,), 2.0))
        assert torch.equal(fwAD.unpack_dual(pl.reduce("avg", [a, x])).tangent, torch.full((5,), 0.5))
    batch = torch.randn(4, 5)
    mapped = torch.func.vmap(lambda t: pl.reduce("avg", [t, t, t]))(batch)
    assert torch.equal(mapped, batch)  # exact, per example too
    mapped = torch.func.vmap(lambda t: pl.reduce("avg", [t, y]))(batch)
    assert torch.equal(mapped, (batch + y) / 2)
    jac = torch.func.jacrev(lambda t: pl.reduce("avg", [t, 2 * t]))(x)
    assert torch.allclose(jac, torch.eye(5) * 1.5)
