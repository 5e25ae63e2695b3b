"""A table's checkpoints as a hostile user loads them (issue 41): a weights-only load keeps the
optimizer state of rows stepped since, as torch's optimizer does; trainers sharing a delta
token each get a complete chain, and a delta that does not follow what a table loaded is
refused; another optimizer's state is refused before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.ps import _table_checkpoints_remote as r
from tests.ps._world import job


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def on(world, worker: str, fn, *args):
    return world.run({worker: (fn, *args)})[worker]


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
    # one step later, rows 4 and 5 stepped with the Adagrad sums they had: bit for bit
    assert torch.equal(got["rows"], r.every_row(local))
    local_sum = opt.state[local.weight]["sum"]
    assert got["ids"].tolist() == [1, 2, 3, 4, 5, 6]
    assert torch.equal(got["sum"], local_sum[got["ids"]])
    assert got["step"] == 3


def test_a_full_load_weights_first_leaves_a_lazy_table_holding_the_checkpoints_rows_only(world):
    got = on(world, "trainer0", r.weights_then_optimizer, job("weights-then-optim"))
    assert got["saved_ids"] == [1, 2, 3]
    assert got["ids"] == got["state_ids"] == [1, 2, 3], got
    assert got["held"] == 3, got


# ---- delta chains of trainers sharing a token (item 4) ---------------------------------------------


@pytest.fixture(scope="module")
def chains(ps_world):
    """Two trainers of one lazy Adagrad table (async), each taking deltas with the token
    "ckpt" after each of its steps, interleaved: trainer0 steps, takes a delta, trainer1
    steps, takes a delta. The full checkpoint (taken before the deltas' baselines), each
    trainer's deltas in order, a second full checkpoint after round 2 and one at the end."""
    world, name = ps_world, job("chains")
    world.run({t: (r.chain_table, name) for t in ("trainer0", "trainer1")})
    full = on(world, "trainer0", r.chain_checkpoint, name)
    deltas = {t: [on(world, t, r.chain_delta, name)] for t in ("trainer0", "trainer1")}  # (baselines: whole)
    mid = None
    for k in range(3):
        for i, t in enumerate(("trainer0", "trainer1")):
            on(world, t, r.chain_step, name, k, i)
            deltas[t].append(on(world, t, r.chain_delta, name))
        if k == 1:
            mid = on(world, "trainer0", r.chain_checkpoint, name)
    for t in ("trainer0", "trainer1"):  # (the last: nothing changes between them and the end)
        deltas[t].append(on(world, t, r.chain_delta, name))
    end = on(world, "trainer0", r.chain_checkpoint, name)
    return {"name": name, "full": full, "mid": mid, "deltas": deltas, "end": end}


@pytest.mark.parametrize("trainer, saved", [("trainer0", False), ("trainer1", False), ("trainer1", True)],
                         ids=["trainer0", "trainer1", "trainer1-through-a-file"])
def test_a_full_checkpoint_and_one_trainers_deltas_restore_the_table_bit_for_bit(world, chains, trainer, saved):
    got = on(world, "trainer2", r.restore, job("restored"), chains["full"], chains["deltas"][trainer], saved)
    assert got["model"]["weight.ids"].tolist() == chains["end"]["model"]["weight.ids"].tolist()
    same(got["model"], chains["end"]["model"], "model")
    for key in ("step", "ids", "sum"):
        same(got["optim"][key], chains["end"]["optim"][key], key)


@pytest.mark.parametrize("case", ["skips one", "first skips one", "older than the checkpoint", "collection",
                                  "metadata lost"])
def test_a_delta_that_does_not_follow_what_a_table_loaded_is_refused_naming_its_token(world, chains, case):
    a = chains["deltas"]["trainer0"]
    full, loaded, delta, why = {
        "skips one": (chains["full"], a[:2], a[3], "missing"),  # the baseline and round 0's, then round 2's
        "first skips one": (chains["full"], [], a[2], "missing"),  # round 1's right after the full checkpoint
        "older than the checkpoint": (chains["mid"], [], a[1], "back in time"),  # round 0's onto round 1's
        "collection": (chains["full"], [], a[2], "missing"),
        # round 0's after a full checkpoint copied key by key: it cannot tell what follows it
        "metadata lost": (chains["full"], [], a[1], "lost its metadata"),
    }[case]
    got = on(world, "trainer2", r.refused, job("refused"), full, loaded, delta, case == "collection",
             case == "metadata lost")
    assert got["error"] is not None and got["error"].startswith("ValueError"), got["error"]
    assert "token 'ckpt'" in got["error"] and "'trainer0'" in got["error"] and why in got["error"], got["error"]
    same(got["after"], got["before"], "unchanged")


def test_the_deltas_a_table_loads_in_order_after_its_checkpoint_are_taken(world, chains):
    a, b = chains["deltas"]["trainer0"], chains["deltas"]["trainer1"]
    # round 1's checkpoint, then both trainers' deltas from there, interleaved (trainer1's of
    # round 1 reaches that checkpoint exactly; each later one follows the one loaded before it,
    # of either trainer): the end's rows
    got = on(world, "trainer2", r.restore, job("mixed"), chains["mid"], [b[2], a[3], b[3], a[4], b[4]])
    same(got["model"], chains["end"]["model"], "model")


# ---- another optimizer's state (item 7) -------------------------------------------------------------


@pytest.mark.parametrize("how", ["optimizer_state_dict", "geo", "delta"])
def test_another_optimizers_state_is_refused_before_anything_changes(world, how):
    got = on(world, "trainer0", r.foreign_optimizer_state, job(f"foreign-{how}"), how)
    error = got["error"] or ""
    assert error.startswith("ValueError"), error
    assert "'sum'" in error and "SparseAdam" in error and "'exp_avg'" in error, error
    same(got["after"], got["before"], "unchanged")


def test_a_collection_refuses_another_optimizers_state_for_one_table_and_loads_none(world):
    got = on(world, "trainer0", r.foreign_state_in_a_collection, job("foreign-collection"))
    error = got["error"] or ""
    assert error.startswith("ValueError") and "'sum'" in error and "SparseAdam" in error, error
    same(got["after"], got["before"], "unchanged")


def test_a_psmodel_refuses_another_optimizers_state_for_its_table_and_loads_none(world):
    got = on(world, "trainer0", r.foreign_state_in_a_psmodel, job("foreign-psmodel"))
    error = got["error"] or ""
    assert error.startswith("ValueError") and "'sum'" in error and "SparseAdam" in error, error
    same(got["after"], got["before"], "unchanged")


def test_the_state_of_a_table_never_stepped_loads_into_a_geo_table(world):
    # (it has no state key, as no row has state: the geo table's optimizer needs none either)
    got = on(world, "trainer0", r.unstepped_state_into_geo, job("unstepped-geo"))
    assert "sum" not in got["given"]
    assert got["error"] is None, got["error"]
    assert got["after"]["ids"].numel() == 0 and got["after"]["sum"].shape == (0, r.DIM)


def test_a_geo_load_drops_the_deltas_of_rows_the_checkpoint_does_not_hold(world):
    # a lazy checkpoint holds every row the table keeps: rows trained since and not pushed yet
    # go back to their first values, as those pushed already do; their pending deltas with them
    got = on(world, "trainer0", r.geo_load_with_rows_unpushed, job("geo-unpushed"))
    assert torch.equal(got["after"]["weight.ids"], got["saved"]["weight.ids"]), got["after"]["weight.ids"]
    assert torch.equal(got["after"]["weight.rows"], got["saved"]["weight.rows"])
