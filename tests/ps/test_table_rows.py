"""A sharded table's rows as torch's modules hold theirs (issue 20): the padding row, the
initial rows, and sizes given as any integer.

- Padding as ``nn.Embedding`` / ``nn.EmbeddingBag``: created as zeros (eager and lazy), read
  and saved as stored (a checkpoint may set it), left out of bags, never trained in any mode.
- Initial rows: ``N(0, 1)`` from a hash of (seed, table name, row id): the same eager or lazy,
  on any split and in every process; independent across tables and seeds.
- Sizes: anything ``operator.index`` takes (numpy integers), floats and bools refused.

The tests without RPC build server-side tables directly; the others share the session's PS
world (tests/conftest.py ``ps_world``) and compare with plain torch run here.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from torch import nn

from remote_module.ps._rowwise import row_optimizer
from remote_module.ps.tables.server._initial import initial_rows, mix64, row_key
from remote_module.ps.tables.server._pooling import pool_rows
from remote_module.ps.tables.server._rows import RowBlock, SlotIndex, TableSpec, row_init
from remote_module.ps.tables.server._table import Table
from tests.ps import _table_rows_remote as r
from tests.ps._world import job

U64 = (1 << 64) - 1


def spec(rows=20, dim=3, init="eager", seed=7, padding_idx=None, cls=torch.optim.SGD, kwargs=None, dtype=torch.float64):
    return TableSpec(rows, dim, dtype, init, seed, "async", 1, row_optimizer(cls, kwargs or {"lr": 0.5}),
                     padding_idx=padding_idx)


def all_rows(table: Table, rows: int) -> torch.Tensor:
    return table.lookup(torch.arange(rows))


# ---- initial rows: the generator ----------------------------------------------------------------


def reference_mix64(x: int) -> int:
    """splitmix64's finaliser on Python ints (exact 64-bit arithmetic)."""
    x &= U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


def reference_row(seed: int, name: str, row: int, dim: int) -> list[float]:
    """initial_rows' documented recipe, one element at a time in Python ints and floats."""
    key = int.from_bytes(hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=8).digest(), "little")
    gamma = 0x9E3779B97F4A7C15
    row_key_ = reference_mix64((row * gamma & U64) ^ key)
    u = [((reference_mix64(row_key_ + (j + 1) * gamma) >> 11) + 0.5) * 2.0 ** -53 for j in range(dim + dim % 2)]
    out = []
    for k in range(0, len(u), 2):
        radius = math.sqrt(-2.0 * math.log(u[k]))
        out += [radius * math.cos(2 * math.pi * u[k + 1]), radius * math.sin(2 * math.pi * u[k + 1])]
    return out[:dim]


def test_mix64_wraps_and_shifts_as_unsigned_64_bit_arithmetic():
    """torch has no uint64 arithmetic: the int64 version must give splitmix64's bits exactly,
    including values with the sign bit set (where an arithmetic shift would differ)."""
    g = torch.Generator().manual_seed(0)
    values = torch.randint(-(1 << 63), (1 << 63) - 1, (5000,), generator=g, dtype=torch.long).tolist()
    values += [0, 1, -1, -(1 << 63), (1 << 63) - 1]
    got = mix64(torch.tensor(values, dtype=torch.long)).tolist()
    assert [v & U64 for v in got] == [reference_mix64(v) for v in values]


def test_initial_rows_follow_the_documented_recipe_in_every_process():
    """Python ints and floats give the same values in every process (no salted hash, no
    global generator): equal to them, the torch version is deterministic across processes."""
    ids = torch.tensor([0, 1, 99_999_999, 12_345])
    for seed, name, dim in ((0, "items", 5), (3, "users", 4), (2**40, "ünïcode", 1)):
        got = initial_rows(row_key(seed, name), ids, dim, torch.float64)
        want = torch.tensor([reference_row(seed, name, i, dim) for i in ids.tolist()], dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=1e-13, rtol=0)


def test_tables_of_other_names_start_with_independent_rows():
    """Every table left at the default seed used to start with the same rows for the same id."""
    a = all_rows(Table("items", spec(rows=4000, dim=8, init="lazy", seed=0), [(0, 4000)]), 4000)
    b = all_rows(Table("users", spec(rows=4000, dim=8, init="lazy", seed=0), [(0, 4000)]), 4000)
    assert not bool((a == b).all(dim=1).any())  # no row the same
    corr = torch.corrcoef(torch.stack([a.reshape(-1), b.reshape(-1)]))[0, 1]
    assert abs(float(corr)) < 0.03, corr  # 32,000 pairs: independent rows give |corr| ~ 0.006


def test_seeds_0_and_1_are_not_the_same_rows_shifted():
    """Row seeds used to be ``seed * 1_000_003 + id``: seed 1's row i was seed 0's row
    i + 1,000,003."""
    shift = 1_000_003
    zero = Table("t", spec(rows=shift + 2000, dim=8, init="lazy", seed=0), [(0, shift + 2000)])
    one = Table("t", spec(rows=shift + 2000, dim=8, init="lazy", seed=1), [(0, shift + 2000)])
    ids = torch.arange(2000)
    for a, b in ((one.lookup(ids), zero.lookup(ids + shift)), (one.lookup(ids), zero.lookup(ids))):
        assert not bool((a == b).all(dim=1).any())
        corr = torch.corrcoef(torch.stack([a.reshape(-1), b.reshape(-1)]))[0, 1]
        assert abs(float(corr)) < 0.05, corr


def test_eager_and_lazy_tables_on_any_split_start_with_the_same_rows():
    """A row's first value depends on (seed, name, id) only: eager or lazy, one block or
    three, in the order rows are first touched or all at once."""
    ids = torch.tensor([19, 3, 7, 0, 13, 14, 3])
    splits = ([(0, 20)], [(0, 7), (7, 7), (14, 6)], [(0, 1), (1, 18), (19, 1)])
    expected = initial_rows(row_key(7, "t"), torch.arange(20), 3, torch.float64)
    for init in ("eager", "lazy"):
        for blocks in splits:
            t = Table("t", spec(init=init), blocks)
            assert torch.equal(t.lookup(ids), expected[ids]), (init, blocks)
            assert torch.equal(all_rows(t, 20), expected), (init, blocks)
    lazy = Table("t", spec(init="lazy"), splits[1])
    lazy.apply(torch.tensor([13]), torch.zeros(1, 3, dtype=torch.float64))  # stores row 13 alone
    assert torch.equal(all_rows(lazy, 20), expected)


@pytest.mark.parametrize("dim", [16, 7])
def test_initial_rows_are_standard_normal_like_nn_embeddings_init(dim):
    """nn.Embedding initialises N(0, 1): 60,000+ values, checked within loose bounds (several
    standard errors), including the pairs Box-Muller makes together and neighbouring rows."""
    rows = initial_rows(row_key(0, "stats"), torch.arange(4000, 8000 + 60_000 // dim), dim, torch.float64)
    x = rows.reshape(-1)
    assert abs(float(x.mean())) < 0.02
    assert abs(float(x.std()) - 1) < 0.02
    assert abs(float((x.abs() < 1).double().mean()) - 0.6827) < 0.01
    assert abs(float((x.abs() < 2).double().mean()) - 0.9545) < 0.006
    assert abs(float((x ** 4).mean()) - 3) < 0.15  # kurtosis of a normal
    for a, b in ((rows[:, 0], rows[:, 1]), (rows[:-1].reshape(-1), rows[1:].reshape(-1))):
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.03


def test_float32_rows_are_the_float64_rows_rounded():
    key = row_key(5, "t")
    ids = torch.arange(100)
    assert torch.equal(initial_rows(key, ids, 6), initial_rows(key, ids, 6, torch.float64).float())


def test_a_huge_eager_block_is_made_in_chunks_with_the_same_rows():
    """An eager block is generated a chunk at a time (bounded temporaries): the rows equal
    those made one by one."""
    key = row_key(0, "big")
    many = initial_rows(key, torch.arange(70_000), 8)  # 560,000 elements: many chunks
    for i in (0, 32_767, 32_768, 69_999):
        assert torch.equal(many[i], initial_rows(key, torch.tensor([i]), 8)[0])


# ---- padding: the servers' side -----------------------------------------------------------------


@pytest.mark.parametrize("init", ["eager", "lazy"])
def test_the_servers_create_the_padding_row_as_zeros_and_never_step_it(init):
    s = spec(init=init, padding_idx=9, cls=torch.optim.Adagrad, kwargs={"lr": 0.5})
    t = Table("t", s, [(0, 7), (7, 7), (14, 6)])
    fresh = all_rows(t, 20)
    assert torch.equal(fresh[9], torch.zeros(3, dtype=torch.float64))
    expected = initial_rows(row_key(7, "t"), torch.arange(20), 3, torch.float64)
    others = torch.arange(20) != 9
    assert torch.equal(fresh[others], expected[others])
    assert torch.equal(row_init(s, "t", torch.tensor([9, 2]))[0], torch.zeros(3, dtype=torch.float64))
    # a checkpoint's padding row is stored as given
    block = t.blocks[1]
    slot = block.slots(torch.tensor([9]), create=True)
    block.values[slot] = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    t.apply(torch.tensor([9, 10, 9]), torch.ones(3, 3, dtype=torch.float64))  # a gradient for it anyway
    t.add_deltas(torch.tensor([9, 10]), torch.ones(2, 3, dtype=torch.float64))  # and a geo delta
    after = all_rows(t, 20)
    assert after[9].tolist() == [1.0, 2.0, 3.0]
    assert not torch.equal(after[10], fresh[10])  # its neighbour in the block moved
    stepped, _ = block.stored(stepped_only=True)
    assert stepped.tolist() == [10]  # no optimizer state for the padding row


# ---- sizes as torch takes them --------------------------------------------------------------------


@pytest.mark.parametrize("which,args,kwargs", [
    ("num_embeddings", (200.0, 4), {}), ("embedding_dim", (200, 4.0), {}), ("num_embeddings", (True, 4), {}),
    ("padding_idx", (200, 4), {"padding_idx": 2.0}), ("padding_idx", (200, 4), {"padding_idx": True}),
    ("min_block_size", (200, 4), {"min_block_size": 100.0}), ("seed", (200, 4), {"seed": 1.5}),
    ("num_trainers", (200, 4), {"num_trainers": 1.0}), ("geo_push_every", (200, 4), {"geo_push_every": False}),
], ids=lambda v: v if isinstance(v, str) else None)
def test_floats_and_bools_for_integer_arguments_are_a_type_error_naming_the_argument(which, args, kwargs):
    """As nn.EmbeddingBag refuses a float size with a TypeError (refused before any RPC)."""
    from remote_module.ps import ShardedEmbedding, ShardedEmbeddingBag

    if not kwargs and not isinstance(args[0], bool):
        with pytest.raises(TypeError):
            nn.EmbeddingBag(*args)
    for cls in (ShardedEmbedding, ShardedEmbeddingBag):
        with pytest.raises(TypeError, match=rf"{which} must be an int .*got (float|bool)"):
            cls(*args, ["ps0"], name="t", **kwargs)


# ---- through the servers (the PS world) -----------------------------------------------------------


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def on_trainer0(world, fn, *args):
    return world.run({"trainer0": (fn, *args)})["trainer0"]


SGD = (torch.optim.SGD, {"lr": 0.1})
ADAGRAD = (torch.optim.Adagrad, {"lr": 0.2})


@pytest.mark.slow
@pytest.mark.parametrize("kind,init,ps_mode,optimizer", [
    ("emb", "eager", "async", SGD),
    ("emb", "lazy", "sync", ADAGRAD),
    ("emb", "eager", "half_async", ADAGRAD),
    ("emb", "lazy", "geo", ADAGRAD),
    ("sum", "eager", "async", ADAGRAD),
    ("mean", "lazy", "geo", SGD),
    ("max", "eager", "sync", ADAGRAD),
    ("mean", "eager", "half_async", SGD),
], ids=lambda v: v if isinstance(v, str) else v[0].__name__)
def test_the_padding_row_is_created_zero_read_saved_and_loaded_as_stored_and_never_trained(
        world, kind, init, ps_mode, optimizer):
    """A table with padding_idx, loaded with a checkpoint whose padding row is not zero, then
    trained: outputs and rows equal nn.Embedding / nn.EmbeddingBag (the padding row read as
    loaded, left out of bags and means, never moved, no optimizer state for it)."""
    got = on_trainer0(world, r.padded_run, job(f"pad-{kind}-{ps_mode}"), kind, init, ps_mode, optimizer)
    want = r.padded_run(None, kind, init, ps_mode, optimizer)
    assert torch.equal(got["fresh_rows"][r.PAD], torch.zeros(r.DIM))  # created as zeros, as torch does
    assert torch.equal(want["fresh_pad"], torch.zeros(r.DIM))
    if kind == "emb":
        assert torch.equal(got["fresh_pad"], torch.zeros(r.DIM))
    assert int((got["fresh_rows"] == 0).all(dim=1).sum()) == 1  # and only it
    for step, (a, b) in enumerate(zip(got["outs"], want["outs"])):
        if kind == "emb" and step == 0:
            assert torch.equal(a, b)  # a lookup of the loaded rows: bit for bit, padding row included
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=f"output of step {step}")
    torch.testing.assert_close(got["rows"], want["rows"], atol=1e-6, rtol=1e-5)
    assert torch.equal(got["rows"][r.PAD], r.start_weight()[r.PAD])  # saved as loaded, never trained
    assert not torch.allclose(got["rows"], r.start_weight())  # the others trained
    if optimizer is ADAGRAD:
        assert got["stepped"] and r.PAD not in got["stepped"], got["stepped"]
        assert want["stepped"] and r.PAD not in want["stepped"]


@pytest.mark.slow
def test_padding_idx_is_part_of_the_tables_spec_checked_on_attach(world):
    got = on_trainer0(world, r.attach_with_other_padding, job("pad-attach"))
    for other in (4, None):
        kind, message = got[other]
        assert kind == "ValueError", got
        assert f"padding_idx=3, this trainer asks for {other!r}" in message, message


@pytest.mark.slow
@pytest.mark.parametrize("init", ["eager", "lazy"])
def test_rows_read_from_the_servers_equal_the_generator_here(world, init):
    """The servers (other processes, other hash seeds) create the rows this process computes
    for (seed, name, id), over one server or three, with the padding row zero."""
    ids = [0, 5, 99, 100, 150, 299, 7]
    name = job(f"rows-{init}")
    for servers, min_block in ((["ps0"], 10_000), (["ps0", "ps1", "ps2"], 100)):
        got = on_trainer0(world, r.initial_rows_on_servers, f"{name}-{len(servers)}", init, 4, 300, 5, ids, servers,
                          min_block, 150)
        want = initial_rows(row_key(4, f"{name}-{len(servers)}"), torch.tensor(ids), 5, padding_idx=150)
        assert torch.equal(got, want), servers
        assert torch.equal(got[4], torch.zeros(5))


@pytest.mark.slow
def test_numpy_integer_sizes_are_taken_as_torch_takes_them(world):
    pytest.importorskip("numpy")
    got = on_trainer0(world, r.numpy_sized, job("numpy"))
    want = r.numpy_sized(None)
    assert torch.equal(got["outs"]["emb"], want["outs"]["emb"])
    torch.testing.assert_close(got["outs"]["bag"], want["outs"]["bag"], atol=1e-6, rtol=0)
    assert got["attrs"] == {k: ("int", v) for k, (_, v) in want["attrs"].items()}  # kept as ints


@pytest.mark.slow
def test_a_psmodel_keeps_numpy_integer_counts_as_ints(world):
    # PSModel validates its counts with the tables' check, which accepts numpy integers: it must
    # keep them as ints too (not numpy scalars sent to the servers in its job spec)
    pytest.importorskip("numpy")
    got = on_trainer0(world, r.psmodel_numpy_sized, job("numpy-psmodel"))
    assert got == {"num_trainers": "int", "geo_push_every": "int"}


@pytest.mark.parametrize("recent_min", [1, 8, SlotIndex.RECENT_MIN])
def test_a_lazy_blocks_slot_index_finds_what_a_dict_would(monkeypatch, recent_min):
    # whole-tensor lookups (no per-id Python) against the dict they replace, across merges
    monkeypatch.setattr(SlotIndex, "RECENT_MIN", recent_min)
    gen = torch.Generator().manual_seed(3)
    index, want = SlotIndex(), {}
    for _ in range(60):
        batch = torch.randint(0, 5000, (int(torch.randint(1, 200, (1,), generator=gen)),), generator=gen)
        got = index.find(batch)
        assert got.tolist() == [want.get(i, -1) for i in batch.tolist()]
        new = torch.tensor(sorted({i for i in batch.tolist() if i not in want}), dtype=torch.long)
        slots = torch.arange(len(want), len(want) + new.numel())
        index.add(new, slots)
        want.update(zip(new.tolist(), slots.tolist()))
    ids, slots = index.pairs()
    assert ids.tolist() == sorted(want) and slots.tolist() == [want[i] for i in sorted(want)]
    assert len(index) == len(want)
    assert index.find(torch.tensor([-1, 10**12])).tolist() == [-1, -1]


def test_lazy_rows_created_in_any_order_and_with_repeats_read_as_eager_ones():
    spec = TableSpec(1000, 4, torch.float32, "lazy", 0, "async", 1, row_optimizer(torch.optim.SGD, {"lr": 0.5}))
    eager_spec = spec._replace(init="eager")
    key = row_key(0, "t")
    lazy, eager = RowBlock(spec, 100, 900, key), RowBlock(eager_spec, 100, 900, key)
    for ids in ([900, 105, 900, 333], [105, 999, 100], [450, 451, 105]):
        ids = torch.tensor(ids)
        grad = torch.arange(float(ids.numel() * 4)).view(-1, 4)
        unique, inverse = ids.unique(return_inverse=True)
        summed = torch.zeros(unique.numel(), 4).index_add_(0, inverse, grad)
        for rows in (lazy, eager):
            rows.step(unique, summed, 1)
        assert torch.equal(lazy.read(ids), eager.read(ids))
        slots = lazy.slots(ids, create=False)
        assert (slots >= 0).all() and slots[0] == lazy.slots(ids[:1], create=False)[0]
    never = torch.tensor([101, 998])
    assert torch.equal(lazy.read(never), eager.read(never)) and (lazy.slots(never, create=False) == -1).all()
    stored, _ = lazy.stored()
    assert stored.tolist() == [100, 105, 333, 450, 451, 900, 999]
    assert lazy.stored(stepped_only=True)[0].tolist() == stored.tolist()


@pytest.mark.parametrize("weighted", [False, True])
def test_a_one_block_lookup_pooled_from_the_block_equals_pooling_the_rows_read_out(weighted):
    # the server's shortcut for an eager block (no copy of the rows) must give the same bits
    table = Table("bits", spec(rows=500, dim=8, init="eager", seed=3), [(100, 400)])
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(100, 500, (40,), generator=gen)
    offsets = torch.tensor([0, 3, 3, 17, 39])  # an empty bag, a bag of one
    weights = torch.rand(40, generator=gen) if weighted else None
    got = table.answer(ids.to(torch.int32), (offsets, weights, "sum"))
    want = pool_rows(table.lookup(ids), ids, offsets, weights, "sum")
    assert torch.equal(got, want)
    lazy = Table("bits", spec(rows=500, dim=8, init="lazy", seed=3), [(100, 400)])  # same name: same rows
    assert torch.equal(lazy.answer(ids, (offsets, weights, "sum")), got)  # lazy rows: the same values


def test_a_server_with_several_blocks_answers_an_empty_lookup():
    # (the sync settle before a checkpoint sends no ids; a pooled lookup may too)
    table = Table("empty", spec(rows=100, dim=4), [(0, 40), (60, 40)])
    nothing = torch.empty(0, dtype=torch.long)
    assert table.answer(nothing, None).shape == (0, 4)
    assert torch.equal(table.answer(nothing, (torch.tensor([0]), None, "sum")), torch.zeros(1, 4, dtype=torch.float64))



def _python_calls(fn) -> int:
    """Python-level function calls (and C functions called from Python) made by ``fn()``."""
    import sys

    calls = [0]

    def count(frame, event, arg):
        if event in ("call", "c_call"):
            calls[0] += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[0]


def test_a_lazy_lookup_and_step_of_fresh_ids_make_no_python_call_per_id():
    """A lazy 1,000,000 x 16 table on one server: looking up 2,048 fresh ids (pooled, as bags
    are, and as rows), then stepping them, makes about as many Python calls as 64 fresh ids
    (rows are created in chunks of 1,024: a few calls per chunk), and the rows equal the eager
    init rule's."""
    def calls_for(n: int, seed: int) -> tuple[int, int, int]:
        table = Table(f"fresh-{n}", spec(rows=1_000_000, dim=16, init="lazy", seed=seed, dtype=torch.float32),
                      [(0, 1_000_000)])
        ids = torch.randperm(1_000_000, generator=torch.Generator().manual_seed(n))[:n]
        offsets = torch.arange(0, n, 8)
        pooled = _python_calls(lambda: table.answer(ids, (offsets, None, "sum")))
        read = _python_calls(lambda: table.answer(ids, None))
        stepped = _python_calls(lambda: table.apply(ids, torch.ones(n, 16)))
        eager_rows = initial_rows(row_key(seed, f"fresh-{n}"), ids, 16)
        assert torch.equal(table.lookup(ids), eager_rows - 0.5)  # SGD lr 0.5, gradient 1: created by the rule
        return pooled, read, stepped

    small, large = calls_for(64, 1), calls_for(2048, 2)
    for what, a, b in zip(("pooled lookup", "row lookup", "step"), small, large):
        assert b <= a + 40, f"{what}: {a} Python calls for 64 fresh ids, {b} for 2,048"


@pytest.mark.parametrize("blocks", [[(0, 20)], [(0, 7), (7, 7), (14, 6)]])
def test_an_async_sgd_push_that_does_not_fit_is_refused_before_it_changes_anything(blocks):
    """An async SGD table adds a push's rows as they come (index_add_), so a push whose
    gradient does not fit its ids (2-d ids, a row per bag short, a row of the wrong width: a
    malformed BagsPush too) is a ValueError before anything changes, as in the other modes:
    no step or version counted, no settings taken, rows and eviction clocks as they were. A
    push naming rows not held here names each once."""
    from remote_module.ps.tables.server import _handlers

    name = job("sgd-push-refused")
    s = TableSpec(20, 3, torch.float32, "eager", 0, "async", 1, row_optimizer(torch.optim.SGD, {"lr": 0.5}),
                  evict_after=3)
    table, _ = _handlers._tables.setdefault(name, lambda: Table(name, s, blocks))
    _handlers._push_bags(name, "t0", 0, torch.tensor([1, 5, 5, 12], dtype=torch.int32), torch.tensor([0, 2]),
                         torch.ones(2, 3))
    for block in table.blocks:
        block.track_changes()

    def state():
        return (table.optimizer_steps, table.clocks.version, table.clocks.step, table.lookup(torch.arange(20)),
                [b.last.clone() for b in table.blocks], table.settings.latest)

    before = state()
    ids = torch.tensor([1, 5, 5, 1, 12, 3], dtype=torch.int32)
    bad = [lambda: _handlers._push_bags(name, "t0", 1, torch.tensor([[1, 2], [2, 3]]), torch.tensor([0, 2]),
                                        torch.ones(2, 3)),
           lambda: _handlers._push_bags(name, "t0", 1, ids, torch.tensor([], dtype=torch.long), torch.ones(0, 3)),
           lambda: _handlers._push_bags(name, "t0", 1, ids, torch.tensor([0, 2]), torch.ones(2, 1)),
           lambda: _handlers._push_bags(name, "t0", 1, ids, torch.tensor([0, 2]), torch.ones(2, 4)),
           lambda: _handlers._push_rows(name, "t0", 1, torch.tensor([5, 1, 5]), torch.ones(3, 1)),
           lambda: _handlers._push_rows(name, "t0", 1, torch.tensor([5, 1, 5]), torch.ones(2, 3))]
    for push in bad:
        with pytest.raises(ValueError, match="gradient of shape"):
            push()
        after = state()
        assert after[:3] == before[:3] and torch.equal(after[3], before[3]) and after[5] == before[5]
        assert all(torch.equal(a, b) for a, b in zip(after[4], before[4]))
    with pytest.raises(ValueError, match=r"rows \[-1, 25\] are not held on this server"):
        _handlers._push_bags(name, "t0", 1, torch.tensor([25, 1, 25, -1, 25]), torch.tensor([0, 2]), torch.ones(2, 3))
    assert state()[:3] == before[:3]


def test_a_bags_push_with_a_gradient_row_more_or_less_than_its_bags_is_refused():
    """A BagsPush's gradient has one row per bag: one more (or fewer) is refused with a
    ValueError naming the shapes, for a table alone and each table of a packed push, and
    changes nothing (it was applied with the extra row left out, or an IndexError)."""
    from remote_module.ps.tables.server import _handlers

    names = [job("bags-rows-a"), job("bags-rows-b")]
    s = TableSpec(20, 3, torch.float32, "eager", 0, "async", 1, row_optimizer(torch.optim.SGD, {"lr": 0.5}))
    tables = [_handlers._tables.setdefault(n, lambda: Table(n, s, [(0, 20)]))[0] for n in names]
    before = [t.lookup(torch.arange(20)) for t in tables]
    ids, first = torch.tensor([1, 5, 5, 1, 12], dtype=torch.int32), torch.tensor([0, 2, 2])
    for rows in (2, 4):
        with pytest.raises(ValueError, match=rf"shape \({rows}, 3\) does not fit ids of shape \(5,\) in 3 bags"):
            _handlers._push_bags(names[0], "t0", 0, ids, first, torch.ones(rows, 3))
        entries = [(n, "t0", 0, lo, hi, None) for n, (lo, hi) in zip(names, [(0, 2), (2, 5)])]
        outcomes = _handlers._push_bag_tables(entries, ids, first, torch.ones(rows, 3))
        assert [ok for ok, _ in outcomes] == [False, False]
        assert all(f.type_qualname == "ValueError" for _, f in outcomes)
    assert all(t.optimizer_steps == 0 and torch.equal(t.lookup(torch.arange(20)), b) for t, b in zip(tables, before))
    _handlers._push_bags(names[0], "t0", 0, ids, first, torch.ones(3, 3))  # one row per bag: taken
    assert tables[0].optimizer_steps == 1


@pytest.mark.parametrize("mode", ["half_async", "sync"])
def test_a_bags_push_held_until_its_step_is_its_rows_not_its_positions(mode):
    """A table that sums a push per row (Adagrad here) holds a bags push that half_async
    queues, or sync keeps until every trainer pushed, as its rows (one per distinct id), not
    a row per position; its step equals a twin's given the trainer's summed rows, bit for bit."""
    from remote_module.ps._rowwise import pooled_rows
    from remote_module.ps.tables.server import _handlers

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 6, (400,), generator=g, dtype=torch.int32)
    first = torch.arange(0, 400, 8)
    grads = [torch.randn(50, 3, generator=g) for _ in range(2)]
    s = TableSpec(20, 3, torch.float32, "eager", 0, mode, 2, row_optimizer(torch.optim.Adagrad, {"lr": 0.5}),
                  merge_every=2, merge_s=60.0)
    name = job(f"held-{mode}")
    bags, _ = _handlers._tables.setdefault(name, lambda: Table(name, s, [(0, 20)]))
    rows = Table(name, s, [(0, 20)])  # (the same rows, not registered: pushed here directly)
    _handlers._push_bags(bags.name, "t0", 0, ids, first, grads[0])
    held = bags.queued if mode == "half_async" else bags.sync.__dict__
    assert sum(t.shape[0] for t in _tensors(held) if t.dim() == 2) == torch.unique(ids).numel()
    _handlers._push_bags(bags.name, "t1", 0, ids.flip(0), first, grads[1])
    rows.push("t0", 0, *pooled_rows(ids, torch.arange(400) // 8, grads[0]))
    rows.push("t1", 0, *pooled_rows(ids.flip(0), torch.arange(400) // 8, grads[1]))
    assert bags.optimizer_steps == rows.optimizer_steps == 1
    assert torch.equal(bags.lookup(torch.arange(20)), rows.lookup(torch.arange(20)))


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    return [t for v in x for t in _tensors(v)] if isinstance(x, (list, tuple)) else []


def test_a_bags_push_reuses_the_last_bag_index_only_for_the_same_starts():
    """The server keeps a table's last pushed bag layout (``_bag_of_positions``): the same
    starts give the index computed before, other starts (of as many positions, or another
    dtype) their own, and bad starts are refused every time."""
    from remote_module.ps._rowwise import bag_index
    from remote_module.ps.tables.server import _handlers

    name = "bag-index-cache-test"
    first = torch.tensor([0, 2, 5], dtype=torch.int32)
    index = _handlers._bag_of_positions(name, first, 8)
    assert index.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert _handlers._bag_of_positions(name, first.clone(), 8) is index  # the same layout: reused
    other = torch.tensor([0, 4, 5], dtype=torch.int32)
    assert _handlers._bag_of_positions(name, other, 8).tolist() == bag_index(other, 8).tolist()
    assert _handlers._bag_of_positions(name, first.long(), 8).tolist() == index.tolist()
    assert _handlers._bag_of_positions(name, first, 9).tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2]
    for _ in range(2):
        with pytest.raises(ValueError, match="bag starts must begin at 0"):
            _handlers._bag_of_positions(name, torch.tensor([0, 5, 2]), 8)
    assert _handlers._bag_of_positions(name, first, 8).tolist() == index.tolist()
    _handlers._pushed_bags.pop(name, None)
