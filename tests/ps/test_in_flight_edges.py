"""Steps in flight at the edges (found by a hostile review of sync and geo steps in flight): a copy of a model with a
step in flight, threads after a sync step, a stalled sync step retried with step(), and a geo
table's delta push that fails on one of its servers. Their own small world (ranks are frozen)."""

from __future__ import annotations

import time

import pytest
import torch

from tests._deadlines import HANG_S
from tests.ps import _dense_remote as r
from tests.ps import _in_flight_remote as rr
from tests.ps._stalls import assert_stalled
from tests.ps._world import PSWorld, job
from tests.ps.test_dense import OPTIMIZERS, assert_close, reference

SERVERS = ["ps0", "ps1"]
#: the timeout under test: set only for the calls expected to reach it (every other call's is a
#: hang guard: a loaded machine may be slow)
TIMEOUT = 2.0

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world():
    with PSWorld({"ps": 2, "trainer": 2}) as w:
        yield w


def _sync_job(world, what: str) -> str:
    name = job(what)
    world.call(r.create_on, ["trainer0", "trainer1"], name, ("net", 1, SERVERS),
               dict(num_trainers=2, optimizer=OPTIMIZERS["sgd"], min_block_size=4))
    return name


def test_a_sync_psmodel_with_a_step_in_flight_can_be_deep_copied_and_pickled(world):
    """As before the change (a sync step() returned with its push taken): copy.deepcopy and
    pickle of the model right after step() work, once the step landed."""
    name = _sync_job(world, "review-copy")
    got = world.run({"trainer0": (rr.step_then_copy, name, 0), "trainer1": (r.train, name, 1, 1)})["trainer0"]
    initial = r.build("net", 1).state_dict()  # (the local copy shows the values last pulled)
    for what in ("deepcopy", "pickle"):
        assert isinstance(got[what], dict), f"{what} of a sync PSModel right after step(): {got[what]}"
        assert_close(got[what], initial, 1e-6, f"the {what}'s local parameters after step 0")


def test_threads_calling_forward_after_a_sync_step_all_run_on_the_step_applied(world):
    """Two threads call forward right after step() while the other trainer is 1 s late: both
    must run on the values of step 0 applied (the one that did not land the flight used to
    pull at once for the step before and run on the values before it)."""
    name = _sync_job(world, "review-threads")
    outs = world.run({"trainer0": (rr.step_then_threads_forward, name, 0),
                      "trainer1": (r.later, 1.0, r.train, name, 1, 1)})["trainer0"]
    expected, _ = reference(2, OPTIMIZERS["sgd"], 1, seed=1)
    want = expected(torch.ones(1, r.IN)).detach()
    for k, out in enumerate(outs):
        torch.testing.assert_close(out, want, atol=1e-6, rtol=0, msg=f"thread {k}'s forward after step 0")


def test_a_sync_step_retried_after_it_stalled_pushes_nothing_and_training_equals_the_global_batch(world):
    """trainer0's step 0 stalls (trainer1 late): its next call raises the CallTimeout naming
    trainer1. step() again (the retry a failed push asks for; the docs: "step() again pushes
    nothing twice") must push nothing: not an empty step 1, which the servers refuse while step
    0 waits, or take as trainer0's step 1 once it is applied (trainer0 a step ahead for good)."""
    name = _sync_job(world, "review-stall-retry")
    world.run({"trainer0": (r.forward_backward, name, 0)})
    world.run({"trainer0": (r.set_timeout, name, TIMEOUT)})  # (the push in flight, waiting for its step)
    assert world.run({"trainer0": (r.attempt, name, "send")})["trainer0"]["ok"]
    stalled = world.run({"trainer0": (r.attempt, name, "pull")})["trainer0"]
    assert_stalled(world, stalled, name, "a pull of step 1, trainer1 late", TIMEOUT)
    world.run({"trainer0": (r.set_timeout, name, HANG_S)})
    retry = world.run({"trainer0": (r.attempt, name, "send")})["trainer0"]
    assert retry["ok"], retry
    world.run({"trainer1": (r.train, name, 1, 1)})  # trainer1's step 0: step 0 applied
    world.run({"trainer0": (r.train, name, 0, 1, 1), "trainer1": (r.train, name, 1, 1, 1)})  # step 1
    expected, _ = reference(2, OPTIMIZERS["sgd"], 2, seed=1)
    for t in ("trainer0", "trainer1"):
        assert_close(world.run({t: (r.state, name)})[t], expected.state_dict(), 1e-6, f"{t}'s state after 2 steps")
    stats = world.run({"trainer0": (r.stats, name)})["trainer0"]
    assert [st["version"] for st in stats.values()] == [2, 2], stats


def test_a_sync_step_whose_answer_came_after_the_call_timeout_is_kept_for_a_retry(world):
    """trainer0's step 0 counts on both servers, trainer1 late, and ps0 frozen past trainer0's
    timeout: landing the step fails by the call's own timeout naming ps0 (the servers' answer,
    the step not applied in time, came too late or not at all), not by ps1's. The trainer cannot
    tell that its push counted on ps0: the step is a failed push, its gradients for ps0's blocks
    put back and the step not counted, so the next pull reads at step 0 and waits for nothing
    (unlike after the servers' own answer, when it waits for step 0 again). step() retries it,
    which ps0 takes as the retry of the push it counted: training equals the global batch."""
    name = _sync_job(world, "review-late-answer")
    world.run({"trainer0": (r.forward_backward, name, 0)})
    world.run({"trainer0": (r.set_timeout, name, TIMEOUT)})
    assert world.run({"trainer0": (r.attempt, name, "send")})["trainer0"]["ok"]
    deadline = time.monotonic() + HANG_S
    while world.run({"ps0": (rr.counted, name, "trainer0")})["ps0"] != (0, None):
        assert time.monotonic() < deadline, "hang guard: ps0 never counted trainer0's push of step 0"
        time.sleep(0.05)
    world.freeze("ps0")
    try:
        landed = world.run({"trainer0": (r.attempt, name, "pull")})["trainer0"]
        kept = world.run({"trainer0": (rr.has_gradients, name)})["trainer0"]
    finally:
        world.thaw("ps0")
    assert not landed["ok"] and landed["type"] == "CallTimeout", landed
    assert "'ps0'" in landed["message"] and f"no answer within {TIMEOUT:g} s" in landed["message"], landed
    assert kept, "the gradients of a push whose answer never came were not put back for a retry"
    world.run({"trainer0": (r.set_timeout, name, HANG_S)})  # (a hang guard: this pull waits for nothing)
    again = world.run({"trainer0": (r.attempt, name, "pull")})["trainer0"]
    assert again["ok"], f"the pull after a failed push is a read at step 0, which waits for nothing: {again}"
    world.run({"trainer1": (r.train, name, 1, 1)})  # trainer1's step 0: step 0 applied
    retry = world.run({"trainer0": (r.attempt, name, "send")})["trainer0"]
    assert retry["ok"], retry
    world.run({"trainer0": (r.train, name, 0, 1, 1), "trainer1": (r.train, name, 1, 1, 1)})  # step 1
    expected, _ = reference(2, OPTIMIZERS["sgd"], 2, seed=1)
    for t in ("trainer0", "trainer1"):
        assert_close(world.run({t: (r.state, name)})[t], expected.state_dict(), 1e-6, f"{t}'s state after 2 steps")
    stats = world.run({"trainer0": (r.stats, name)})["trainer0"]
    assert [st["version"] for st in stats.values()] == [2, 2], stats


def test_a_geo_table_push_failing_on_one_server_adds_no_delta_twice_on_the_other(world):
    """A geo table (num_trainers=1, pushing every step) over ps0 and ps1; ps1 frozen: the push
    of rows 1 (ps0) and 7 (ps1) succeeds on ps0 only. The next push must not carry row 1's
    delta to ps0 again: with one trainer, ps0's row 1 is then row 1 of one process training an
    nn.EmbeddingBag on the same bags (SGD)."""
    name = job("review-geo-partial")
    weights = torch.randn(12, 2, generator=torch.Generator().manual_seed(0))
    bags = [[1, 7], [1, 7], [1, 7], [1]]
    ranges = world.run({"trainer0": (rr.geo_bag, name, weights, HANG_S)})["trainer0"]
    assert [s for _, _, s in ranges] == SERVERS and ranges[1][0] == 6, ranges
    for ids in bags[:2]:  # (the second lookup fetches rows 1 and 7 again: the first push dropped them)
        world.run({"trainer0": (rr.geo_bag_backward, name, ids)})
        assert world.run({"trainer0": (rr.geo_bag_step, name)})["trainer0"]["ok"]
    world.run({"trainer0": (rr.geo_bag_backward, name, bags[2])})
    world.run({"trainer0": (rr.geo_bag_timeout, name, TIMEOUT)})  # (the pushes with ps1 frozen: they fail)
    world.freeze("ps1")
    try:
        first = world.run({"trainer0": (rr.geo_bag_step, name)})["trainer0"]
        assert not first["ok"] and "'ps1'" in first["message"], first
        world.run({"trainer0": (rr.geo_bag_backward, name, bags[3])})  # (ps0's row only)
        second = world.run({"trainer0": (rr.geo_bag_step, name)})["trainer0"]
        ids, rows = world.run({"ps0": (rr.server_rows, name, 0)})["ps0"]
    finally:
        world.thaw("ps1")
    local = torch.nn.EmbeddingBag(12, 2, mode="sum", _weight=weights.clone())
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    for b in bags:
        opt.zero_grad()
        local(torch.tensor([b])).pow(2).sum().backward()
        opt.step()
    torch.testing.assert_close(rows[ids.tolist().index(1)], local.weight.detach()[1], atol=1e-6, rtol=0,
                               msg=f"ps0's row 1 after a push that failed on ps1 only (second push: {second})")
