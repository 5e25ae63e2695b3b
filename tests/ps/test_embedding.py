"""Sharded embedding tables on parameter servers: equality with local modules (lookups, bags,
sparse steps with torch's sparse optimizers, inside a PSModel, beside DDP, in every mode),
sparsity, lazy memory, checkpoints re-sliced onto more servers, sync stalls named in time."""

from __future__ import annotations

import pytest
import torch

from tests.ps import _embedding_remote as r
from tests.ps._stalls import assert_stalled
from tests.ps._world import job as name

pytestmark = pytest.mark.slow


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def local_reference(mode, padding_idx, optimizer, steps, data_seeds=(1,)):
    bag = r.local_bag(0, mode, padding_idx)
    sparse = mode != "max"  # torch cannot make a max bag sparse: its dense step is the reference
    local = torch.nn.EmbeddingBag(200, 4, mode=mode, padding_idx=padding_idx, sparse=sparse)
    local.load_state_dict(bag.state_dict())
    cls, kwargs = optimizer
    opt = cls(local.parameters(), **kwargs)
    outs = []
    data = [r.batches(s, steps, mode == "sum", padding_idx) for s in data_seeds]
    for step in range(steps):
        opt.zero_grad()
        loss = 0
        for batch in data:
            ids, offsets, psw, target = batch[step]
            out = local(ids, offsets, psw)
            outs.append(out.detach())
            loss = loss + ((out - target) ** 2).sum()
        (loss / len(data)).backward()
        opt.step()
    return outs, local.weight.detach()


@pytest.mark.parametrize("mode,padding_idx,optimizer", [
    ("sum", None, (torch.optim.SGD, {"lr": 0.1})),
    ("sum", 3, (torch.optim.Adagrad, {"lr": 0.2})),
    ("mean", None, (torch.optim.SparseAdam, {"lr": 0.05})),
    ("mean", 7, (torch.optim.SGD, {"lr": 0.1})),
    ("max", None, (torch.optim.SGD, {"lr": 0.1})),
    ("max", 5, (torch.optim.Adagrad, {"lr": 0.2})),
])
def test_bags_and_sparse_steps_equal_the_local_module(world, mode, padding_idx, optimizer):
    got = world.run({"trainer0": (r.bag_run, name("bag"), mode, padding_idx, optimizer, 4)})["trainer0"]
    outs, weight = local_reference(mode, padding_idx, optimizer, 4)
    # pooled on the servers: equal up to float32 rounding of the changed summation order
    torch.testing.assert_close(got["outs"][0], outs[0], atol=1e-6, rtol=0)
    for a, b in zip(got["outs"], outs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got["weight"], weight, atol=1e-6, rtol=1e-5)
    assert not torch.equal(weight, r.local_bag(0, mode, padding_idx).weight.detach())  # it trained


def test_every_input_form_equals_the_local_modules_and_refusals_are_torchs(world):
    got = world.run({"trainer0": (r.forms_run, name("forms"))})["trainer0"]
    ref = r.forms_run("local", local=True)
    assert torch.equal(got["emb"], ref["emb"])  # an Embedding lookup: bit for bit
    for key in [k for k in ref if k.endswith(("-2d", "-offsets"))] + ["psw-grad"]:
        torch.testing.assert_close(got[key], ref[key], atol=1e-6, rtol=0, msg=key)
    assert all(ref["errors"].values())
    assert got["errors"] == ref["errors"]


def test_sync_two_trainers_equal_one_process_on_the_global_batch(world):
    n = name("sync")
    opt = (torch.optim.SGD, {"lr": 0.1})
    got = world.run({f"trainer{i}": (r.bag_run, n, "sum", None, opt, 3, "sync", 2, 1 + i) for i in range(2)})
    _, weight = local_reference("sum", None, opt, 3, data_seeds=(1, 2))
    for t in ("trainer0", "trainer1"):
        torch.testing.assert_close(got[t]["weight"], weight, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("ps_mode,trainers", [("sync", 2), ("async", 1)])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_a_table_one_server_holds_pools_there_and_an_eval_lookup_sees_each_step(world, ps_mode, trainers, mode):
    """A table held whole by ps0: a lookup under no_grad travels as given and ps0 pools it as
    nn.EmbeddingBag does (sync: once the step every trainer pushed is applied), equal to the
    local module after each step; training through it equals the local module too."""
    n, opt, padding = name(f"whole-{ps_mode}-{mode}"), (torch.optim.SGD, {"lr": 0.1}), 3 if mode == "mean" else None
    got = world.run({f"trainer{i}": (r.bag_run, n, mode, padding, opt, 3, ps_mode, trainers, 1 + i, ("ps0",))
                     for i in range(trainers)})
    seeds = tuple(range(1, trainers + 1))
    local = r.local_bag(0, mode, padding)
    local = torch.nn.EmbeddingBag(200, 4, mode=mode, padding_idx=padding, _weight=local.weight.detach().clone())
    sgd = torch.optim.SGD(local.parameters(), lr=0.1)
    data = [r.batches(s, 3, mode == "sum", padding) for s in seeds]
    for step in range(3):
        sgd.zero_grad()
        loss = sum(((local(*batch[step][:3]) - batch[step][3]) ** 2).sum() for batch in data)
        (loss / trainers).backward()
        sgd.step()
        with torch.no_grad():
            for i, batch in enumerate(data):
                evaluated = got[f"trainer{i}"]["evals"][step]
                torch.testing.assert_close(evaluated, local(*batch[step][:3]), atol=1e-6, rtol=1e-5)
    for i in range(trainers):
        torch.testing.assert_close(got[f"trainer{i}"]["weight"], local.weight.detach(), atol=1e-6, rtol=1e-5)


def test_bytes_pushed_per_step_are_under_one_percent_of_the_table(world):
    got = world.run({"trainer0": (r.sparsity, name("sparse"))})["trainer0"]
    for sent in got["per_step"]:
        assert 0 < sent < 0.01 * got["table_bytes"], got


def test_a_lazy_hundred_million_row_table_stays_small_on_the_servers(world):
    before = {s: world.run({s: (r.rss_bytes,)})[s] for s in ("ps0", "ps1")}
    world.run({"trainer0": (r.lazy_train, name("lazy"), 100)})
    after = {s: world.run({s: (r.rss_bytes,)})[s] for s in ("ps0", "ps1")}
    for s in after:
        assert after[s] < 1 << 30, (s, after[s])
        assert after[s] - before[s] < 200 << 20, (s, before[s], after[s])  # 51,200 rows touched, not 1e8


def test_a_checkpoint_from_two_servers_continues_identically_on_three(world):
    first = world.run({"trainer0": (r.reslice_run, name("two"), ["ps0", "ps1"], 3, 0)})["trainer0"]
    assert first["servers"] == ["ps0", "ps1"] and first["optim"]["step"] == 3
    on_two = world.run({"trainer0": (r.reslice_run, name("two-more"), ["ps0", "ps1"], 3, 3, first)})["trainer0"]
    on_three = world.run({"trainer1": (r.reslice_run, name("three"), ["ps0", "ps1", "ps2"], 3, 3, first)})["trainer1"]
    assert on_three["servers"] == ["ps0", "ps1", "ps2"]
    torch.testing.assert_close(on_three["weight"], on_two["weight"], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(on_two["weight"], first["weight"])  # it trained after the checkpoint


def test_half_async_tables_apply_the_sum_every_merge_every_pushes_and_lookups_do_not_force_it(world):
    got = world.run({"trainer0": (r.half_async_run, name("half"))})["trainer0"]
    start, seen = got["start"], got["seen"]
    assert torch.equal(seen[0], start) and torch.equal(seen[1], start)  # queued, not applied
    torch.testing.assert_close(seen[2], start - (1 + 2 + 3))  # the sum of the three, lr 1


def test_geo_tables_push_local_deltas_every_k_steps(world):
    got = world.run({"trainer0": (r.geo_run, name("geo"), 2, 4)})["trainer0"]
    w0 = torch.tensor([[6.0, 7.0], [80.0, 81.0]])
    # one trainer: row 3 gets gradient 2 per step (twice in the input), row 40 gets 1; lr 0.5
    per_step = torch.tensor([[1.0, 1.0], [0.5, 0.5]])
    expected = [w0, w0 - 2 * per_step, w0 - 2 * per_step, w0 - 4 * per_step]
    for step, (a, b) in enumerate(zip(got["server"], expected)):
        torch.testing.assert_close(a, b, msg=f"server rows after step {step + 1}")


def local_clicks():
    bag = torch.nn.EmbeddingBag(200, 4, mode="sum", sparse=True)
    bag.load_state_dict(r.local_bag(0, "sum").state_dict())
    return r.Clicks(bag)


@pytest.mark.parametrize("mode", ["sync", "async", "half_async", "geo"])
def test_a_psmodel_trains_its_tables_and_dense_parameters_like_the_local_model(world, mode):
    got = world.run({"trainer0": (r.psmodel_run, name(f"psm-{mode}"), mode, 4)})["trainer0"]
    local = local_clicks()
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    for (ids, offsets, target), out in zip(r.click_batches(3, 4), got["outs"]):
        ref = local(ids, offsets)
        torch.testing.assert_close(out, ref.detach(), atol=1e-6, rtol=0)
        opt.zero_grad()
        ((ref - target) ** 2).mean().backward()
        opt.step()
    assert set(got["state"]) == set(local.state_dict())  # the local model's own keys
    for key, value in local.state_dict().items():
        torch.testing.assert_close(got["state"][key], value, atol=1e-6, rtol=0)
    assert set(got["optim"]["tables"]) == {"bag"}


@pytest.mark.parametrize("mode", ["sync", "async", "half_async", "geo"])
def test_tables_train_beside_a_ddp_dense_part(world, mode, tmp_path):
    n = name(f"ddp-{mode}")
    store = str(tmp_path / "store")
    got = world.run({f"trainer{i}": (r.ddp_run, n, mode, i, store, 3) for i in range(2)})
    # the reference: DDP averages the Linear's gradients; each trainer's rows (its own parity)
    # get its gradient as the mode applies it: averaged over the 2 trainers in sync and geo
    # (deltas / num_trainers), as pushed in async and half_async
    local = local_clicks()
    opt = torch.optim.SGD(local.dense.parameters(), lr=0.1)
    row_opt = torch.optim.SGD(local.bag.parameters(), lr=0.1 * (0.5 if mode in ("sync", "geo") else 1.0))
    data = [r.click_batches(10 + i, 3, parity=i) for i in range(2)]
    for step in range(3):
        opt.zero_grad()
        row_opt.zero_grad()
        loss = sum(((local(ids, offsets) - target) ** 2).mean() for ids, offsets, target in (d[step] for d in data))
        # the Linear's gradient is the trainers' mean; each row's is its own trainer's in full
        loss.backward()
        for p in local.dense.parameters():
            p.grad /= 2
        opt.step()
        row_opt.step()
    for i in range(2):
        torch.testing.assert_close(got[f"trainer{i}"]["rows"], local.bag.weight.detach(), atol=1e-6, rtol=0)
        for key, value in local.dense.state_dict().items():
            torch.testing.assert_close(got[f"trainer{i}"]["dense"][key], value, atol=1e-6, rtol=0)


def test_a_sync_lookup_whose_step_never_completes_fails_in_time_naming_the_missing_trainer(world):
    """The other trainer never attaches (the fault holds for good): the lookup of step 1 fails
    by a timeout, the servers' wait for step 0 reaching its deadline naming what it waits for
    (tests/ps/_stalls.py); its time is bounded only by a hang guard."""
    table = name("stall")
    got = world.run({"trainer0": (r.sync_stall, table, 1.5)})["trainer0"]
    assert_stalled(world, got, table, "a lookup of step 1, the other trainer never attached", 1.5, (), never=1)


@pytest.mark.parametrize("steps", [2, 3])
def test_a_geo_table_dropped_with_its_push_in_flight_is_not_warned_of_as_never_pushed(world, steps):
    """A geo table dropped right after a step that pushed its deltas (in flight: they land at
    the next call, which never comes) pushed them: no "never pushed" warning (there was one for
    every object a notebook built again), and the servers hold them. A step after the last push
    (3 steps, geo_push_every=2) is still warned of, and is not on the servers."""
    got = world.run({"trainer0": (r.geo_dropped_after_a_step, name(f"geo-dropped-{steps}"), steps)})["trainer0"]
    never = [m for m in got["warned"] if "never pushed" in m]
    w0 = torch.tensor([[6.0, 7.0], [80.0, 81.0]])
    torch.testing.assert_close(got["rows"], w0 - 2 * 0.5)  # (the 2 steps pushed: gradient 1, lr 0.5)
    if steps == 2:
        assert never == [], never
    else:
        assert len(never) == 1 and "2 trained row(s)" in never[0], never


@pytest.mark.parametrize("mode", ["async", "geo"])
def test_a_table_that_ran_a_backward_is_freed_once_dropped(world, mode):
    """Its grad marker's hook held the table itself, and torch's collector does not see a
    tensor's hooks: every table that ever ran a backward stayed alive (with its cached rows and
    recorded gradients), and a geo table's end was never reported until the process ended."""
    assert world.run({"trainer0": (r.collected_after_a_backward, name(f"freed-{mode}"), mode)})["trainer0"]
