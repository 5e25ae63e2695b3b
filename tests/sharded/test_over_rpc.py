"""remote_module.sharded over RPC on the session world: RemoteTensor (distribute, from_local,
full_tensor, local_shards, redistribute worker to worker) and LocalModule (one module per mesh
worker, outputs by placements), each checked against a local reference; then the layer used as
an ordinary user would (gradients through redistribute, grad mode, redistribute's memory, the
caller as a mesh member)."""

import copy
import gc
import threading
import time

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from remote_module.sharded import LocalModule, RemoteTensor, distribute, from_local
from remote_module.sharded import _placements as pl
from tests._deadlines import HANG_S
from tests._faults import gates
from tests._marks import GRAD_ON_WITHOUT_CONTEXT
from tests.sharded import _remote as sr

pytestmark = [pytest.mark.usefixtures("rpc_world"), GRAD_ON_WITHOUT_CONTEXT]

MESH = ["worker1", "worker2"]
OPS = ["sum", "avg", "max", "min"]


def equal_lists(got, want):
    assert len(got) == len(want), (got, want)
    for r, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (r, g, w)
        assert torch.equal(g, w), (r, g, w)


def held():
    return [rpc.rpc_sync(w, sr.held_count) for w in MESH]


def wait_until_held_at_most(baseline, seconds=HANG_S):
    """Poll the hosts until each holds at most ``baseline`` shards (releases are sent from a
    background thread, so they land a little after the RemoteTensor goes); ``seconds`` is a
    hang guard."""
    deadline = time.monotonic() + seconds
    while True:
        now = held()
        if all(n <= b for n, b in zip(now, baseline)):
            return
        assert time.monotonic() < deadline, f"hang guard: shards still held: {now}, baseline {baseline}"
        time.sleep(0.01)


# ---- the seed's example ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def seed_module():
    return LocalModule(MESH, sr.MaskedMean, out_placements=[Partial("sum")])


def test_seed_example(seed_module):
    x = from_local(sr.arange_plus_rank, MESH, Shard(0))
    assert x.shape == (20,) and x.local_shapes == ((10,), (10,))
    out = seed_module(x)
    assert isinstance(out, RemoteTensor) and out.placement == Partial("sum") and out.shape == ()
    assert [t.item() for t in out.local_shards()] == [1.5, 6.0]
    assert out.full_tensor().item() == 7.5


def test_seed_example_with_a_distributed_caller_tensor():
    lm = LocalModule(MESH, sr.MaskedMean, out_placements=[Partial("sum")], in_placements=[Shard(0)])
    whole = torch.cat([torch.arange(0, 10.0), torch.arange(0, 10.0) + 1])
    x = distribute(whole, MESH, Shard(0))
    for arg in (x, whole):  # a RemoteTensor, and the caller tensor itself (split by in_placements)
        out = lm(arg)
        assert [t.item() for t in out.local_shards()] == [1.5, 6.0]
        assert out.full_tensor().item() == 7.5


@pytest.mark.parametrize("placement", [Replicate(), Shard(0), Shard(1)])
def test_caller_tensors_arrive_compact_inside_and_outside_a_dist_autograd_context(placement):
    # what distribute() would store: the rank's part, contiguous, in its own storage, with
    # the caller's grad mode; the same inside a context (where RPC records the send)
    big = torch.arange(40.0, dtype=torch.float64).reshape(5, 8)
    x = big[1:5, 2:6].requires_grad_()  # a non-contiguous view into a larger storage
    received = LocalModule(MESH, sr.Received, in_placements=[placement], out_placements=Shard(0))
    echo = LocalModule(MESH, sr.Echo, in_placements=[placement], out_placements=Shard(0))
    parts = [x] * 2 if isinstance(placement, Replicate) else torch.tensor_split(x, 2, dim=placement.dim)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            inlined = received(x).local_shards()
            values = echo(x).local_shards()
            with dist_autograd.context():
                as_tensors = received(x).local_shards()
                values_as_tensors = echo(x).local_shards()
        for got, tensor_path, part, value, value_t in zip(inlined, as_tensors, parts, values, values_as_tensors):
            nbytes = float(part.numel() * 8)
            assert got.tolist() == [[1.0, float(grad), 0.0, nbytes, nbytes, 1.0]]
            assert torch.equal(got, tensor_path)
            assert torch.equal(value, part.detach()) and torch.equal(value_t, part.detach())


def test_placements_set_after_a_forward_apply_to_the_next():
    # in/out placements are looked up once per input shape and dtype: a reassignment must count
    lm = LocalModule(MESH, sr.Echo, in_placements=[Shard(0)], out_placements=Shard(0))
    x = torch.arange(8.0).view(4, 2)
    with torch.no_grad():
        first = lm(x)
        assert first.placement == Shard(0) and first.local_shapes == ((2, 2), (2, 2))
        lm.in_placements, lm.out_placements = (Replicate(),), (Replicate(),)
        second = lm(x)
    assert second.placement == Replicate() and second.local_shapes == ((4, 2), (4, 2))
    assert torch.equal(second.full_tensor(), x)


def test_a_deep_copy_has_shards_of_its_own_and_none_of_the_lookups():
    lm = LocalModule(MESH, nn.Linear, (2, 2), in_placements=[Replicate()], out_placements=Replicate())
    x = torch.randn(3, 2)
    with torch.no_grad():
        before = lm(x).full_tensor()  # fills this process's lookups (hosts, placements)
        twin = copy.deepcopy(lm)
        assert twin._hosts_cache is None and twin._wanted_cache == {} and twin._out_cache == {}
        assert not twin._warned_untrained
        assert [s.module_key for s in twin.shards] != [s.module_key for s in lm.shards]
        assert torch.equal(twin(x).full_tensor(), before)
        for shard in lm.shards:  # the original's weights change; the copy's do not
            shard.load_state_dict({k: torch.zeros_like(v) for k, v in shard.state_dict().items()})
        assert torch.equal(twin(x).full_tensor(), before)
        assert torch.equal(lm(x).full_tensor(), torch.zeros(3, 2))


# ---- distribute / from_local -------------------------------------------------------------


def expected_locals(t, placement, n):
    if isinstance(placement, Shard):
        return list(torch.tensor_split(t, n, dim=placement.dim))
    if isinstance(placement, Partial) and placement.reduce_op == "sum":
        return [t] + [torch.zeros_like(t)] * (n - 1)
    return [t] * n


CASES = [
    (torch.arange(15.0).reshape(5, 3), Shard(0), MESH),           # 3 + 2 rows
    (torch.arange(15.0).reshape(5, 3), Shard(1), MESH),           # 2 + 1 columns
    (torch.arange(15).reshape(5, 3), [Shard(-1)], MESH),          # a sequence of one, int dtype
    (torch.arange(3.0).reshape(1, 3), Shard(0), MESH),            # more workers than rows
    (torch.arange(6.0).reshape(2, 3), Shard(0), ["worker2"]),     # a mesh of one
    (torch.arange(6.0).reshape(2, 3), Replicate(), MESH),
    (torch.arange(6.0).reshape(2, 3), [Replicate()], ["worker1"]),
] + [(torch.arange(6.0).reshape(2, 3) - 2, Partial(op), MESH) for op in OPS] + [
    (torch.arange(6).reshape(2, 3), Partial("max"), MESH),
]


@pytest.mark.parametrize("t,placement,mesh", CASES, ids=lambda v: repr(v) if not isinstance(v, torch.Tensor) else "")
def test_distribute_matches_a_local_split(t, placement, mesh):
    rt = distribute(t, mesh, placement)
    p = placement[0] if isinstance(placement, list) else placement
    want = expected_locals(t, Shard(p.dim % t.dim()) if isinstance(p, Shard) else p, len(mesh))
    assert rt.mesh == tuple(mesh) and rt.placements == (rt.placement,)
    assert rt.shape == t.shape and rt.dtype == t.dtype and not rt.requires_grad
    assert rt.local_shapes == tuple(w.shape for w in want)
    equal_lists(rt.local_shards(), want)
    full = rt.full_tensor()
    assert full.dtype == t.dtype and torch.equal(full, t)


def test_from_local_runs_a_function_with_args_and_mesh_position():
    rt = from_local(sr.full_rows, MESH, Shard(0), args=(3,), kwargs={"scale": 0.5})
    want = [torch.full((1, 3), 1.0), torch.full((2, 3), 1.5)]  # (rank + size) * scale, rank + 1 rows
    assert rt.shape == (3, 3) and rt.local_shapes == ((1, 3), (2, 3))
    equal_lists(rt.local_shards(), want)
    assert torch.equal(rt.full_tensor(), torch.cat(want))
    one = from_local(sr.position, ["worker2"], Replicate())
    assert one.full_tensor().tolist() == [0, 1]


def test_from_local_adopts_rrefs_owned_by_the_mesh_workers():
    rrefs = [rpc.remote("worker1", torch.ones, ((2, 3),)), rpc.remote("worker2", torch.zeros, ((1, 3),))]
    rt = from_local(rrefs, MESH, Shard(0))
    assert rt.shape == (3, 3)
    assert torch.equal(rt.full_tensor(), torch.cat([torch.ones(2, 3), torch.zeros(1, 3)]))
    with pytest.raises(ValueError, match=r"RRef 0 is owned by 'worker2', but mesh rank 0 is 'worker1'"):
        from_local(rrefs[::-1], MESH, Shard(0))
    with pytest.raises(ValueError, match=r"expected one RRef per mesh worker \(2\), got 1"):
        from_local(rrefs[:1], MESH, Shard(0))


# ---- redistribute -----------------------------------------------------------------------

SHAPE = (5, 3)
PLACEMENTS = [Shard(0), Shard(1), Replicate()] + [Partial(op) for op in OPS]


def kind(p):
    return "shard" if isinstance(p, Shard) else "replicate" if isinstance(p, Replicate) else "partial"


@pytest.fixture(scope="module")
def sources():
    """One RemoteTensor per source placement, and its locals made here the same way."""
    out = {}
    for p in PLACEMENTS:
        dim = p.dim if isinstance(p, Shard) else 0
        rt = from_local(sr.local_of, MESH, p, args=(kind(p), dim, SHAPE))
        out[pl.describe(p)] = (rt, [sr.make_local(kind(p), dim, r, 2, SHAPE) for r in range(2)])
    return out


@pytest.mark.parametrize("src", PLACEMENTS, ids=pl.describe)
def test_redistribute_every_pair_equals_the_local_arithmetic(sources, src):
    rt, locals_ = sources[pl.describe(src)]
    equal_lists(rt.local_shards(), locals_)
    for dst in PLACEMENTS:
        moved = rt.redistribute(dst)
        assert moved.placement == dst and moved.shape == rt.shape and moved.mesh == rt.mesh
        want = pl.redistribute_locals(src, dst, locals_)
        equal_lists(moved.local_shards(), want)
        assert moved.local_shapes == tuple(w.shape for w in want)
        full = moved.full_tensor()
        assert torch.equal(full, pl.assemble(dst, want)), (src, dst)
        torch.testing.assert_close(full, pl.assemble(src, locals_), rtol=1e-6, atol=1e-6)


@pytest.fixture()
def watched_store():
    for w in ["worker0"] + MESH:
        rpc.rpc_sync(w, sr.watch_store, (True,))
    try:
        yield lambda: {w: rpc.rpc_sync(w, sr.store_traffic) for w in ["worker0"] + MESH}
    finally:
        for w in ["worker0"] + MESH:
            rpc.rpc_sync(w, sr.watch_store, (False,))


@pytest.mark.parametrize("src", [Partial("sum"), Shard(0), Shard(1)], ids=pl.describe)
def test_redistribute_moves_data_worker_to_worker(sources, watched_store, src):
    rt, locals_ = sources[pl.describe(src)]
    watched_store()  # forget what came before
    moved = rt.redistribute(Replicate() if src != Shard(1) else Shard(0))
    served = watched_store()
    # each worker served its piece to the other, nobody fetched to the caller, nothing was re-sent
    assert sorted(served["worker1"]) == [("_piece", "worker2")], served
    assert sorted(served["worker2"]) == [("_piece", "worker1")], served
    assert served["worker0"] == [], served
    equal_lists(moved.local_shards(), pl.redistribute_locals(src, moved.placement, locals_))


# ---- LocalModule ------------------------------------------------------------------------


@pytest.mark.parametrize("kind,count", [("tensor", 1), ("tuple", 2), ("nested", 4)])
def test_outputs_keep_the_module_structure(kind, count):
    lm = LocalModule(MESH, sr.Structured, (kind,), out_placements=[Shard(0)] * count if count > 1 else Shard(0))
    x = distribute(torch.arange(5.0), MESH, Shard(0))
    out = lm(x)
    want = sr.Structured(kind)(torch.arange(5.0))

    def same(got, ref):
        if isinstance(ref, torch.Tensor):
            assert isinstance(got, RemoteTensor) and got.placement == Shard(0)
            assert torch.equal(got.full_tensor(), ref)
            equal_lists(got.local_shards(), list(torch.tensor_split(ref, 2)))
        else:
            assert type(got) is type(ref) and len(got) == len(ref), (got, ref)
            for g, r in zip(got, ref):
                same(g, r)

    same(out, want)


@pytest.fixture(scope="module")
def mixed():
    return LocalModule(MESH, sr.Mixed, out_placements=Shard(0), in_placements=[Shard(0), Replicate(), None, None])


def test_several_inputs_placements_none_entries_and_kwargs(mixed):
    x, w = torch.randn(5, 3), torch.randn(3, 2)
    y = distribute(torch.randn(5, 2), MESH, Shard(0))
    z = distribute(torch.randn(5, 2), MESH, Shard(0))
    xs, ys, zs = torch.tensor_split(x, 2), y.local_shards(), z.local_shards()
    # x: a caller tensor split by Shard(0); w: copied by Replicate(); 0.5 as it is; y and z: their shards
    out = mixed(x, w, 0.5, y, offset=2.0, z=z)
    want = [sr.mixed_reference(xs[r], w, 0.5, ys[r], 2.0, zs[r]) for r in range(2)]
    equal_lists(out.local_shards(), want)
    # the same with x already sharded remotely, and then held as Replicate (redistributed first)
    for xr in (distribute(x, MESH, Shard(0)), distribute(x, MESH, Replicate())):
        equal_lists(mixed(xr, w, 0.5, y, offset=2.0, z=z).local_shards(), want)


@pytest.fixture(scope="module")
def echo_shard0():
    return LocalModule(MESH, sr.Echo, out_placements=[Shard(0)], in_placements=[Shard(0)])


@pytest.mark.parametrize("src", [Replicate(), Partial("sum"), Partial("max"), Shard(1)], ids=pl.describe)
def test_an_input_with_another_placement_is_redistributed_first(echo_shard0, sources, src):
    rt, locals_ = sources[pl.describe(src)]
    got = echo_shard0(rt).local_shards()
    equal_lists(got, pl.redistribute_locals(src, Shard(0), locals_))
    equal_lists(got, list(torch.tensor_split(pl.assemble(src, locals_), 2)))


def test_constructor_args_per_rank_from_a_callable():
    lm = LocalModule(MESH, sr.Filled, lambda r: ((10.0 + r,), {"width": 3}), out_placements=[Shard(0)])
    equal_lists(lm(None).local_shards(), [torch.full((1, 3), 10.0), torch.full((1, 3), 11.0)])
    sd = lm.state_dict()
    assert torch.equal(sd["shards.1.value"], torch.full((3,), 11.0))


@pytest.fixture(scope="module")
def positioned():
    return LocalModule(MESH, sr.Positioned, out_placements=[Shard(0)])


def test_mesh_position_inside_forward_and_train_eval_reach_the_hosts(positioned):
    assert positioned(None).full_tensor().tolist() == [[0.0, 2.0, 1.0], [1.0, 2.0, 1.0]]
    assert positioned.eval() is positioned and not positioned.training
    assert all(not s.training for s in positioned.shards)
    assert positioned(None).full_tensor()[:, 2].tolist() == [0.0, 0.0]
    positioned.train()
    assert positioned(None).full_tensor()[:, 2].tolist() == [1.0, 1.0]
    single = LocalModule(["worker2"], sr.Positioned, out_placements=[Replicate()])
    assert single(None).full_tensor().tolist() == [[0.0, 1.0, 1.0]]


def test_shards_run_concurrently():
    # each shard's forward holds on a gate until both hosts are inside theirs: shards run one
    # after the other would never get there (the test fails at the deadline, whatever the speed)
    key = "sharded-concurrently"
    lm = LocalModule(MESH, sr.Stamped, (key,), out_placements=[Shard(0)])
    box = {}
    thread = threading.Thread(target=lambda: box.update(out=lm(None)))
    thread.start()
    try:
        deadline = time.monotonic() + HANG_S
        while not all(rpc.rpc_sync(w, gates.holding, (key,)) for w in MESH):
            assert time.monotonic() < deadline, "hang guard: the two shards' forwards never ran at the same time"
            time.sleep(0.01)
    finally:
        for w in MESH:
            rpc.rpc_sync(w, gates.release, (key,))
        thread.join(HANG_S)
    (first, second) = box["out"].local_shards()  # [[start, end]] recorded on each host
    starts, ends = [first[0, 0], second[0, 0]], [first[0, 1], second[0, 1]]
    assert max(starts) < min(ends), (starts, ends)  # both had started before either ended


@pytest.fixture(scope="module")
def linear():
    torch.manual_seed(0)
    return LocalModule(MESH, nn.Linear, (3, 2), out_placements=[Shard(0)], in_placements=[Replicate()])


def test_repr_names_mesh_placements_and_shards(linear):
    text = repr(linear)
    assert text.startswith("LocalModule(")
    assert "mesh=['worker1', 'worker2']" in text and "out_placements=['Shard(0)']" in text
    assert "in_placements=['Replicate()']" in text
    assert "(0): RemoteModule(on=worker1" in text and "(1): RemoteModule(on=worker2" in text
    assert "Linear(in_features=3, out_features=2" in text


def test_state_dict_round_trip_and_remote_parameters(linear):
    sd = linear.state_dict()
    assert list(sd) == ["shards.0.weight", "shards.0.bias", "shards.1.weight", "shards.1.bias"]
    new = {k: torch.randn_like(v) for k, v in sd.items()}
    saved = {k: v.clone() for k, v in sd.items()}
    try:
        linear.load_state_dict(new)
        for k, v in linear.state_dict().items():
            assert torch.equal(v, new[k]), k
        x = torch.randn(4, 3)
        want = torch.cat(
            [nn.functional.linear(x, new[f"shards.{r}.weight"], new[f"shards.{r}.bias"]) for r in range(2)]
        )
        assert torch.equal(linear(x).full_tensor(), want)
        params = linear.remote_parameters()
        assert [p.owner_name() for p in params] == ["worker1", "worker1", "worker2", "worker2"]
        for p, k in zip(params, new):
            assert torch.equal(p.to_here(), new[k]), k
    finally:
        linear.load_state_dict(saved)


def test_grad_mode_of_the_caller_reaches_the_shards(linear):
    x = torch.randn(4, 3)
    assert linear(x).requires_grad
    with torch.no_grad():
        out = linear(x)
    assert not out.requires_grad and not any(t.requires_grad for t in out.local_shards())


# ---- freeing shards --------------------------------------------------------------------


def test_a_training_loop_does_not_grow_the_hosts_stores(linear):
    x = distribute(torch.randn(4, 3), MESH, Replicate())
    gc.collect()
    baseline = held()
    peak = baseline
    gc.disable()  # outputs must go when dropped, not when the cyclic GC happens to run
    try:
        for _ in range(30):
            out = linear(x)
            out.full_tensor()
            peak = [max(p, n) for p, n in zip(peak, held())]
    finally:
        gc.enable()
    assert all(p <= b + 10 for p, b in zip(peak, baseline)), (peak, baseline)  # 30 outputs were made
    del out, x
    gc.collect()
    wait_until_held_at_most([b - 1 for b in baseline])  # x's shards too


FAILING = {  # a module, its out_placements, what the forward raises
    "raises on rank 1": (sr.FailOnRank, (1,), [Shard(0)], sr.UserError),
    "2 outputs on the last rank only": (sr.Returns, ("two-on-last",), [Shard(0)] * 2, ValueError),
    "tuple on rank 0, list on rank 1": (sr.Returns, ("per-rank",), [Shard(0)] * 2, ValueError),
    "a 1-d output as Shard(1)": (sr.Returns, ("1d",), [Shard(1)], ValueError),
}


def test_a_failed_forward_leaves_nothing_held():
    x = distribute(torch.ones(4), MESH, Shard(0))
    modules = {k: (LocalModule(MESH, cls, a, out_placements=o), e) for k, (cls, a, o, e) in FAILING.items()}
    gc.collect()
    baseline = held()
    for what, (lm, exc) in modules.items():
        with pytest.raises(exc):
            lm(x)
        try:  # what rank 0 (or both) stored is freed without waiting for the cyclic GC
            wait_until_held_at_most(baseline, seconds=5)
        except AssertionError as e:
            raise AssertionError(f"after a forward that failed with {what}: {e}") from None


def test_remote_tensors_nested_in_containers_stand_for_their_local_shards():
    mesh = ["worker1", "worker2"]
    x, y, z = (torch.arange(6.0) * k for k in (1, 10, 100))
    rx, ry, rz = (distribute(t, mesh, Shard(0)) for t in (x, y, z))
    lm = LocalModule(mesh, sr.SumNested, out_placements=Shard(0))
    out = lm({"a": [rx, (ry,)]}, extra=[rz])
    assert torch.equal(out.full_tensor(), x + y + z)
    pair = LocalModule(mesh, sr.SumPair, out_placements=Shard(0))  # a named tuple is walked too
    assert torch.equal(pair(sr.Pair(rx, ry)).full_tensor(), x + y)
    other = distribute(torch.arange(6.0), ["worker2", "worker1"], Shard(0))
    with pytest.raises(ValueError, match="input 0 lives on mesh"):
        lm({"a": [rx, (other,)]}, extra=[rz])
    with pytest.raises(ValueError, match="keyword argument 'extra' lives on mesh"):
        lm({"a": [rx, (ry,)]}, extra=[other])


# ---- Partial(avg) gives a distributed value back exactly (issue 20) --------------------------


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its width: equality bit for bit."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("mesh", [MESH, ["worker0", "worker1", "worker2"]], ids=["2-workers", "3-workers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_distribute_partial_avg_then_full_tensor_is_bit_for_bit_the_value(mesh, dtype):
    gen = torch.Generator().manual_seed(len(mesh))
    for trial in range(5):
        # random values of many magnitudes: (x + x + x) / 3 rounds for a good share of them
        x = (torch.randn(64, 33, generator=gen, dtype=torch.float64) * 10.0 ** (trial - 2)).to(dtype)
        rt = distribute(x, mesh, Partial("avg"))
        via_replicate = distribute(x, mesh, Replicate()).redistribute(Partial("avg"))
        for got in (rt.full_tensor(), rt.redistribute(Replicate()).local_shards()[-1],
                    rt.redistribute(Shard(1)).full_tensor(), via_replicate.full_tensor()):
            assert got.dtype == dtype
            assert torch.equal(bits_of(got), bits_of(x)), (mesh, dtype, trial, (got.double() - x.double()).abs().max())


# ---- used as an ordinary user would: gradients through redistribute, grad mode,
# redistribute's memory, the caller as a mesh member ----------------------------------------

@pytest.mark.parametrize("src,dst", [(Shard(0), Replicate()), (Partial("sum"), Replicate()),
                                     (Replicate(), Shard(0)), (Shard(0), Shard(1))],
                         ids=["S0-R", "Psum-R", "R-S0", "S0-S1"])
def test_gradients_through_redistribute_equal_the_local_ones(src, dst):
    """A caller tensor through a LocalModule, a redistribute and full_tensor(): value and
    gradient equal the local model's. Shard -> Replicate hung in backward until the RPC timeout:
    full_tensor() fetched rank 0's replica only, so the other ranks' sends of their pieces to
    each other never received a gradient, and dist autograd (FAST mode) waits for every send."""
    torch.manual_seed(2)
    w, x = torch.randn(3, 3), torch.randn(4, 3, requires_grad=True)
    outp = src if not isinstance(src, Partial) else Partial("sum")
    inp = Shard(1) if isinstance(src, Partial) else src
    lm = LocalModule(MESH, sr.Affine, (w,), in_placements=[inp], out_placements=outp)
    wl = torch.tensor_split(w, 2, dim=1) if isinstance(src, Partial) else None
    if wl is not None:
        lm = LocalModule(MESH, sr.Affine, lambda r: ((wl[r],), None), in_placements=[inp], out_placements=outp)
    with dist_autograd.context() as ctx:
        out = lm(x).redistribute(dst).full_tensor()
        dist_autograd.backward(ctx, [(out * out).sum()])
        got = dist_autograd.get_gradients(ctx)[x]
    xl = x.detach().clone().requires_grad_()
    ((xl @ w.T) ** 2).sum().backward()
    torch.testing.assert_close(out.detach(), (x @ w.T).detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(got, xl.grad, atol=1e-5, rtol=0)


def test_replicate_output_full_tensor_is_rank0s_value_exactly():
    """full_tensor() of a Replicate tensor that requires grad is rank 0's value bit for bit
    (inf and -0.0 included)."""
    t = torch.tensor([float("inf"), -0.0, 1.5])
    rt = distribute(t.clone().requires_grad_(), MESH, Replicate())
    got = rt.full_tensor()
    assert torch.equal(got, t) and torch.equal(torch.signbit(got), torch.signbit(t))


@pytest.mark.parametrize("dst", [Replicate(), Shard(1)], ids=["R", "S1"])
def test_redistribute_under_no_grad_records_nothing(dst):
    """Under torch.no_grad() on the caller, a redistribute of an output that requires grad gives
    a tensor that does not (as locally); the hosts built a graph, which also kept the source's
    graph alive, and said requires_grad=True."""
    w = torch.randn(3, 3)
    lm = LocalModule(MESH, sr.Affine, (w,), in_placements=[Shard(0)], out_placements=Shard(0))
    out = lm(torch.randn(4, 3))
    assert out.requires_grad
    with torch.no_grad():
        moved = out.redistribute(dst)
    assert not moved.requires_grad
    torch.testing.assert_close(moved.full_tensor(), out.full_tensor())


def test_replicate_to_shard_keeps_only_its_part():
    """Redistributing Replicate -> Shard(0) and dropping the replicated tensor must leave each
    worker holding its rows only, not a view that keeps the whole replicated storage alive."""
    big = distribute(torch.zeros(1000, 100), MESH, Replicate())
    rows = big.redistribute(Shard(0))
    del big
    held = [rpc.rpc_sync(w, sr.storage_bytes, (sid,)) for w, sid in zip(MESH, rows._sids)]
    assert held == [500 * 100 * 4] * 2, f"workers keep {held} bytes for their 500 rows (want 200000 each)"
    assert rows.full_tensor().shape == (1000, 100)


def test_caller_as_mesh_member_holds_copies():
    """worker0 (the caller) in the mesh: its shard is a copy of what it distributed, and what
    full_tensor() returns is the caller's own (in-place changes on either side stay there)."""
    t = torch.zeros(4)
    rt = distribute(t, ["worker0", "worker1"], Replicate())
    t.add_(1)
    got = rt.full_tensor()
    got.add_(5)
    assert [s.tolist() for s in rt.local_shards()] == [[0.0] * 4, [0.0] * 4]
