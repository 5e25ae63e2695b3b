"""Parameter servers over RPC (issue 11): sync training equals one process on the global batch,
async loses no update, geo and half-async follow their rules exactly, checkpoints re-slice onto
another number of servers, and layout / mode mismatches fail at start naming the value.

One world for the whole module (tests/ps/_world.py): a driver, ps0..ps2, trainer0..trainer2;
each job uses a subset and a name of its own. Trainers run tests/ps/_dense_remote.py; the local
references are computed here, on the same models and batches."""

from __future__ import annotations

import time
import zlib

import pytest
import torch
from torch import nn

from remote_module.ps import HashName
from tests._deadlines import HANG_S
from tests.ps import _dense_remote as r
from tests.ps._stalls import assert_stalled
from tests.ps._world import PSWorld, job

SERVERS = ["ps0", "ps1"]
STEPS = 20
#: small enough that every weight is cut into one block per server
MIN_BLOCK = 4
ADAM_ATOL = 1e-6  # as SGD: the two orders of summation differ by ~6e-8 after 20 Adam steps (measured)


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def trainers(n: int) -> list[str]:
    return [f"trainer{i}" for i in range(n)]


def train_all(world: PSWorld, name: str, n: int, steps: int, start: int = 0) -> None:
    world.run({t: (r.train, name, i, steps, start) for i, t in enumerate(trainers(n))})


def assert_close(got: dict, expected: dict, atol: float, what: str) -> None:
    assert list(got) == list(expected), f"{what}: keys {list(got)}, expected {list(expected)}"
    for k in expected:
        err = (got[k] - expected[k]).abs().max().item()
        assert err <= atol, f"{what}: {k} differs from the reference by {err:.3g} (atol {atol})"


def reference(n: int, optimizer: tuple, steps: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One process, the concatenated batch of ``n`` trainers per step."""
    model = r.build("net", seed)
    opt = optimizer[0](model.parameters(), **optimizer[1])
    for step in range(steps):
        xs, ys = zip(*(r.batch(t, step) for t in range(n)))
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return model, opt


OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1}), "adam": (torch.optim.Adam, {"lr": 0.01})}


# ---- sync ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_sync_training_equals_one_process_on_the_global_batch(world, n, opt):
    name = job(f"sync-{opt}-{n}")
    layouts = world.call(r.create_on, trainers(n), name, ("net", 1, SERVERS),
                         dict(num_trainers=n, optimizer=OPTIMIZERS[opt], min_block_size=MIN_BLOCK))
    layout = layouts["trainer0"]
    assert all(lay == layout for lay in layouts.values()), layouts
    for pname in ("fc1.weight", "fc2.weight"):  # really split over both servers
        assert {s for b, s in layout if b.startswith(pname + ".")} == set(SERVERS), layout
    train_all(world, name, n, STEPS)
    states = world.run({t: (r.state, name) for t in trainers(n)})
    expected, _ = reference(n, OPTIMIZERS[opt], STEPS, seed=1)
    initial = r.build("net", 1).state_dict()
    atol = 1e-6 if opt == "sgd" else ADAM_ATOL
    for t, got in states.items():
        assert_close(got, expected.state_dict(), atol, f"{t}'s state_dict after {STEPS} {opt} steps")
    assert all((states["trainer0"][k] - initial[k]).abs().max() > 1e-3 for k in initial), "did not train"


def test_a_sync_step_is_one_round_trip_answered_once_the_step_is_applied(world):
    """sync: each push is answered once its step is applied on the server, with the values a
    pull for the next step would get, and the next forward runs on those: the first forward
    pulls, then one message per server per step (a pull as well before), and the result is
    still one process's on the global batch."""
    name = job("sync-one-trip")
    world.call(r.create_on, trainers(2), name, ("net", 1, SERVERS),
               dict(num_trainers=2, optimizer=OPTIMIZERS["sgd"], min_block_size=MIN_BLOCK))
    counted = world.run({t: (r.train_counted, name, i, STEPS) for i, t in enumerate(trainers(2))})
    for t, messages in counted.items():
        assert messages == {"ps0": STEPS + 1, "ps1": STEPS + 1}, (t, messages)
    expected, _ = reference(2, OPTIMIZERS["sgd"], STEPS, seed=1)
    for t in trainers(2):
        got = world.run({t: (r.state, name)})[t]
        assert_close(got, expected.state_dict(), 1e-6, f"{t}'s state_dict after {STEPS} one-trip sync steps")


def test_a_sync_step_the_servers_optimizer_refuses_fails_every_trainer_and_can_be_pushed_again(world):
    """sync: trainer0 pushes NaN gradients, which the servers' optimizer refuses when the step
    is complete: both trainers get that error at once (not a timeout, not a stalled job), the
    step's pushes are dropped, and pushing step 0 again with true gradients trains on as one
    process on the global batch. (The job's timeout is a hang guard: a stalled job would fail
    by it, with a CallTimeout.)"""
    name = job("sync-refused")
    world.call(r.create_on, trainers(2), name, ("net", 1, SERVERS),
               dict(num_trainers=2, optimizer=(r.RefusingSGD, {"lr": 0.1}), min_block_size=MIN_BLOCK, timeout=HANG_S))
    got = world.run({"trainer0": (r.refused_then_retried, name, 0, True),
                     "trainer1": (r.refused_then_retried, name, 1, False)})
    for t, out in got.items():
        first = out["first"]
        assert not first["ok"] and first["type"] == "ValueError", (t, first)  # the refusal's, not a CallTimeout
        assert "applying step 0 failed" in first["message"] and "RefusingSGD" in first["message"], (t, first)
    expected, _ = reference(2, (torch.optim.SGD, {"lr": 0.1}), 1, seed=1)
    for t, out in got.items():
        assert_close(out["state"], expected.state_dict(), 1e-6, f"{t}: step 0 pushed again after the refusal")


def test_a_psmodel_inside_a_users_module_round_trips_the_holders_checkpoint(world):
    """The holder's state_dict() has the PSModel's part under its own keys (the local model's,
    no ``module.``); the holder's load_state_dict(strict=True) takes them and sends them to the
    servers of the PSModel it holds, as PSModel.load_state_dict() does."""
    got = world.run({"trainer0": (r.wrapped_checkpoint, job("wrapped"))})["trainer0"]
    assert not any(".module." in k for k in got["keys"]) and "ps.fc1.weight" in got["keys"], got["keys"]
    assert got["missing"] == [] and got["unexpected"] == [], got
    assert_close(got["loaded"], got["saved"], 0.0, "the second job's servers after the holder's load")
    assert got["head"]


def test_a_sync_checkpoint_right_after_a_step_waits_for_that_step(world):
    """trainer0 pushes step 0 and asks for the state at once; trainer1 pushes 0.5 s later: the
    state has step 0 applied on every server (not the values before it, nor a mix)."""
    name = job("sync-ckpt")
    sgd = OPTIMIZERS["sgd"]
    world.call(r.create_on, trainers(2), name, ("net", 1, SERVERS),
               dict(num_trainers=2, optimizer=sgd, min_block_size=MIN_BLOCK))
    got = world.run({"trainer0": (r.train_then_state, name, 0, 1), "trainer1": (r.later, 0.5, r.train, name, 1, 1)})
    expected, _ = reference(2, sgd, 1, seed=1)
    assert_close(got["trainer0"], expected.state_dict(), 1e-6, "trainer0's state_dict right after its step")


# ---- async -----------------------------------------------------------------------------------------


def test_async_loses_no_update(world):
    n, k = 3, 10
    name = job("async")
    world.call(r.create_on, trainers(n), name, ("linear", 0, SERVERS),
               dict(num_trainers=n, ps_mode="async", optimizer=(torch.optim.SGD, {"lr": 1.0}),
                    min_block_size=MIN_BLOCK))
    world.run({t: (r.push_linear, name, k) for t in trainers(n)})  # concurrently, gradient 1 each
    got = world.run({"trainer0": (r.state, name)})["trainer0"]["p"]
    assert torch.equal(got, torch.full((16,), -float(n * k))), f"expected every element at {-n * k}, got {got}"
    stats = world.run({"trainer1": (r.stats, name)})["trainer1"]
    assert {s: st["applied"] for s, st in stats.items()} == {s: n * k for s in SERVERS}, stats


@pytest.mark.parametrize("mode", ["async", "half_async"])
def test_an_async_step_is_one_round_trip_whose_answer_brings_the_next_forwards_values(world, mode):
    """async / half_async: each push is answered with its server's blocks as a pull right after
    it sees them, and the next forward runs on those, without pulling. So it misses another
    trainer's push made in between (an async read, as documented); a checkpoint (state_dict())
    makes the next forward pull again."""
    name = job(f"one-trip-{mode}")
    kwargs = dict(num_trainers=2, ps_mode=mode, min_block_size=MIN_BLOCK, half_async_merge_every=1)
    world.call(r.create_on, trainers(2), name, ("net", 1, SERVERS), kwargs)
    world.run({"trainer0": (r.step_and_capture, name, 0)})
    world.run({"trainer1": (r.step_and_capture, name, 1)})  # after trainer0's push, before its next forward
    seen = world.run({"trainer0": (r.forward_seen, name, 0)})["trainer0"]
    assert seen["messages"] == {} and seen["right_after_push"] and not seen["servers_now"], seen
    world.run({"trainer0": (r.step_and_capture, name, 0, 1)})
    world.run({"trainer1": (r.step_and_capture, name, 1, 1)})
    seen = world.run({"trainer0": (r.forward_seen, name, 0, True)})["trainer0"]
    assert seen["messages"] == {"ps0": 1, "ps1": 1} and seen["servers_now"], seen


def test_a_half_async_forward_after_the_merge_timer_pulls_what_it_merged(world):
    """half_async: a push still queued when answered is merged by the server's timer
    (half_async_merge_s) later; a forward after that pulls (it would otherwise miss this
    trainer's own push), one before it runs on the answer without pulling."""
    short, long = job("merge-timer-short"), job("merge-timer-long")
    for name, seconds in ((short, 0.05), (long, 3600.0)):  # (long: never fires while a test runs)
        kwargs = dict(num_trainers=1, ps_mode="half_async", min_block_size=MIN_BLOCK,
                      half_async_merge_every=1000, half_async_merge_s=seconds)
        world.call(r.create_on, trainers(1), name, ("net", 1, SERVERS), kwargs)
        world.run({"trainer0": (r.step_and_capture, name, 0)})
    deadline = time.monotonic() + HANG_S  # until the short job's timers merged the queued pushes
    while any(st["queued"] or not st["applied"] for st in world.run({"trainer0": (r.stats, short)})["trainer0"]
              .values()):
        assert time.monotonic() < deadline, f"hang guard: the 0.05 s merge timers did not merge in {HANG_S} s"
        time.sleep(0.02)
    seen = world.run({"trainer0": (r.forward_seen, short, 0)})["trainer0"]
    assert seen["messages"] == {"ps0": 1, "ps1": 1} and seen["servers_now"], seen
    assert not seen["right_after_push"], seen  # the merge changed the values
    seen = world.run({"trainer0": (r.forward_seen, long, 0)})["trainer0"]
    assert seen["messages"] == {} and seen["right_after_push"] and seen["servers_now"], seen


# ---- geo ---------------------------------------------------------------------------------------------


def geo_reference(seed: int, k: int, rounds: int, lr: float) -> tuple[dict, list[dict]]:
    """The rule by hand: trainer0 then trainer1 each train ``k`` local steps from what they
    last took, push ``local - last_pulled``; the server adds it / 2; the pusher takes the result."""
    server = {n: p.detach().clone() for n, p in r.build("net", seed).named_parameters()}
    took = [dict(server), dict(server)]
    for rnd in range(rounds):
        for t in (0, 1):
            model = r.build("net", seed)
            model.load_state_dict(took[t])
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            for step in range(rnd * k, rnd * k + k):
                x, y = r.batch(t, step)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            server = {n: server[n] + (p.detach() - took[t][n]) / 2 for n, p in model.named_parameters()}
            took[t] = {n: v.clone() for n, v in server.items()}
    return server, took


def test_a_geo_edit_right_after_a_pushing_step_applies_to_the_merged_values(world):
    """geo, one trainer, a push every step: the local copy holds the merged values when step()
    returns, as torch's optimizer leaves its parameters, so a clamp right after step() (WGAN's
    clipping) applies to them and the servers follow local torch doing the same."""
    name = job("geo-clamp")
    lr, bound, steps = 0.5, 0.05, 4
    world.call(r.create_on, trainers(1), name, ("net", 3, SERVERS),
               dict(num_trainers=1, ps_mode="geo", geo_push_every=1, optimizer=(torch.optim.SGD, {"lr": lr}),
                    min_block_size=MIN_BLOCK))
    got = world.run({"trainer0": (r.train_clamped, name, 0, steps, bound)})["trainer0"]
    model = r.build("net", 3)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = r.batch(0, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        pushed = {k: v.clone() for k, v in model.state_dict().items()}  # what this step's push merges
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-bound, bound)
    assert_close(got, pushed, 1e-6, "geo with a clamp right after each step")


def test_geo_follows_the_rule_in_a_fixed_order(world):
    k, rounds, lr = 3, 2, 0.1
    name = job("geo")
    world.call(r.create_on, trainers(2), name, ("net", 2, SERVERS),
               dict(num_trainers=2, ps_mode="geo", geo_push_every=k, optimizer=(torch.optim.SGD, {"lr": lr}),
                    min_block_size=MIN_BLOCK))
    for rnd in range(rounds):
        for i, t in enumerate(trainers(2)):  # the driver orders the pushes: trainer0, then trainer1
            world.run({t: (r.train, name, i, k, rnd * k)})
        # a checkpoint between rounds must not disturb the trainers' local copies
        world.run({"trainer0": (r.state, name)})
    server, took = geo_reference(2, k, rounds, lr)
    assert_close(world.run({"trainer1": (r.state, name)})["trainer1"], server, 1e-6, "the servers' parameters")
    locals_ = world.run({t: (r.local, name) for t in trainers(2)})
    for i, t in enumerate(trainers(2)):
        assert_close(locals_[t], took[i], 1e-6, f"{t}'s local copy after its last push")
    assert not torch.allclose(took[0]["fc1.weight"], took[1]["fc1.weight"]), "the order did not matter: weak test"


# ---- half-async ---------------------------------------------------------------------------------------


def _create_linear(world, name, n, mode, **kw):
    world.call(r.create_on, trainers(n), name, ("linear", 0, SERVERS),
               dict(num_trainers=n, ps_mode=mode, optimizer=(torch.optim.SGD, {"lr": 1.0}),
                    min_block_size=MIN_BLOCK, **kw))


def grads(i: int) -> list[float]:
    return [float(i + 1) * (j + 1) for j in range(16)]


def test_half_async_merges_after_exactly_merge_every_pushes_and_pulls_do_not_force_it(world):
    name = job("half-count")
    # (merge_s: never reached while a test runs, however slow the machine)
    _create_linear(world, name, 2, "half_async", half_async_merge_every=3, half_async_merge_s=3600.0)
    zeros = torch.zeros(16)
    for i, t in enumerate(["trainer0", "trainer1"]):
        world.run({t: (r.push_linear, name, 1, grads(i))})
        assert torch.equal(world.run({"trainer0": (r.pulled, name)})["trainer0"]["p"], zeros), f"applied after {i + 1}"
        stats = world.run({"trainer1": (r.stats, name)})["trainer1"]
        assert [(st["queued"], st["applied"]) for st in stats.values()] == [(i + 1, 0)] * 2, stats
    world.run({"trainer0": (r.push_linear, name, 1, grads(2))})
    got = world.run({"trainer1": (r.pulled, name)})["trainer1"]["p"]
    assert torch.equal(got, -(torch.tensor(grads(0)) + torch.tensor(grads(1)) + torch.tensor(grads(2)))), got
    stats = world.run({"trainer1": (r.stats, name)})["trainer1"]
    assert [(st["queued"], st["applied"]) for st in stats.values()] == [(0, 1)] * 2, stats


def test_half_async_merges_merge_s_after_the_first_queued_push(world):
    name = job("half-time")
    merge_s = 1.0
    _create_linear(world, name, 2, "half_async", half_async_merge_every=100, half_async_merge_s=merge_s)
    report = world.run({"trainer0": (r.half_async_timed, name, grads(0), HANG_S)})["trainer0"]
    if report["checked_at"] < merge_s:  # (a trainer that stalled for merge_s may find it merged)
        assert torch.equal(report["before"], torch.zeros(16)), report  # the pull right after did not merge
        assert report["queued_before"] == [1, 1], report
    assert report["merged_after"] is not None, f"hang guard: not merged within {HANG_S} s: {report}"
    # not before merge_s (timed from before the push was made), and with no other push or pull
    # to force it (the poll's deadline is a hang guard, no bound on the timer)
    assert report["merged_after"] >= merge_s, report
    assert torch.equal(report["after"], -torch.tensor(grads(0))), report


def test_half_async_a_timer_that_fired_during_a_count_merge_does_not_merge_the_next_push_early(monkeypatch):
    """Server side only, no RPC: the merge_s timer fires while a push holds the job's lock and
    merges by count; the next push must wait for its own merge_s, not be merged by that timer.
    That push's own timer is held on a gate until the check is done (it may fire at any time
    on a slow machine), then let go: it merges the push."""
    import threading

    from remote_module.ps import _modes
    from remote_module.ps.dense import _server as _dense_server

    fired, own_timer = threading.Event(), threading.Event()
    timers: list[threading.Timer] = []
    merge_later = _modes.merge_later

    def gated(merges, timer):  # (on a timer's thread) the first timer at once, the others after the gate
        timers.append(timer)
        if len(timers) == 1:
            fired.set()
        else:
            assert own_timer.wait(HANG_S), "hang guard: the test never opened the gate"
        merge_later(merges, timer)

    monkeypatch.setattr(_modes, "merge_later", gated)
    name = job("timer-race")
    spec = _dense_server.JobSpec("half_async", 1, (torch.optim.SGD, {"lr": 1.0}), 2, 0.2, "layout")
    _dense_server._attach(name, spec, "t", {"b": torch.zeros(2)})
    j = _dense_server._jobs.get(name)
    try:
        _dense_server._push(name, "t", 0, {"b": torch.ones(2)})  # queued; the 0.2 s timer armed
        old = j.merges.timer
        with j.lock:  # (reentrant) the pushes below run while the fired timer waits for the lock
            assert fired.wait(HANG_S), "hang guard: the merge_s timer did not fire"
            _dense_server._push(name, "t", 0, {"b": torch.ones(2)})  # second push: merged by count
            _dense_server._push(name, "t", 0, {"b": torch.full((2,), 10.0)})  # queued, its own timer armed
            new = j.merges.timer
        old.join(HANG_S)
        assert not old.is_alive(), "hang guard: the fired timer did not end"
        assert (j.applied, j.merges.count) == (1, 1), f"the third push was merged early: applied {j.applied}"
        own_timer.set()  # the third push's own timer may merge it now
        new.join(HANG_S)
        assert not new.is_alive(), "hang guard: the third push's timer did not end"
        assert j.applied == 2 and torch.equal(j.params["b"].detach(), torch.full((2,), -12.0)), j.params["b"]
    finally:
        own_timer.set()
        _dense_server._jobs.pop(name)


# ---- checkpoints --------------------------------------------------------------------------------------


def test_checkpoint_from_two_servers_continues_identically_on_three(world):
    adam = OPTIMIZERS["adam"]
    two, three = job("ckpt-2"), job("ckpt-3")
    world.call(r.create_on, trainers(2), two, ("net", 3, SERVERS),
               dict(num_trainers=2, optimizer=adam, min_block_size=MIN_BLOCK))
    train_all(world, two, 2, 5)
    sd = world.run({"trainer0": (r.state, two)})["trainer0"]
    osd = world.run({"trainer1": (r.optimizer_state, two)})["trainer1"]
    local = r.build("net", 3)
    local.load_state_dict(sd, strict=True)  # the local model's own keys
    reference_model, _ = reference(2, adam, 5, seed=3)
    assert_close(sd, reference_model.state_dict(), ADAM_ATOL, "state_dict after 5 steps")

    layouts = world.call(r.create_on, trainers(2), three, ("net", 4, ["ps0", "ps1", "ps2"]),
                         dict(num_trainers=2, optimizer=adam, min_block_size=MIN_BLOCK))
    assert {s for _, s in layouts["trainer0"]} == {"ps0", "ps1", "ps2"}, layouts
    world.run({"trainer0": (r.load, three, sd, osd)})
    train_all(world, two, 2, 5, start=5)
    train_all(world, three, 2, 5, start=5)
    on_two = world.run({"trainer0": (r.state, two)})["trainer0"]
    on_three = world.run({"trainer1": (r.state, three)})["trainer1"]
    assert_close(on_three, on_two, 1e-6, "3 servers from the checkpoint vs 2 servers continued")
    assert not torch.allclose(on_two["fc1.weight"], sd["fc1.weight"], atol=1e-4), "did not train after the checkpoint"
    # the optimizer state round-trips per parameter, in the parameter's shape
    osd3 = world.run({"trainer0": (r.optimizer_state, three)})["trainer0"]
    for pname, p in local.named_parameters():
        assert osd3["state"][pname]["exp_avg"].shape == p.shape, (pname, osd3["state"][pname]["exp_avg"].shape)
        assert int(osd3["state"][pname]["step"]) == 10, osd3["state"][pname]["step"]


# ---- layout and mode errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("theirs, words", [
    (dict(model_kwargs={"hidden": 4}), ["block layout"]),
    (dict(min_block_size=16), ["block layout"]),
    (dict(num_trainers=3), ["num_trainers", "2", "3"]),
    (dict(ps_mode="async"), ["mode", "'sync'", "'async'"]),
    (dict(optimizer=(torch.optim.SGD, {"lr": 0.5})), ["optimizer", "0.5"]),
])
def test_a_trainer_that_disagrees_with_the_job_fails_at_start_naming_the_mismatch(world, theirs, words):
    name = job("mismatch")
    mine = dict(num_trainers=2, min_block_size=MIN_BLOCK)
    world.call(r.create_on, ["trainer0"], name, ("net", 5, SERVERS), mine)
    outcome = world.call(_try_on, "trainer1", name, ("net", 5, SERVERS), {**mine, **theirs})
    assert not outcome["ok"] and outcome["type"] == "ValueError", outcome
    for word in words:
        assert word in outcome["message"], (word, outcome["message"])


@pytest.mark.parametrize("kwargs", [dict(mode="async"), dict(ps_mode="geo", mode="async")])
def test_the_mode_keyword_is_gone(kwargs):
    """``mode=`` (an old name of ``ps_mode``) is gone: Python refuses it as any unknown keyword,
    before anything runs, and the signature ``help()`` shows is the real one."""
    import inspect

    from remote_module.ps import PSModel

    with pytest.raises(TypeError, match=r"unexpected keyword argument 'mode'"):
        PSModel(torch.nn.Linear(2, 2), SERVERS, name=job("old-keyword"), num_trainers=1, **kwargs)
    params = inspect.signature(PSModel).parameters
    assert "ps_mode" in params and "mode" not in params and "num_trainers" in params


def test_a_module_forwarding_attribute_reads_to_a_table_is_not_a_second_table():
    """A wrapper whose ``__getattr__`` passes names on to a table (as ``torch.compile``'s does)
    has every member of the table protocol, yet it is no table: a PSModel finds the table once."""
    from remote_module.ps._steps import SteppedTable
    from remote_module.ps.dense._model import _tables_in

    class Table(torch.nn.Module, SteppedTable):
        def __init__(self):
            super().__init__()
            self.name, self.ps_mode, self.num_trainers = "t", "async", 1
            for member in SteppedTable.__annotations__:  # every data member the protocol names
                if not hasattr(self, member):
                    object.__setattr__(self, member, None)

    class Forwarding(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __getattr__(self, attr):
            try:
                return super().__getattr__(attr)
            except AttributeError:
                return getattr(self.inner, attr)

    model = torch.nn.Sequential(Forwarding(Table()))
    assert list(_tables_in(model, "async", 1)) == ["0.inner"]


def _try_on(trainer, name, args, kwargs):  # on the driver
    import torch.distributed.rpc as rpc

    return rpc.rpc_sync(trainer, r.try_create, (name, *args), kwargs)


def test_a_trainer_beyond_num_trainers_is_refused(world):
    name = job("extra")
    world.call(r.create_on, trainers(2), name, ("net", 5, SERVERS), dict(num_trainers=2, min_block_size=MIN_BLOCK))
    outcome = world.call(_try_on, "trainer2", name, ("net", 5, SERVERS), dict(num_trainers=2, min_block_size=MIN_BLOCK))
    assert not outcome["ok"] and outcome["type"] == "ValueError", outcome
    assert "num_trainers=2" in outcome["message"] and "'trainer2'" in outcome["message"], outcome["message"]


@pytest.mark.parametrize("kwargs, words", [
    (dict(ps_mode="bogus"), ["mode", "'bogus'"]),
    (dict(geo_push_every=0), ["geo_push_every", "0"]),
    (dict(half_async_merge_every=-1), ["half_async_merge_every", "-1"]),
    (dict(half_async_merge_s=0), ["half_async_merge_s", "0"]),
    (dict(num_trainers=0), ["num_trainers", "0"]),
])
def test_bad_modes_and_intervals_are_value_errors_naming_the_value(world, kwargs, words):
    outcome = world.call(_try_on, "trainer0", job("bad"), ("net", 5, SERVERS), {"num_trainers": 2, **kwargs})
    assert not outcome["ok"] and outcome["type"] == "ValueError", outcome
    for word in words:
        assert word in outcome["message"], (word, outcome["message"])


def test_a_sync_trainer_stepping_twice_for_one_step_waits_for_the_others(world):
    """The second step() waits for step 0 to be applied (its push in flight is answered then),
    so a trainer cannot push twice in one step: it times out naming the trainer missing, the
    push of step 0 counted and nothing applied."""
    name = job("twice")
    world.call(r.create_on, trainers(2), name, ("net", 5, SERVERS), dict(num_trainers=2, min_block_size=MIN_BLOCK))
    world.run({"trainer0": (r.set_timeout, name, 2.0)})
    outcome = world.run({"trainer0": (r.step_twice, name, 0)})["trainer0"]
    assert_stalled(world, outcome, name, "a second push in step 0", 2.0)  # (trainer1 never pushes)
    stats = world.run({"trainer1": (r.stats, name)})["trainer1"]
    assert [st["version"] for st in stats.values()] == [0, 0], stats  # nothing applied: trainer1 never pushed


def test_hash_name_dispatch_is_the_same_on_every_trainer_and_here(world):
    name = job("hash")
    servers = ["ps0", "ps1", "ps2"]
    layouts = world.call(r.create_on, trainers(2), name, ("net", 5, servers),
                         dict(num_trainers=2, min_block_size=MIN_BLOCK, split_method=HashName()))
    blocks = [b for b, _ in layouts["trainer0"]]
    here = HashName()(blocks, servers)
    assert here == [servers[zlib.crc32(b.encode()) % 3] for b in blocks]
    for t, layout in layouts.items():
        assert [s for _, s in layout] == here, (t, layout, here)
    assert len(set(here)) > 1, f"every block on one server: {here}"



def test_sync_a_waiting_pull_that_fails_fails_alone():
    """Server side only, no RPC: two pulls wait for step 1, one of a block this server does not
    hold. When the step completes that pull fails with its own error; the other is answered, and
    the push that completed the step succeeds (before, both were left waiting forever)."""
    import math

    from remote_module.ps.dense import _server as _dense_server

    name = job("failing-pull")
    spec = _dense_server.JobSpec("sync", 2, (torch.optim.SGD, {"lr": 1.0}), 2, 0.2, "layout")
    for t in ("t0", "t1"):
        _dense_server._attach(name, spec, t, {"b": torch.zeros(2)})
    try:
        bad = _dense_server._pull(name, ["nope"], 1, math.inf)
        good = _dense_server._pull(name, ["b"], 1, math.inf)
        _dense_server._push(name, "t0", 0, {"b": torch.ones(2)})
        _dense_server._push(name, "t1", 0, {"b": torch.ones(2)})  # completes step 0
        with pytest.raises(KeyError, match="nope"):
            bad.wait()
        assert torch.equal(good.wait()[0], torch.full((2,), -1.0))
        assert not _dense_server._jobs.get(name).sync.waiters
    finally:
        _dense_server._jobs.pop(name)


def test_sync_a_push_of_the_wrong_size_is_refused_before_it_counts():
    """Server side only, no RPC: a gradient with another number of values than its block fails
    for the trainer that pushed it, before it counts; before, it was kept and failed the push
    that completed the step, and the job's step never completed."""
    from remote_module.ps.dense import _server as _dense_server

    name = job("wrong-size")
    spec = _dense_server.JobSpec("sync", 2, (torch.optim.SGD, {"lr": 1.0}), 2, 0.2, "layout")
    for t in ("t0", "t1"):
        _dense_server._attach(name, spec, t, {"b": torch.zeros(2)})
    try:
        with pytest.raises(ValueError, match="pushed 3 gradient values for block 'b', which holds 2"):
            _dense_server._push(name, "t0", 0, {"b": torch.ones(3)})
        _dense_server._push(name, "t0", 0, {"b": torch.ones(2)})
        _dense_server._push(name, "t1", 0, {"b": torch.ones(2)})
        j = _dense_server._jobs.get(name)
        assert j.sync.done == 1 and torch.equal(j.params["b"].detach(), torch.full((2,), -1.0))
    finally:
        _dense_server._jobs.pop(name)
