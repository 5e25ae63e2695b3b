"""The table servers' handlers of a step's messages, called in-process on tables created here
(no RPC): a collection's packed lookup (``_pool_tables``) and pushes (``_push_bag_tables``)
answer what each table's own read and push would, whatever the layout of their bags."""

from __future__ import annotations

import pytest
import torch

from remote_module.ps._rowwise import bag_index, row_optimizer
from remote_module.ps.tables.server import _handlers
from remote_module.ps.tables.server._rows import TableSpec
from remote_module.ps.tables.server._table import Table


@pytest.fixture
def tables():
    """Three async SGD tables held here: whole, from row 0 of 40, and from row 10 of 30."""
    _handlers._packed_layouts.clear()  # (what another test of this process left: counted below)
    made = {}
    for name, rows, blocks in (("m.a", 12, [(0, 12)]), ("m.b", 40, [(0, 20)]), ("m.c", 30, [(10, 20)])):
        spec = TableSpec(rows, 3, torch.float32, "eager", 5, "async", 1, row_optimizer(torch.optim.SGD, {"lr": 0.5}))
        made[name] = Table(name, spec, blocks)
        _handlers._tables.put(name, made[name])
    yield made
    for name in made:
        _handlers._tables.pop(name)
    _handlers._packed_layouts.clear()


def reference_pool(names, ids, first, bag_base, bag_counts):
    """Each table's answer as its own read gives it: ids ``ends[base]`` to ``ends[base + count]``
    (``ends``: ``first`` then the number of ids), bags from ``first[base:base + count]``."""
    ends = torch.cat([first, first.new_tensor([ids.numel()])])
    out = []
    for name, base, count in zip(names, bag_base, bag_counts):
        table = _handlers._table(name)
        lo, hi = (int(ends[base]), int(ends[base + count])) if count else (0, 0)
        if lo == hi:
            out.append(torch.zeros(count, table.spec.dim))
        else:
            out.append(table.answer(ids[lo:hi].long(), (first[base:base + count] - lo, None, "sum")))
    return torch.cat(out)


def pool(names, ids, first, bag_base, bag_counts, seen=None):
    return _handlers._pool_tables(names, [0] * len(names), ids, first, bag_base, bag_counts, seen=seen).wait()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_packed_lookup_answers_each_tables_own_read_bit_for_bit(tables, dtype):
    names = ["m.a", "m.b", "m.c"]
    ids = torch.tensor([3, 3, 11, 0, 5, 19, 2, 10, 29, 15], dtype=dtype)
    first = torch.tensor([0, 2, 3, 4, 6, 6, 7, 9])  # 8 bags: a's 0-2, b's 3-5, c's 6-7
    for _ in range(3):  # (the layout made once, then taken from the cache)
        got = pool(names, ids, first, [0, 3, 6], [3, 3, 2])
        assert torch.equal(got, reference_pool(names, ids, first, [0, 3, 6], [3, 3, 2]))
    assert len(_handlers._packed_layouts) == 1


def test_a_packed_lookup_of_a_table_with_no_bags_or_no_ids_here_answers_zeros(tables):
    ids = torch.tensor([1, 2, 15])
    first = torch.tensor([0, 1, 2, 3])  # a: bags 0-1, b: bag 2, c: bag 3 (no ids here)
    names, base, counts = ["m.a", "m.b", "m.c", "m.a"], [0, 2, 3, 4], [2, 1, 1, 0]
    assert torch.equal(pool(names, ids, first, base, counts), reference_pool(names, ids, first, base, counts))


def test_a_packed_lookup_whose_tables_share_bags_reads_them_as_sent(tables):
    ids = torch.tensor([1, 2, 4, 7, 8, 9])
    first = torch.tensor([0, 2, 4])
    names, base, counts = ["m.a", "m.b"], [1, 0], [2, 2]  # bag 1 in both, out of order
    assert _handlers._packed_layout(base, counts, 3) is None
    assert torch.equal(pool(names, ids, first, base, counts), reference_pool(names, ids, first, base, counts))


def test_a_packed_lookup_whose_bags_pass_the_batches_fails_as_it_did(tables):
    ids, first = torch.tensor([1, 2]), torch.tensor([0, 1])
    with pytest.raises(IndexError):
        pool(["m.a"], ids, first, [1], [3])
    with pytest.raises(LookupError, match="no sharded table 'm.none'"):
        pool(["m.a", "m.none"], ids, first, [0, 1], [1, 1])


def test_a_packed_lookup_of_ids_not_held_here_names_them(tables):
    with pytest.raises(ValueError, match=r"rows \[25\] are not held on this server"):
        pool(["m.b"], torch.tensor([1, 25]), torch.tensor([0]), [0], [1])
    with pytest.raises(ValueError, match=r"rows \[3\] are not held on this server"):
        pool(["m.c"], torch.tensor([3, 25]), torch.tensor([0]), [0], [1])


def test_a_packed_push_steps_each_table_as_its_own_push_would(tables):
    ids = torch.tensor([3, 3, 11, 0, 5, 19, 12, 29], dtype=torch.int32)
    first = torch.tensor([0, 2, 3, 6])
    grads = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    entries = [("m.a", "t", 1, 0, 3, None), ("m.b", "t", 1, 3, 6, None), ("m.c", "t", 1, 6, 8, None)]
    before = {name: t.lookup(torch.arange(t.blocks[0].first, t.blocks[0].first + t.blocks[0].count)).clone()
              for name, t in tables.items()}
    outcomes = _handlers._push_bag_tables(entries, ids, first, grads)
    assert outcomes == [(True, None)] * 3
    per_position = grads.index_select(0, bag_index(first, ids.numel())) * -0.5
    for name, _, _, lo, hi, _ in entries:
        block = tables[name].blocks[0]
        expected = before[name].index_add(0, ids[lo:hi].long() - block.first, per_position[lo:hi])
        assert torch.equal(block.values, expected)


def test_a_push_takes_a_trainers_new_settings_at_once(tables):
    table = tables["m.a"]
    ids, grad = torch.tensor([1]), torch.ones(1, 3)
    row = table.lookup(ids).clone()
    for lr in (0.5, 0.25, 0.25, 2.0):
        _handlers._set_settings("m.a", "t", {"lr": lr})
        _handlers._push_rows("m.a", "t", 1, ids, grad)
        row = row + grad * -lr
        assert torch.equal(table.lookup(ids), row)


@pytest.mark.parametrize("starts, n", [([1, 2], 4), ([0, 3, 2], 4), ([0, 5], 4)])
def test_bag_index_refuses_starts_that_do_not_fit(starts, n):
    with pytest.raises(ValueError, match="bag starts must begin at 0"):
        bag_index(torch.tensor(starts), n)


@pytest.mark.parametrize("starts, n", [([0, 2, 2, 5], 7), ([0], 0), ([], 3), ([0, 0], 0)])
def test_bag_index_gives_each_positions_bag(starts, n):
    starts_t = torch.tensor(starts, dtype=torch.long)
    expected = [max(b for b, s in enumerate(starts) if s <= p) for p in range(n)] if starts else []
    assert bag_index(starts_t, n).tolist() == expected
