"""A PSModel behaves as the local torch model it wraps (issue 20), in every mode: a checkpoint
restored into a fresh job continues exactly as uninterrupted training (geo included: its
optimizer state lives on the trainer), a step without a gradient is no optimizer step for that
parameter, two forwards before one backward each keep the values they used while the servers
move, and non-contiguous parameters (``channels_last``, ``.t()``) train and keep their strides.

The session's parameter-server world (tests/conftest.py ``ps_world``); trainers run
tests/ps/_dense_parity_remote.py and tests/ps/_dense_remote.py; the plain-torch references are computed
here on the same models and batches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.ps import _dense_parity_remote as p
from tests.ps import _dense_remote as r
from tests.ps._world import PSWorld, job

SERVERS = ["ps0", "ps1"]
MIN_BLOCK = 4  # every weight cut into one block per server
#: fp32 sums in another order (servers average, re-sliced blocks): agreement to ~1e-7 measured
ATOL = 1e-6
MODES = ["sync", "async", "half_async", "geo"]
OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}),
}
#: deterministic merges and pushes: half_async merges by count only (its timer never fires
#: while a test runs, however slow the machine), geo pushes every 3 steps
MODE_KW = {"half_async": {"half_async_merge_every": 2, "half_async_merge_s": 3600.0}, "geo": {"geo_push_every": 3}}


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def assert_close(got: dict, expected: dict, what: str, atol: float = ATOL) -> None:
    assert list(got) == list(expected), f"{what}: keys {list(got)}, expected {list(expected)}"
    for k in expected:
        if expected[k] is None or got[k] is None:
            assert got[k] is None and expected[k] is None, f"{what}: {k} is {got[k]}, expected {expected[k]}"
            continue
        assert got[k].shape == expected[k].shape, f"{what}: {k} has shape {got[k].shape}, expected {expected[k].shape}"
        err = (got[k].double() - expected[k].double()).abs().max().item()
        assert err <= atol, f"{what}: {k} differs by {err:.3g} (atol {atol})"


# ---- checkpoints continue identically, every mode ----------------------------------------------------


def _train(world: PSWorld, name: str, mode: str, steps: int, start: int) -> None:
    """Both trainers train ``steps`` steps: together in sync mode (each step needs both), else
    trainer0 then trainer1 (the driver orders them, so every run applies the same updates)."""
    if mode == "sync":
        world.run({t: (r.train, name, i, steps, start) for i, t in enumerate(["trainer0", "trainer1"])})
    else:
        for i, t in enumerate(["trainer0", "trainer1"]):
            world.run({t: (r.train, name, i, steps, start)})


def _create(world: PSWorld, name: str, servers: list[str], mode: str, opt: str) -> None:
    kwargs = dict(num_trainers=2, ps_mode=mode, optimizer=OPTIMIZERS[opt], min_block_size=MIN_BLOCK,
                  **MODE_KW.get(mode, {}))
    world.run({t: (_create_here, name, servers, kwargs) for t in ["trainer0", "trainer1"]})


def _create_here(name: str, servers: list[str], kwargs: dict) -> list:  # on a trainer
    return r.create(name, "net", 7, servers, None, **kwargs)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", MODES)
def test_a_restored_checkpoint_continues_as_uninterrupted_training(world, mode, opt):
    """Train 5 steps on 2 servers, checkpoint (trainer0's state_dict, each trainer's optimizer
    state), train 4 more; a fresh job on 3 servers restored from the checkpoint trains the same
    4 steps: the same servers' values (and in geo mode the same local copies; the checkpoint
    falls between two pushes, after the other trainer's push, so the trainer-side state is all
    there is of the progress since)."""
    _restored_vs_uninterrupted(world, mode, opt)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_a_geo_checkpoint_loads_the_optimizer_state_before_or_after_the_model(world, opt):
    """torch's ``model.load_state_dict`` and ``optimizer.load_state_dict`` go in either order:
    a geo trainer that loads its optimizer state (and progress) first, then the model,
    continues as uninterrupted training too (it kept the servers' values as its local copy)."""
    _restored_vs_uninterrupted(world, "geo", opt, optimizer_first=True)


def _restored_vs_uninterrupted(world, mode: str, opt: str, optimizer_first: bool = False) -> None:
    k, n = 5, 4
    first, second = job(f"ckpt-{mode}-{opt}"), job(f"restored-{mode}-{opt}")
    _create(world, first, SERVERS, mode, opt)
    _train(world, first, mode, k, 0)
    sd = world.run({"trainer0": (r.state, first)})["trainer0"]
    osd = world.run({t: (r.optimizer_state, first) for t in ["trainer0", "trainer1"]})
    _train(world, first, mode, n, k)
    expected = world.run({"trainer1": (r.state, first)})["trainer1"]
    expected_local = world.run({t: (r.local, first) for t in ["trainer0", "trainer1"]})

    _create(world, second, ["ps0", "ps1", "ps2"], mode, opt)
    world.run({t: (r.load, second, sd, osd[t], optimizer_first) for t in ["trainer0", "trainer1"]})
    _train(world, second, mode, n, k)
    got = world.run({"trainer1": (r.state, second)})["trainer1"]
    assert_close(got, expected, f"{mode}, {opt}: restored on 3 servers vs uninterrupted on 2")
    assert not torch.allclose(got["fc1.weight"], sd["fc1.weight"], atol=1e-3), "did not train after the restore"
    if mode == "geo":
        got_local = world.run({t: (r.local, second) for t in ["trainer0", "trainer1"]})
        for t in got_local:
            assert_close(got_local[t], expected_local[t], f"geo, {opt}: {t}'s local copy, restored vs uninterrupted")


def test_a_geo_optimizer_state_is_the_trainers_own_in_torch_s_format(world):
    """geo: optimizer_state_dict() has this trainer's local optimizer state per parameter, as a
    local torch optimizer has it after the same steps (1 trainer, pushing every step: its local
    copy is the plain model)."""
    name = job("geo-osd")
    adam = OPTIMIZERS["adam"]
    world.run({"trainer0": (_create_here, name, SERVERS, dict(num_trainers=1, ps_mode="geo", geo_push_every=1,
                                                               optimizer=adam, min_block_size=MIN_BLOCK))})
    world.run({"trainer0": (r.train, name, 0, 3)})
    osd = world.run({"trainer0": (r.optimizer_state, name)})["trainer0"]
    model = r.build("net", 7)
    opt = adam[0](model.parameters(), **adam[1])
    for step in range(3):
        x, y = r.batch(0, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for pname, param in model.named_parameters():
        st = opt.state[param]
        assert set(osd["state"][pname]) == set(st), (pname, osd["state"][pname].keys(), st.keys())
        assert int(osd["state"][pname]["step"]) == 3, osd["state"][pname]["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close({key: osd["state"][pname][key]}, {key: st[key]}, f"{pname}'s {key}")
        assert sorted(osd["per_element"][pname]) == ["exp_avg", "exp_avg_sq"], osd["per_element"][pname]


# ---- a step without gradients is no optimizer step -----------------------------------------------------


def sometimes_reference(optimizer: tuple) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = p.build("sometimes", 3)
    opt = optimizer[0](model.parameters(), **optimizer[1])
    for step, kind in enumerate(p.SCHEDULE):
        opt.zero_grad(set_to_none=True)
        if kind != "none":
            model(p.sometimes_x(step), kind == "all").backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", MODES)
def test_a_step_without_gradients_is_no_optimizer_step(world, mode, opt):
    """One trainer follows a schedule where ``q`` (or every parameter) has no gradient on some
    steps: the servers' values and each parameter's step count are torch's, which skips a
    parameter whose gradient is None (no momentum, no weight decay, no Adam step). geo pushes
    every 2 optimizer steps: a step() without any gradient does not count towards a push."""
    name = job(f"nograd-{mode}-{opt}")
    kwargs = dict(num_trainers=1, ps_mode=mode, optimizer=OPTIMIZERS[opt], min_block_size=MIN_BLOCK,
                  **({"geo_push_every": 2} if mode == "geo" else {}),
                  **({"half_async_merge_every": 1} if mode == "half_async" else {}))
    world.run({"trainer0": (_create_sometimes, name, kwargs)})
    got = world.run({"trainer0": (p.sometimes_train, name)})["trainer0"]
    model, reference_opt = sometimes_reference(OPTIMIZERS[opt])
    expected = {k: v.detach() for k, v in model.named_parameters()}
    assert sum(kind != "none" for kind in p.SCHEDULE) % 2 == 0  # geo: the last optimizer step pushed
    assert_close(got["values"], expected, f"{mode}, {opt}: the servers' values after {p.SCHEDULE}")
    assert_close(got["local"], expected, f"{mode}, {opt}: the trainer's parameters after {p.SCHEDULE}")
    if opt == "adam":
        for pname, param in model.named_parameters():
            steps = int(got["optim"]["state"][pname]["step"])
            assert steps == int(reference_opt.state[param]["step"]), f"{pname}: {steps} Adam steps"


def _create_sometimes(name: str, kwargs: dict) -> list:  # on a trainer
    return p.create(name, "sometimes", 3, SERVERS, **kwargs)


# ---- two forwards before one backward ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["async", "half_async"])
def test_two_forwards_before_one_backward_keep_the_values_each_used(world, mode):
    """async: forward, another step lands on the servers, forward again, one backward of both:
    the gradients are torch's for the first output at the first values plus the second output
    at the second values (the second pull must not write into what the first graph saved)."""
    name = job(f"twice-{mode}")
    kwargs = dict(num_trainers=1, ps_mode=mode, optimizer=(torch.optim.SGD, {"lr": 0.5}), min_block_size=MIN_BLOCK,
                  **({"half_async_merge_every": 1} if mode == "half_async" else {}))
    world.run({"trainer0": (_create_net, name, 9, kwargs)})
    got = world.run({"trainer0": (p.two_forwards, name, 9, SERVERS, kwargs)})["trainer0"]
    assert not torch.allclose(got["first"]["fc2.weight"], got["second"]["fc2.weight"], atol=1e-3), \
        "the servers did not move between the forwards: weak test"
    one, two = r.build("net", 9), r.build("net", 9)
    one.load_state_dict(got["first"])
    two.load_state_dict(got["second"])
    x1, y1 = r.batch(0, 0)
    x2, _ = r.batch(0, 1)
    (nn.functional.mse_loss(one(x1), y1) + (two(x2) * 3.0).tanh().sum()).backward()
    expected = {k: a.grad + b.grad for (k, a), b in zip(one.named_parameters(), two.parameters())}
    assert_close(got["grads"], expected, f"{mode}: gradients of two forwards at the values each pulled")


def test_a_pull_under_a_graph_of_the_parameters_themselves_raises_torch_s_in_place_error(world):
    """A graph built on the local parameters (``ps.module(x)``), then a pull with new values:
    its backward raises torch's in-place modification error, as after an optimizer step in
    torch, instead of silently using the new values."""
    name = job("inplace")
    kwargs = dict(num_trainers=1, ps_mode="async", optimizer=(torch.optim.SGD, {"lr": 0.5}), min_block_size=MIN_BLOCK)
    world.run({"trainer0": (_create_net, name, 9, kwargs)})
    outcome = world.run({"trainer0": (p.direct_graph_then_pull, name, 9, SERVERS, kwargs)})["trainer0"]
    assert not outcome["ok"] and outcome["type"] == "RuntimeError", outcome
    assert "modified by an inplace operation" in outcome["message"], outcome["message"]


def test_threads_calling_one_psmodel_keep_its_parameters_and_every_gradient(world):
    """Two threads in one async PSModel's forward at once (tests/ps/_dense_parity_remote.Meeting makes
    them meet): the module still holds its own Parameter objects afterwards (no thread's
    per-forward tensor left installed) and the gradient is both backwards'."""
    got = world.run({"trainer0": (p.threads_forward, job("threads-forward"), SERVERS)})["trainer0"]
    assert got["same"] and got["types"] == ["Parameter"], got
    assert torch.equal(got["grad"], torch.full((16,), 2.0)), got["grad"]


def _create_net(name: str, seed: int, kwargs: dict) -> list:  # on a trainer
    return r.create(name, "net", seed, SERVERS, None, **kwargs)


# ---- non-contiguous parameters ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "geo"])
def test_non_contiguous_parameters_train_as_torch_and_keep_their_strides(world, mode):
    """A ``channels_last`` conv weight and a ``.t()`` weight: the PSModel is built, each step's
    gradients and the trained values are torch's, and the parameters keep torch's strides."""
    steps = 3
    name = job(f"strided-{mode}")
    sgd = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.5})
    kwargs = dict(num_trainers=1, ps_mode=mode, optimizer=sgd, min_block_size=MIN_BLOCK,
                  **({"geo_push_every": 1} if mode == "geo" else {}))
    layout = world.run({"trainer0": (_create_strided, name, kwargs)})["trainer0"]
    assert {s for b, s in layout if b.startswith("w.")} == set(SERVERS), layout  # cut across both servers
    got = world.run({"trainer0": (p.strided_train, name, steps)})["trainer0"]
    model = p.build("strided", 4)
    opt = sgd[0](model.parameters(), **sgd[1])
    for step in range(steps):
        x, y = p.strided_batch(step)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        assert_close(got["grads"][step], {k: v.grad for k, v in model.named_parameters()},
                     f"{mode}: step {step}'s gradients")
        opt.step()
        assert_close(got["values"][step], model.state_dict(), f"{mode}: the servers' values after step {step}")
    assert_close(got["local"], dict(model.named_parameters()), f"{mode}: the trainer's parameters")
    strides = {k: v.stride() for k, v in model.named_parameters()}
    assert got["strides"] == strides, f"strides {got['strides']}, torch's {strides}"
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last) and not model.w.is_contiguous()


def _create_strided(name: str, kwargs: dict) -> list:  # on a trainer
    return p.create(name, "strided", 4, SERVERS, **kwargs)
