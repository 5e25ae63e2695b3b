"""A table's checkpoints as a hostile user loads them (issue 41): a weights-only load keeps the
optimizer state of rows stepped since, as torch's optimizer does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.ps import _table_checkpoints_remote as r
from tests.ps._world import job

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def on(world, worker: str, fn, *args, timeout: float = 60.0):
    return world.run({worker: (fn, *args)}, timeout=timeout)[worker]


def same(a, b, where: str = "") -> None:
    """``a`` and ``b`` equal: tensors bit for bit, containers key by key."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a), sorted(b))
        for key in a:
            same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


# ---- a weights-only load (item 3) -----------------------------------------------------------------


@pytest.mark.parametrize("init", ["lazy", "eager"])
def test_a_weights_only_load_keeps_the_optimizer_state_of_rows_stepped_since_as_torch(world, init):
    name = job(f"weights-only-{init}")
    got = on(world, "trainer0", r.weights_only_load, name, init)
    # the local reference: nn.EmbeddingBag(sparse=True) + Adagrad, the same steps and a
    # load_state_dict of the weights only (torch's optimizer keeps its state)
    local = nn.EmbeddingBag(r.ROWS, r.DIM, mode="sum", sparse=True, _weight=r.initial(name))
    opt = torch.optim.Adagrad(local.parameters(), **r.ADAGRAD[1])
    saved = None
    for k in range(3):
        if k == 2:
            local.load_state_dict(saved)
            loaded = r.every_row(local)
        opt.zero_grad()
        (local(*r.BAGS[k]) * r.bag_weights(k)).sum().backward()
        opt.step()
        if k == 0:
            saved = copy.deepcopy(local.state_dict())
    # rows stored since the checkpoint (4, 5) read as the checkpoint says: their first values
    assert torch.equal(got["loaded"], loaded)
    # one step later, rows 4 and 5 stepped with the Adagrad sums they had (1e-6: the row-wise
    # step and torch's sparse Adagrad round differently in the last bits)
    torch.testing.assert_close(got["rows"], r.every_row(local), rtol=1e-5, atol=1e-6)
    local_sum = opt.state[local.weight]["sum"]
    assert got["ids"].tolist() == [1, 2, 3, 4, 5, 6]
    torch.testing.assert_close(got["sum"], local_sum[got["ids"]], rtol=1e-5, atol=1e-6)
    assert got["step"] == 3


def test_a_full_load_weights_first_leaves_a_lazy_table_holding_the_checkpoints_rows_only(world):
    got = on(world, "trainer0", r.weights_then_optimizer, job("weights-then-optim"))
    assert got["saved_ids"] == [1, 2, 3]
    assert got["ids"] == got["state_ids"] == [1, 2, 3], got
    assert got["held"] == 3, got
