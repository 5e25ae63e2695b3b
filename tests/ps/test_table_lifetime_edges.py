"""Edges of long-lived tables (issue 26) a hostile user reaches: an eager table with eviction
whose rows were never stepped, admission sketches loaded onto other layouts or counter widths,
and a checkpoint's optimizer state loaded before its rows."""

from __future__ import annotations

import pytest
import torch

from remote_module.ps.tables.server._initial import initial_rows, row_key
from remote_module.ps.tables.server._rows import TableSpec
from tests.ps import _lifetime_edges_remote as r
from tests.ps._world import job


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def test_an_eager_table_evicts_only_rows_that_left_their_first_values(world):
    name = job("eager-evict")
    got = world.run({"trainer0": (r.eager_eviction, name)})["trainer0"]
    # row 7 was stepped once and evicted once; the 96 rows never stepped were never "evicted"
    assert got["evicted"] == 1, got["evicted"]
    # a delta of 8 steps of rows 1, 2, 50: those rows, no tombstones of rows at their first values
    assert got["delta_ids"] == [1, 2, 50] and got["delta_evicted"] == [], (got["delta_ids"][:10],
                                                                            got["delta_evicted"][:10])
    init = initial_rows(row_key(0, name), torch.arange(100), 2)
    untouched = torch.ones(100, dtype=torch.bool)
    untouched[[1, 2, 50]] = False
    assert torch.equal(got["rows"][untouched], init[untouched])  # row 7 included: evicted, back at its init


def test_a_whole_sketch_loaded_onto_another_layout_replaces_the_counts(world):
    got = world.run({"trainer0": (r.sketch_onto_another_layout, job("sketch-layout"))})["trainer0"]
    assert got == {"saved": 0, "loader": 0}, got


def test_a_sketch_of_another_counter_width_is_refused(world):
    got = world.run({"trainer0": (r.sketch_of_another_width, job("sketch-width"))})["trainer0"]
    assert got["state_dict"].startswith("RuntimeError") and "2 bits wide, this table's 4" in got["state_dict"], got
    assert got["delta"].startswith("ValueError") and "2 bits wide, this table's 4" in got["delta"], got
    assert got["held"] == 0  # (refused before any row was set)


@pytest.mark.parametrize("optimizer_first", [True, False], ids=["optimizer-first", "rows-first"])
def test_optimizer_state_loads_in_either_order_with_eviction(world, optimizer_first):
    got = world.run({"trainer0": (r.optimizer_state_loaded_first, job("load-order"), optimizer_first)})["trainer0"]
    saved, loaded = got["saved"], got["loaded"]
    assert saved["ids"].tolist() == loaded["ids"].tolist() == [4, 5, 6, 50, 51]
    assert torch.equal(saved["sum"], loaded["sum"])


@pytest.mark.parametrize("init", ["eager", "lazy"])
def test_a_loaded_padding_row_is_never_evicted(init):
    # nn.Embedding never changes its padding row, a loaded one included: eviction (of rows not
    # stepped) must not reset it to zeros
    from remote_module.ps._rowwise import row_optimizer
    from remote_module.ps.tables.server import _checkpoint_handlers, _handlers
    from remote_module.ps.tables.server._rows import TableSpec
    from remote_module.ps.tables.server._table import Table

    name = job(f"evict-padding-{init}")
    spec = TableSpec(10, 2, torch.float32, init, 0, "async", 1, row_optimizer(torch.optim.SGD, {"lr": 0.5}),
                     padding_idx=0, evict_after=2)
    table, _ = _handlers._tables.setdefault(name, lambda: Table(name, spec, [(0, 10)]))
    _checkpoint_handlers._set_rows(name, torch.tensor([0]), torch.full((1, 2), 5.0))
    for _ in range(4):
        with table.lock:
            table.apply(torch.tensor([3]), torch.ones(1, 2))
    assert torch.equal(table.lookup(torch.tensor([0])), torch.full((1, 2), 5.0))
    assert table.stats()["rows_evicted"] == 0


@pytest.mark.parametrize("init", ["lazy", "eager"])
def test_eviction_with_adagrad_state_equals_a_reference_over_many_sweeps(init):
    """A table's rows (on this process, no RPC) under a random stream with eviction every 3
    steps and Adagrad: freed slots and state rows are reused by new rows, and every row and
    its state equal a reference that resets an evicted row and its state (1e-6)."""
    from remote_module.ps._rowwise import row_optimizer
    from remote_module.ps.tables.server._table import Table

    rows_n, dim, lr, n = 64, 3, 0.5, 3
    spec = TableSpec(rows_n, dim, torch.float32, init, 0, "async", 1, row_optimizer(torch.optim.Adagrad, {"lr": lr}),
                     evict_after=n)
    table = Table(job("free-list"), spec, [(0, rows_n)])
    init_rows = table.blocks[0].initial(torch.arange(rows_n))
    ref, acc = init_rows.clone(), torch.zeros(rows_n, dim)
    last = torch.full((rows_n,), -1)  # -1: at its first value
    gen = torch.Generator().manual_seed(0)
    for clock in range(60):
        ids = torch.randint(0, rows_n, (int(torch.randint(1, 20, (1,), generator=gen)),), generator=gen)
        grad = torch.randn(ids.numel(), dim, generator=gen)
        stale = (last >= 0) & (clock - last >= n)
        ref[stale], acc[stale], last[stale] = init_rows[stale], 0, -1
        uniq, inverse = torch.unique(ids, return_inverse=True)
        g = torch.zeros(uniq.numel(), dim).index_add_(0, inverse, grad)
        acc[uniq] += g * g
        ref[uniq] -= lr * g / (acc[uniq].sqrt() + 1e-10)
        last[uniq] = clock + 1
        with table.lock:
            table.apply(ids, grad)
        got = table.lookup(torch.arange(rows_n))
        live = ~((last >= 0) & (clock + 1 - last >= n))
        torch.testing.assert_close(got[live], ref[live], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[~live], init_rows[~live], rtol=0, atol=0)
    block = table.blocks[0]
    assert block.evicted > 0
    if init == "lazy":  # storage and state bounded by the rows live within n steps (plus the sweep's lag)
        assert block.values.shape[0] <= 2 * 20 * (n + 1) and block.state_used <= 2 * 20 * (n + 1)


@pytest.mark.parametrize("init", ["lazy", "eager"])
def test_loading_deltas_frees_the_state_rows_it_replaces(init):
    """A replica loading delta after delta of the same rows (their Adagrad state in each)
    reuses their state rows: its state stays the source's size, memory_bytes and
    table_stats() count only the rows with state (a load set each row's state slot to none
    and left its old state row neither used nor free: a leak per row per delta)."""
    from remote_module.ps._rowwise import row_optimizer
    from remote_module.ps.tables.server import _checkpoint_handlers, _handlers
    from remote_module.ps.tables.server._table import Table

    name = job(f"delta-state-{init}")
    spec = TableSpec(32, 2, torch.float32, init, 0, "async", 1, row_optimizer(torch.optim.Adagrad, {"lr": 0.1}))
    source, _ = _handlers._tables.setdefault(name, lambda: Table(name, spec, [(0, 32)]))
    replica = Table(name, spec, [(0, 32)])  # (the same name: the same first rows)
    _handlers._tables.setdefault(name + "-replica", lambda: replica)
    for _ in range(20):
        with source.lock:
            source.apply(torch.tensor([1, 5, 9, 30]), torch.ones(4, 2))
        d = _checkpoint_handlers._table_delta(name, "replica")
        _checkpoint_handlers._apply_delta(name + "-replica", tuple(d["whole"]), d["evicted"], d["ids"], d["rows"],
                                   d["stepped"], d["state"], d["has_state"], d["last"], d["step"], d["clock"])
    block, mine = replica.blocks[0], source.blocks[0]
    assert torch.equal(replica.lookup(torch.arange(32)), source.lookup(torch.arange(32)))
    held = block.state_slot[block.state_slot >= 0]
    assert held.numel() == 4 and block.state_used - block.state_free.numel() == 4, (block.state_used,
                                                                                   block.state_free.numel())
    assert replica.memory_bytes() == source.memory_bytes() == mine.memory_bytes()
    assert block.state_used <= 8  # (its state rows reused, not one more set per delta)


def test_geo_deltas_after_a_load_into_the_source_hold_the_loaded_state():
    """A geo trainer's local optimizer state, followed by a replica through deltas: after the
    source loads a checkpoint (its step count goes back) and steps one row, the next delta
    holds every row the load changed, so the replica equals the source. Rows changed were
    marked with the step count, which the load moved back below the delta's baseline: the
    delta was empty and the replica kept the state from before the load, silently."""
    from remote_module.ps._rowwise import row_optimizer
    from remote_module.ps.tables._geo_cache import GeoCache

    opt = row_optimizer(torch.optim.Adagrad, {"lr": 0.1})
    source, replica, second = GeoCache(2, opt), GeoCache(2, opt), GeoCache(2, opt)
    ids = torch.tensor([1, 2, 3])
    source.add(ids, torch.zeros(3, 2))
    for _ in range(5):
        source.step(ids, torch.ones(3, 2))
    replica.load_delta(source.delta("t"))  # whole
    second.load_delta(replica.delta("u"))  # (a replica of the replica)
    saved = source.state_dict()
    for _ in range(5):
        source.step(ids, torch.ones(3, 2))
    replica.load_delta(source.delta("t"))
    second.load_delta(replica.delta("u"))
    source.load_state_dict(saved["step"], saved["ids"], {"sum": saved["sum"]}, saved["geo_step_calls"])
    source.step(torch.tensor([1]), torch.ones(1, 2))
    delta = source.delta("t")
    assert delta["ids"].tolist() == [1, 2, 3] and not delta["whole"]
    replica.load_delta(delta)
    second.load_delta(replica.delta("u"))
    for copy in (replica, second):
        got, want = copy.state_dict(), source.state_dict()
        assert got["step"] == want["step"] == 6
        assert torch.equal(got["ids"], want["ids"]) and torch.equal(got["sum"], want["sum"]), got["sum"]
    assert source.delta("t")["ids"].numel() == 0  # (nothing changed since)


@pytest.mark.parametrize("swept_first", [True, False], ids=["swept", "not-swept"])
def test_optimizer_state_loaded_onto_an_evicted_eager_row_does_not_depend_on_sweeps(swept_first):
    """An eager row evicted (stale) gets optimizer state loaded, then its table steps other
    rows: whether a sweep had run (table_stats() sweeps) must not change what the row's next
    step uses. Unswept, the load renewed the row with a clock of now, so it was evicted again
    (its loaded state dropped); swept, it sat at its first value with the state kept."""
    from remote_module.ps._rowwise import row_optimizer
    from remote_module.ps.tables.server import _checkpoint_handlers, _handlers
    from remote_module.ps.tables.server._table import Table

    name = job(f"eager-state-{swept_first}")
    spec = TableSpec(64, 2, torch.float32, "eager", 0, "async", 1, row_optimizer(torch.optim.Adagrad, {"lr": 0.1}),
                     evict_after=4)
    table, _ = _handlers._tables.setdefault(name, lambda: Table(name, spec, [(0, 64)]))
    with table.lock:
        table.apply(torch.tensor([5]), torch.ones(1, 2))
        for _ in range(5):
            table.apply(torch.tensor([10]), torch.ones(1, 2))
    if swept_first:
        table.stats()
    _checkpoint_handlers._set_row_state(name, 6, torch.tensor([5]), {"sum": torch.full((1, 2), 9.0)})
    with table.lock:
        for _ in range(5):
            table.apply(torch.tensor([10]), torch.ones(1, 2))
    _, ids, state = _checkpoint_handlers._row_state(name, 0)
    assert ids.tolist() == [5, 10] and state["sum"][0].tolist() == [9.0, 9.0], (ids, state)
