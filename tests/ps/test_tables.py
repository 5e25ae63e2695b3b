"""Server-side sparse tables (no RPC): lookups, lazy rows, and sparse steps equal to torch's
optimizers stepping an ``nn.Embedding(sparse=True)``."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.futures import Future

from remote_module.ps._rowwise import row_optimizer
from remote_module.ps.tables.server._rows import TableSpec, row_init
from remote_module.ps.tables.server._table import Table

BLOCKS = [(0, 7), (7, 7), (14, 6)]  # rows 0..19 in three blocks, as two servers might split them


def spec(cls=torch.optim.SGD, kwargs=None, init="eager", mode="async", trainers=1):
    return TableSpec(20, 3, torch.float64, init, 7, mode, trainers, row_optimizer(cls, kwargs or {"lr": 0.5}))


def table_with(weight: torch.Tensor, s: TableSpec) -> Table:
    t = Table("t", s, BLOCKS)
    for rows in t.blocks:
        if s.init == "eager":
            rows.values[:] = weight[rows.first:rows.first + rows.count]
    return t


@pytest.mark.parametrize("cls,kwargs", [
    (torch.optim.SGD, {"lr": 0.5}),
    (torch.optim.Adagrad, {"lr": 0.3, "initial_accumulator_value": 0.1}),
    (torch.optim.SparseAdam, {"lr": 0.05}),
], ids=["sgd", "adagrad", "sparse_adam"])
def test_sparse_steps_equal_a_local_sparse_embedding(cls, kwargs):
    g = torch.Generator().manual_seed(0)
    local = nn.Embedding(20, 3, sparse=True).double()
    opt = cls(local.parameters(), **kwargs)
    table = table_with(local.weight.detach(), spec(cls, kwargs))
    assert torch.equal(table.lookup(torch.arange(20)), local.weight.detach())  # same weights: bit for bit
    for _ in range(6):
        ids = torch.randint(0, 20, (9,), generator=g)
        target = torch.randn(9, 3, generator=g, dtype=torch.float64)
        opt.zero_grad()
        out = local(ids)
        # torch adds a repeated id's gradient rows one by one, the table their sum: rounding only
        torch.testing.assert_close(table.lookup(ids), out.detach(), atol=1e-12, rtol=1e-10)
        ((out - target) ** 2).sum().backward()
        grad_rows = 2 * (out.detach() - target)  # d/d(row) of the loss, per occurrence
        opt.step()
        table.apply(ids, grad_rows)
    torch.testing.assert_close(table.lookup(torch.arange(20)), local.weight.detach(), atol=1e-12, rtol=1e-10)


def test_lazy_rows_are_created_on_touch_seeded_by_row_id():
    lazy = Table("t", spec(init="lazy"), BLOCKS)
    ids = torch.tensor([3, 15, 3, 9])
    first = lazy.lookup(ids)
    assert torch.equal(first, row_init(lazy.spec, "t", ids))
    assert lazy.memory_bytes() == 0  # a lookup creates nothing
    lazy.apply(ids, torch.ones(4, 3, dtype=torch.float64))
    after = lazy.lookup(ids)
    torch.testing.assert_close(after[0], first[0] - 2 * 0.5)  # row 3 twice in the gradient: summed
    torch.testing.assert_close(after[1], first[1] - 0.5)
    assert lazy.memory_bytes() == 3 * 3 * 8  # three rows stored (SGD: no state)
    again = Table("t", spec(init="lazy"), BLOCKS)
    assert torch.equal(again.lookup(ids), first)  # the same rows in another run


def test_sync_applies_once_every_trainer_has_pushed_in_name_order():
    s = spec(mode="sync", trainers=2)
    t = Table("t", s, BLOCKS)
    before = t.lookup(torch.arange(20))
    t.push("trainer1", 0, torch.tensor([1, 2]), torch.ones(2, 3, dtype=torch.float64))
    assert torch.equal(t.lookup(torch.arange(20)), before)  # not applied yet
    t.push("trainer0", 0, torch.tensor([2]), torch.full((1, 3), 3.0, dtype=torch.float64))
    after = t.lookup(torch.arange(20))
    torch.testing.assert_close(after[1], before[1] - 0.5 * 1 / 2)
    torch.testing.assert_close(after[2], before[2] - 0.5 * 4 / 2)
    # step 0 again: the retry of a step() that failed on another server after this push arrived
    t.push("trainer0", 0, torch.tensor([2]), torch.full((1, 3), 3.0, dtype=torch.float64))
    assert torch.equal(t.lookup(torch.arange(20)), after)  # counted once
    with pytest.raises(RuntimeError, match="pushed step 5, the table is at step 1"):
        t.push("trainer0", 5, torch.tensor([2]), torch.ones(1, 3, dtype=torch.float64))


def test_ids_not_held_here_are_refused():
    t = Table("t", spec(), BLOCKS[:2])
    with pytest.raises(ValueError, match=r"rows \[15\] are not held on this server"):
        t.lookup(torch.tensor([1, 15]))


@pytest.mark.parametrize("init", ["eager", "lazy"])
def test_optimizer_state_is_held_for_the_rows_ever_stepped_only(init):
    """An eager table's rows are all stored, but an Adagrad or SparseAdam state row exists only
    for rows a step touched (allocated by doubling: at most twice those, at least 64)."""
    s = TableSpec(100_000, 4, torch.float32, init, 0, "async", 1, row_optimizer(torch.optim.SparseAdam, {"lr": 0.1}))
    t = Table("t", s, [(0, 100_000)])
    block = t.blocks[0]
    t.apply(torch.tensor([5, 70_000, 5]), torch.ones(3, 4))
    assert set(block.state) == {"exp_avg", "exp_avg_sq"}
    assert all(v.shape[0] == 64 for v in block.state.values())
    g = torch.Generator().manual_seed(0)
    touched = torch.cat([torch.randperm(100_000, generator=g)[:999], torch.tensor([5])]).unique()
    t.apply(touched, torch.ones(touched.numel(), 4))
    stepped = int(torch.cat([touched, torch.tensor([5, 70_000])]).unique().numel())
    assert block.state_used == stepped
    assert all(stepped <= v.shape[0] <= 2 * stepped for v in block.state.values())
    # and the state is each row's own: row 5, stepped twice, differs from a row stepped once
    once = next(i for i in touched.tolist() if i not in (5, 70_000))
    where = block.state_slot[block.slots(torch.tensor([5, once]), create=False)]
    assert not torch.equal(block.state["exp_avg"][where[0]], block.state["exp_avg"][where[1]])


@pytest.mark.parametrize("init", ["eager", "lazy"])
def test_per_row_bookkeeping_is_kept_only_once_something_needs_it(init):
    """Issue 45: plain SGD keeps no state slot per row; no row version is kept until something
    reads what changed (a delta, a save's snapshot), and then a delta holds exactly the rows
    changed after the one before."""
    from remote_module.ps.tables.lifetime._deltas import changed_rows

    s = TableSpec(1000, 4, torch.float32, init, 0, "async", 1, row_optimizer(torch.optim.SGD, {"lr": 0.1}))
    t = Table("t", s, [(0, 1000)])
    block = t.blocks[0]
    t.apply(torch.tensor([3, 500, 999]), torch.ones(3, 4))
    assert block._state_slot is None and block.changed is None
    assert block.changed_after(slice(0, 5), 0).tolist() == [True] * 5  # (untracked: every row counts)
    per_row = block.bookkeeping_bytes() / block.held()
    assert per_row == (1 if init == "eager" else 17), per_row  # the stepped flag (+ a lazy block's index)
    first = changed_rows(t.blocks, -1, False)  # the whole table, as a first delta is
    assert block.changed is not None
    assert block.bookkeeping_bytes() / block.held() == per_row + 4
    since = t.clocks.version
    t.apply(torch.tensor([7, 500]), torch.ones(2, 4))
    delta = changed_rows(t.blocks, since, False)
    assert delta["ids"].tolist() == [7, 500]
    torch.testing.assert_close(delta["rows"], t.lookup(torch.tensor([7, 500])), rtol=0, atol=0)
    assert first["ids"].numel() == (1000 if init == "eager" else 3)
    # an optimizer with state makes the slots at its first state row
    a = Table("a", s._replace(optimizer=row_optimizer(torch.optim.Adagrad, {"lr": 0.1})), [(0, 1000)])
    a.apply(torch.tensor([1]), torch.ones(1, 4))
    assert a.blocks[0]._state_slot is not None and int((a.blocks[0].state_slot >= 0).sum()) == 1


def test_row_versions_past_their_int32_stamps_never_hide_a_change(monkeypatch):
    """A row's version is kept in 4 bytes relative to a base that moves up when it would not
    fit (here after 8 versions): a delta since any version still holds every row changed
    after it, and the rows changed since a recent version exactly."""
    from remote_module.ps.tables.server import _rows

    monkeypatch.setattr(_rows, "_STAMP_MAX", 8)
    s = TableSpec(40, 2, torch.float32, "eager", 0, "async", 1, row_optimizer(torch.optim.SGD, {"lr": 0.1}))
    t = Table("t", s, [(0, 40)])
    block = t.blocks[0]
    block.track_changes()
    changed_at = {}
    for row in range(30):
        t.apply(torch.tensor([row]), torch.ones(1, 2))
        changed_at[row] = t.clocks.version
    slots = torch.arange(40)
    for since in range(t.clocks.version + 1):
        got = set(slots[block.changed_after(slots, since)].tolist())
        truly = {row for row, v in changed_at.items() if v > since}
        assert truly <= got, (since, truly - got)
        if since >= t.clocks.version - 4:
            assert got == truly, (since, got, truly)
        # a run of slots read without an index says the same
        assert torch.equal(block.changed_after(slice(0, 40), since), block.changed_after(slots, since))


def test_the_geo_cache_trains_its_rows_as_torchs_sparse_optimizer_and_keeps_state_across_pushes():
    """geo's trainer-side rows: Adagrad steps on cached rows equal torch's Adagrad on a sparse
    embedding; a push's drop forgets the rows but not their state; a copy carries no lock."""
    import copy

    from remote_module.ps.tables._geo_cache import GeoCache

    local = nn.Embedding(20, 3, sparse=True).double()
    opt = torch.optim.Adagrad(local.parameters(), lr=0.3)
    cache = GeoCache(3, row_optimizer(torch.optim.Adagrad, {"lr": 0.3}), torch.float64)
    for step, ids in enumerate([torch.tensor([4, 1, 4]), torch.tensor([7, 1]), torch.tensor([1, 19])]):
        uniq = ids.unique()
        missing = cache.missing(uniq)
        if bool(missing.any()):  # as fetched from the servers: the local module's rows
            cache.add(uniq[missing], local.weight.detach()[uniq[missing]].clone())
        assert torch.equal(cache.values(uniq), local.weight.detach()[uniq])
        grad = torch.randn(ids.numel(), 3, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        local(ids).backward(grad)
        opt.step()
        summed = torch.zeros(uniq.numel(), 3, dtype=torch.float64).index_add_(0, torch.searchsorted(uniq, ids), grad)
        cache.step(uniq, summed)
        torch.testing.assert_close(cache.values(uniq), local.weight.detach()[uniq], atol=1e-12, rtol=0)
        if step == 1:  # a push: the rows go, their Adagrad sums stay
            ids_out, deltas = cache.deltas()
            assert ids_out.tolist() == [1, 4, 7] and deltas.abs().sum() > 0
            cache.drop(ids_out)
            assert bool(cache.missing(torch.tensor([1, 4, 7])).all())
            assert cache.state_ids.tolist() == [1, 4, 7]
    copy.deepcopy(cache)


def test_sync_keeps_a_push_for_the_next_step_until_its_step_completes():
    """A trainer that looked nothing up since its last step pushes the next one before the
    others have pushed theirs: the push waits for its step (a step in which no trainer had a
    gradient completes the round without an optimizer step)."""
    t = Table("t", spec(mode="sync", trainers=2), BLOCKS)
    before = t.lookup(torch.arange(20))
    one = torch.ones(1, 3, dtype=torch.float64)
    t.push("trainer0", 0, torch.tensor([1]), one)
    t.push("trainer0", 1, None, None)  # no gradient, ahead of the table
    t.push("trainer0", 2, torch.tensor([2]), one)  # and the step after
    assert t.sync.done == 0 and t.optimizer_steps == 0
    t.push("trainer1", 0, None, None)
    assert t.sync.done == 1 and t.optimizer_steps == 1
    t.push("trainer1", 1, None, None)  # step 1: nobody had a gradient
    assert t.sync.done == 2 and t.optimizer_steps == 1
    t.push("trainer1", 2, torch.tensor([2]), one)
    assert t.sync.done == 3 and t.optimizer_steps == 2
    after = t.lookup(torch.arange(20))
    torch.testing.assert_close(after[1], before[1] - 0.5 / 2)
    torch.testing.assert_close(after[2], before[2] - 0.5 * 2 / 2)
    with pytest.raises(RuntimeError, match="pushed step 5, the table is at step 3"):
        t.push("trainer0", 5, None, None)  # not the step after its last push


def test_sync_takes_the_retry_of_a_push_waiting_for_its_step_as_a_no_op():
    """A push kept for a later step (the trainer looked nothing up since its last step), then
    the same step pushed again: the retry of a step() that failed on another server after this
    one had it. Counted once, as the retry of a push of the current step is, not refused."""
    t = Table("t", spec(mode="sync", trainers=2), BLOCKS)
    before = t.lookup(torch.arange(20))
    one = torch.ones(1, 3, dtype=torch.float64)
    t.push("trainer0", 0, None, None)
    t.push("trainer0", 1, torch.tensor([1]), one)  # waits for step 0
    t.push("trainer0", 1, torch.tensor([1]), one)  # the retry: already held
    t.push("trainer1", 0, None, None)
    t.push("trainer1", 1, None, None)
    assert t.sync.done == 2 and t.optimizer_steps == 1
    torch.testing.assert_close(t.lookup(torch.arange(20))[1], before[1] - 0.5 / 2)  # once


def test_sync_a_waiting_lookup_that_fails_fails_alone():
    """Two lookups wait for step 1; one asks for rows this server does not hold. When the step
    completes, that lookup fails with its own error, the other is answered and the push that
    completed the step succeeds (none of them is left waiting forever)."""
    t = Table("t", spec(mode="sync", trainers=2), BLOCKS)
    bad, good = Future(), Future()
    with t.lock:
        assert t.sync.wait(1, bad, lambda: t.answer(torch.tensor([99]), None), math.inf)
        assert t.sync.wait(1, good, lambda: t.answer(torch.tensor([1, 2]), None), math.inf)
    t.push("trainer0", 0, None, None)
    t.push("trainer1", 0, None, None)  # completes step 0: answers both
    assert t.sync.done == 1 and not t.sync.waiters
    with pytest.raises(ValueError, match=r"rows \[99\] are not held"):
        bad.wait()
    torch.testing.assert_close(good.wait(), t.lookup(torch.tensor([1, 2])))


@pytest.mark.parametrize("mode", ["sync", "half_async"])
def test_a_push_of_rows_not_held_here_is_refused_before_it_counts(mode):
    """A push naming rows this server does not hold (or a gradient of the wrong shape) fails for
    the trainer that sent it, before it counts: before, sync kept it and failed the push that
    completed the step, whose round then never completed (every later push waited on it);
    half_async queued it and dropped the good pushes merged with it."""
    t = Table("t", spec(mode=mode, trainers=2), BLOCKS)
    t.merges.every = 2
    before = t.lookup(torch.arange(20))
    one = torch.ones(1, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"rows \[99\] are not held"):
        t.push("trainer0", 0, torch.tensor([99]), one)
    with pytest.raises(ValueError, match=r"gradient of shape \(1, 2\)"):
        t.push("trainer0", 0, torch.tensor([1]), torch.ones(1, 2, dtype=torch.float64))
    t.push("trainer0", 0, torch.tensor([1]), one)  # the trainer's step, sent again right
    t.push("trainer1", 0, torch.tensor([2]), one)
    assert t.optimizer_steps == 1 and t.merges.count == 0
    if mode == "sync":
        assert t.sync.done == 1 and not t.sync.pushed
    after = t.lookup(torch.arange(20))
    scale = 0.5 / 2 if mode == "sync" else 0.5
    torch.testing.assert_close(after[1], before[1] - scale)
    torch.testing.assert_close(after[2], before[2] - scale)
