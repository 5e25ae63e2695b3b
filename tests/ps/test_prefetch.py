"""The one-round-trip step and prefetch (issue 25): a table's or collection's ``step()`` sends its
pushes and returns with them in flight (async, half_async; sync after a prefetch); a prefetch
(or ``prefetching`` over the batches) sends the next batch's lookups with those pushes, one
message per server per step, answered once the servers applied them. Results are those of the
same loop without prefetch, bit for bit, in every mode (one trainer, and two sync trainers);
every call on the table waits for the pushes in flight first (checkpoints, flush, zero_grad,
loads), and a server frozen with a step in flight is named in time, with nothing applied
twice after the retry in sync mode."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests._deadlines import HANG_S, SETUP_S
from tests.ps import _prefetch_remote as r
from tests.ps._stalls import assert_stalled
from tests.ps._world import job

pytestmark = pytest.mark.slow

MODES = ["sync", "async", "half_async", "geo"]


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def on(world, trainer, fn, *args):
    return world.run({trainer: (fn, *args)})[trainer]


def equal(a, b, what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: step {i} differs by {(x - y).abs().max():.3g}"


def local_rows(data: list, mode: str = "sum") -> torch.Tensor:
    bag = r.local_bag(mode)
    opt = torch.optim.SGD(bag.parameters(), lr=1.0)
    for ids, offsets in data:
        opt.zero_grad()
        ((bag(ids, offsets) - 0.5) ** 2).sum().backward()
        opt.step()
    return bag.weight.detach()


@pytest.mark.parametrize("mode", MODES)
def test_a_bag_trained_with_prefetching_equals_the_same_loop_without(world, mode):
    """Outputs of every step and the rows after are bit-equal; outside geo a step is one message
    per server (the first batch's lookup, then one per step), where without prefetch it is two."""
    steps = 6
    plain = on(world, "trainer0", r.train_bag, job(f"pf-plain-{mode}"), mode, False, steps)
    ahead = on(world, "trainer0", r.train_bag, job(f"pf-ahead-{mode}"), mode, True, steps)
    equal(ahead["outs"], plain["outs"], f"{mode}: outputs with prefetch")
    assert torch.equal(ahead["rows"], plain["rows"]), mode
    if mode in ("sync", "async"):
        torch.testing.assert_close(plain["rows"], local_rows(r.batches(1, steps)), atol=1e-6, rtol=1e-5)
    if mode != "geo":
        assert plain["messages"] == {"ps0": 2 * steps, "ps1": 2 * steps}, plain["messages"]
        assert ahead["messages"] == {"ps0": steps + 1, "ps1": steps + 1}, ahead["messages"]


def stale_reference(data: list, steps: int) -> tuple[list, torch.Tensor]:
    """A local bag trained as ``prefetching(overlap=True)`` trains the table: forward k (k >= 2)
    reads the rows as they were before the last step (after steps 0..k-2); forwards 0 and 1 the
    current ones; each gradient is applied to the current rows (SGD, lr 1.0, as async)."""
    weight = r.weights(0)
    history, outs = [weight], []
    for k, (ids, offsets) in enumerate(data[:steps]):
        used = history[k - 1] if k >= 2 else history[k]
        leaf = used.clone().requires_grad_()
        out = torch.nn.functional.embedding_bag(ids, leaf, offsets, mode="sum")
        outs.append(out.detach())
        (grad,) = torch.autograd.grad(((out - 0.5) ** 2).sum(), leaf)
        weight = weight - grad
        history.append(weight)
    return outs, weight


@pytest.mark.parametrize("mode", ["async"])
def test_overlap_reads_miss_exactly_the_last_push_and_send_one_message_per_step(world, mode):
    """prefetching(overlap=True): every forward from the third on reads the rows before this
    trainer's last step (the documented bound), each earlier step in them; a step is still one
    message per server."""
    steps = 7
    got = on(world, "trainer0", r.train_bag, job(f"pf-overlap-{mode}"), mode, True, steps, 1, "sum", True)
    outs, rows = stale_reference(r.batches(1, steps), steps)
    for k, (a, b) in enumerate(zip(got["outs"], outs)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{mode}: forward {k}")
    torch.testing.assert_close(got["rows"], rows, atol=1e-5, rtol=1e-5)
    assert got["messages"] == {"ps0": steps + 1, "ps1": steps + 1}, got["messages"]
    exact = on(world, "trainer0", r.train_bag, job(f"pf-overlap-exact-{mode}"), mode, True, steps)
    assert not torch.equal(exact["outs"][2], got["outs"][2])  # (the bound is reached: not the exact reads)


def test_overlap_in_half_async_reads_one_step_ahead_and_gets_what_it_gets_without(world):
    """Issue 41, item 2: in half_async the step between a lookup sent two steps early and its
    forward may merge, which that read cannot reflect; so overlap=True sends each lookup with
    the step right before its forward, as overlap=False: the same outputs and rows as without
    prefetch, one message per server per step."""
    steps = 7
    plain = on(world, "trainer0", r.train_bag, job("pf-overlap-half-plain"), "half_async", False, steps)
    got = on(world, "trainer0", r.train_bag, job("pf-overlap-half"), "half_async", True, steps, 1, "sum", True)
    equal(got["outs"], plain["outs"], "half_async, overlap=True")
    assert torch.equal(got["rows"], plain["rows"])
    assert got["messages"] == {"ps0": steps + 1, "ps1": steps + 1}, got["messages"]


def test_overlap_is_refused_for_a_sync_table(world):
    got = on(world, "trainer0", r.overlap_refused, job("pf-overlap-sync"))
    assert got["type"] == "ValueError" and "sync" in got["message"], got


@pytest.mark.parametrize("mode", MODES)
def test_an_embedding_trained_with_prefetching_equals_the_same_loop_without(world, mode):
    plain = on(world, "trainer0", r.train_embedding, job(f"pfe-plain-{mode}"), mode, False)
    ahead = on(world, "trainer0", r.train_embedding, job(f"pfe-ahead-{mode}"), mode, True)
    equal(ahead["outs"], plain["outs"], f"{mode}: outputs with prefetch")
    assert torch.equal(ahead["rows"], plain["rows"]), mode


@pytest.mark.parametrize("mode", MODES)
def test_a_collection_trained_with_prefetching_equals_the_same_loop_without(world, mode):
    """Sum and mean bags planned together, a max bag and a bag with a padding row planned alone:
    bit-equal outputs and rows; outside geo one message per server per step."""
    steps = 5
    plain = on(world, "trainer0", r.train_collection, job(f"pfc-plain-{mode}"), mode, False, steps)
    ahead = on(world, "trainer0", r.train_collection, job(f"pfc-ahead-{mode}"), mode, True, steps)
    equal(ahead["outs"], plain["outs"], f"{mode}: collection outputs with prefetch")
    assert plain["rows"].keys() == ahead["rows"].keys()
    for key in plain["rows"]:
        assert torch.equal(ahead["rows"][key], plain["rows"][key]), (mode, key)
    if mode != "geo":
        assert ahead["messages"] == {"ps0": steps + 1, "ps1": steps + 1}, ahead["messages"]



@pytest.mark.parametrize("mode,overlap", [("sync", False), ("async", False), ("async", True)])
def test_an_evaluation_loop_prefetching_inside_the_training_loop_leaves_its_prefetches(world, mode, overlap):
    """facebookresearch/dlrm's loop: every few steps an evaluation under no_grad, its own loader
    fed through prefetching on the same tables and left early. Its forwards and its end drop
    only its own prefetches: the training loop's next forward still uses the one sent with the
    last step (as with a plain evaluation loop), and every result is the plain loop's."""
    plain = on(world, "trainer0", r.nested_eval, job(f"nested-plain-{mode}-{overlap}"), mode, overlap, "plain")
    ahead = on(world, "trainer0", r.nested_eval, job(f"nested-pf-{mode}-{overlap}"), mode, overlap, "prefetched")
    equal(ahead["outs"], plain["outs"], "training outputs")
    equal(ahead["evals"], plain["evals"], "evaluation outputs")
    for key in plain["rows"]:
        assert torch.equal(ahead["rows"][key], plain["rows"][key]), key
    # 6 steps, each with the next batch's lookups, the first lookup, and 3 evaluations of 2
    # batches: the evaluation's prefetching sends what its plain forwards send, nothing more
    assert ahead["messages"] == plain["messages"] == {"ps0": 6 + 1 + 6, "ps1": 6 + 1 + 6}, (ahead, plain)


def test_two_sync_trainers_prefetching_get_the_outputs_and_rows_they_get_without(world):
    got = {}
    for prefetched in (False, True):
        name = job(f"pf-pair-{prefetched}")
        on(world, "trainer0", r.load, name)
        got[prefetched] = world.run({f"trainer{k}": (r.sync_pair, name, prefetched, k) for k in (0, 1)})
    for k in (0, 1):
        equal(got[True][f"trainer{k}"]["outs"], got[False][f"trainer{k}"]["outs"], f"sync trainer{k}")
        assert torch.equal(got[True][f"trainer{k}"]["rows"], got[False][f"trainer{k}"]["rows"])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_prefetch_is_consumed_only_by_a_forward_of_equal_arguments(world, mode):
    """A forward of other ids drops it (and gets its own rows); a later prefetch replaces it; ids
    changed in place after the prefetch are looked up as they are now; bad arguments raise at
    prefetch() as at forward()."""
    got = on(world, "trainer0", r.handles, job(f"pf-handles-{mode}"), mode)
    table = r.local_bag()
    with torch.no_grad():
        assert torch.equal(got["plain_b"], got["other"])
        torch.testing.assert_close(got["after_drop"], table(torch.tensor([[1, 15], [2, 16]])))
        torch.testing.assert_close(got["replaced"], table(torch.tensor([[1, 15], [2, 16]])))
        torch.testing.assert_close(got["changed"], table(torch.tensor([[3, 15], [2, 16]])))
    assert torch.equal(got["changed"], got["changed_plain"])
    assert not got["forward_error"]["ok"] and not got["prefetch_error"]["ok"]
    assert got["prefetch_error"]["type"] == got["forward_error"]["type"], got
    assert got["prefetch_error"]["message"] == got["forward_error"]["message"], got
    assert not got["offsets_error"]["ok"] and "offsets" in got["offsets_error"]["message"], got


def test_a_prefetch_under_no_grad_does_not_feed_a_forward_that_records(world):
    got = on(world, "trainer0", r.no_grad_then_grad, job("pf-nograd"))
    bag = r.local_bag()
    bag(torch.tensor([[1, 15]])).sum().backward()
    torch.optim.SGD(bag.parameters(), lr=1.0).step()
    torch.testing.assert_close(got["rows"], bag.weight.detach())


@pytest.mark.parametrize("what", ["state_dict", "flush", "zero_grad", "forward", "optimizer_state_dict"])
@pytest.mark.parametrize("mode", ["sync", "async", "half_async"])
def test_calls_after_a_step_in_flight_see_its_pushes(world, mode, what):
    """A step left in flight (with a prefetch), then a checkpoint, flush, zero_grad or forward:
    nothing is lost (the rows are stepped once) and a checkpoint holds the step."""
    got = on(world, "trainer0", r.in_flight, job(f"pf-flight-{mode}-{what}"), mode, what)
    bag = r.local_bag()
    bag(torch.tensor([[1, 15], [2, 16]])).pow(2).sum().backward()
    torch.optim.SGD(bag.parameters(), lr=1.0).step()
    stepped = bag.weight.detach()
    torch.testing.assert_close(got["rows"], stepped, atol=1e-6, rtol=1e-5)
    if what == "state_dict":
        torch.testing.assert_close(got["state"], stepped, atol=1e-6, rtol=1e-5)
    if what == "forward":
        with torch.no_grad():
            torch.testing.assert_close(got["out"], torch.nn.functional.embedding_bag(torch.tensor([[3, 17]]), stepped,
                                                                                     mode="sum"))


def test_a_load_after_a_step_in_flight_drops_the_prefetch_that_read_before_it(world):
    got = on(world, "trainer0", r.in_flight, job("pf-flight-load"), "async", "load")
    loaded = r.weights(5)
    torch.testing.assert_close(got["rows"], loaded)
    torch.testing.assert_close(got["after_load"],
                               torch.nn.functional.embedding_bag(torch.tensor([[3, 17]]), loaded, mode="sum"))


@pytest.mark.parametrize("alone", [False, True])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_load_drops_a_collections_prefetch_that_read_before_it(world, mode, alone):
    got = on(world, "trainer0", r.collection_load, job(f"pf-cload-{mode}-{alone}"), mode, alone)
    loaded = ["s"] if alone else list("smxp")
    for k in loaded:
        assert torch.equal(got[k], torch.zeros(2, r.DIM)), (k, got[k])


def test_a_trainer_leaving_with_a_step_in_flight_loses_nothing():
    """trainer0 steps an async table three times and shuts RPC down (graceful) with the last
    step's pushes in flight; trainer1 sees the table hold all three steps (its own process:
    the world ends)."""
    proc = subprocess.run([sys.executable, "-m", "tests.ps._shutdown_script"], capture_output=True, text=True,
                          timeout=SETUP_S + HANG_S)  # (a hang guard: its own world starts and ends)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["trainer0"]["left_in_flight"], got
    assert got["trainer1"]["seen"], got


@pytest.mark.parametrize("what", ["flush", "state_dict", "double"])
@pytest.mark.parametrize("mode", ["async", "half_async"])
def test_a_merge_or_a_cast_between_step_and_forward_gives_what_it_gives_without_prefetch(world, mode, what):
    """half_async merging 100 pushes at a time: a flush (or a checkpoint, which flushes) after
    the step merges its push, so the prefetch that read before is dropped; ``model.double()``
    after a prefetch gives float64 outputs."""
    got = {p: on(world, "trainer0", r.between, job(f"pf-between-{mode}-{what}-{p}"), mode, what, p)
           for p in (False, True)}
    assert got[True].dtype == got[False].dtype
    assert torch.equal(got[True], got[False]), (got[True], got[False])


def test_weights_that_need_a_gradient_get_it_after_a_prefetch_of_equal_weights(world):
    got = {p: on(world, "trainer0", r.weights_grad, job(f"pf-wgrad-{p}"), p) for p in (False, True)}
    assert got[True]["grad"] is not None and torch.equal(got[True]["grad"], got[False]["grad"])


def test_a_collection_table_unfrozen_after_the_prefetch_trains(world):
    got = {p: on(world, "trainer0", r.unfrozen, job(f"pf-unfrozen-{p}"), p) for p in (False, True)}
    for key, value in got[False].items():
        assert torch.equal(got[True][key], value), key


def test_prefetching_trains_every_batch_a_failing_loader_gave_then_raises(world):
    got = {p: on(world, "trainer0", r.failing_loader, job(f"pf-loader-{p}"), p) for p in (False, True)}
    assert got[True]["trained"] == got[False]["trained"] == 2
    assert got[True]["error"] == got[False]["error"] == "the loader broke"
    assert torch.equal(got[True]["rows"], got[False]["rows"])
    assert got[True]["reset"] == 0


def test_a_sync_prefetched_lookup_that_times_out_is_a_lookup_failure_and_the_trainers_stay_in_step(world):
    name = job("pf-sync-late")
    for trainer in ("trainer1", "trainer0"):
        on(world, trainer, r.sync_late_attach, name)
    first = on(world, "trainer0", r.sync_late, name, "first")
    assert_stalled(world, first, name, "a prefetched lookup of step 1, trainer1 late", r.LATE_TIMEOUT)
    late = on(world, "trainer1", r.sync_late, name, "step")
    assert late["ok"], late
    # trainer0 goes on as after a lookup failure without prefetch: a forward, then its step
    got = world.run({"trainer0": (r.sync_late, name, "next"), "trainer1": (r.sync_late, name, "next")})
    assert got["trainer0"]["ok"] and got["trainer1"]["ok"], got
    assert torch.equal(got["trainer0"]["value"], got["trainer1"]["value"])


def test_a_table_prefetched_alone_and_stepped_in_a_collection_too_gets_what_it_gets_without(world):
    """Found by the second hostile review: a prefetch counted only its own object's steps, so a
    push of the same table through a collection went unseen and the prefetch was used stale."""
    got = {p: on(world, "trainer0", r.mixed, job(f"pf-mixed-{p}"), p) for p in (False, True)}
    equal(got[True]["outs"], got[False]["outs"], "a table also stepped through a collection")
    assert torch.equal(got[True]["rows"], got[False]["rows"])


def test_prefetching_a_loop_without_steps_holds_no_more_batches_than_it_reads_ahead(world):
    """Found by the third hostile review: every batch's plan waited for a step, so a loop with
    none (an evaluation through the training loop's code) held every batch until its end."""
    most = on(world, "trainer0", r.batches_held, job("pf-held"))
    assert most <= 5, f"{most} batches alive at once (it reads three ahead of the current one)"


def test_prefetches_no_forward_uses_are_not_kept_for_good(world):
    """Found by the third hostile review: features that do not give the forward's arguments
    (int32 ids to a model that casts them to int64) left one more prefetch behind every step."""
    most = on(world, "trainer0", r.prefetches_kept, job("pf-kept"))
    assert most <= 8, f"{most} prefetches kept after 30 steps"


def test_a_load_in_the_loop_costs_only_the_lookups_it_made_stale(world):
    """Found by the third hostile review: a lookup planned before a load (or a half_async
    flush) and sent after it was taken for stale, and the stale ones sent before it held up
    the sending of the next: three forwards after the load looked up again, not two."""
    got = on(world, "trainer0", r.load_in_loop, job("pf-load-loop"))
    assert got["sent"][:4] == [4] + [2] * 3, got["sent"]
    assert got["sent"][4:6] == [4, 4], got["sent"]  # (the lookups sent before the load: looked up again)
    assert got["sent"][6:] == [2] * 3, got["sent"]


@pytest.mark.parametrize("holds,overlap", [("bag", False), ("bag", True), ("collection", False)])
def test_a_half_async_timer_merge_between_the_prefetch_and_its_forward_is_seen(world, holds, overlap):
    """Issue 41, item 2: a half_async table merging on its ``half_async_merge_s`` timer only;
    each step's prefetch read the rows before the timer merged that step's push (the test waits
    for the servers' merge count, not for time), so the forward must not use what it read:
    outputs and rows bit-equal to the same loop without prefetch, which equals local SGD."""
    steps = 4
    collection_of = holds == "collection"
    plain = on(world, "trainer0", r.timer_merges, job(f"pf-timer-plain-{holds}"), False, False, steps, collection_of)
    ahead = on(world, "trainer0", r.timer_merges, job(f"pf-timer-{holds}-{overlap}"), True, overlap, steps,
               collection_of)
    equal(ahead["outs"], plain["outs"], f"{holds}, overlap={overlap}: outputs with prefetch")
    if collection_of:
        for key in plain["rows"]:
            assert torch.equal(ahead["rows"][key], plain["rows"][key]), key
    else:
        assert torch.equal(ahead["rows"], plain["rows"])
        torch.testing.assert_close(plain["rows"], local_rows(r.batches(4, steps)), atol=1e-6, rtol=1e-5)
    assert ahead["merges"] == plain["merges"], (ahead["merges"], plain["merges"])


def test_a_merge_another_trainers_push_makes_before_a_prefetched_forward_is_seen(world):
    """Issue 41, item 2, with two half_async trainers of a bag merging every 2 pushes (never on
    its timer): trainer0's step sends its next lookup, read before trainer1's push completes
    the merge; trainer0's next forward comes after that merge, so it must reflect it, as the
    same order of calls without prefetch does. Nothing here depends on timing."""
    steps = 3
    got = {}
    for prefetched in (False, True):
        name = job(f"pf-half-pair-{prefetched}")
        on(world, "trainer0", r.pair_start, name, 0, prefetched, steps)
        on(world, "trainer1", r.pair_start, name, 1, prefetched, steps)
        outs = []
        for _ in range(steps):
            for trainer in ("trainer0", "trainer1"):
                outs.append(on(world, trainer, r.pair_step, name))
        got[prefetched] = {"outs": outs, "rows": on(world, "trainer0", r.pair_rows, name)}
        on(world, "trainer1", r.pair_rows, name)
    assert [o["merges"] for o in got[True]["outs"]] == [0, 2, 2, 4, 4, 6], got[True]["outs"]
    equal([o["out"] for o in got[True]["outs"]], [o["out"] for o in got[False]["outs"]], "two trainers' outputs")
    assert torch.equal(got[True]["rows"], got[False]["rows"])


@pytest.mark.parametrize("mode", ["sync", "async", "half_async"])
@pytest.mark.parametrize("holds", ["bag", "collection"])
def test_prefetching_over_a_psmodels_tables_sends_one_message_per_server_per_step(world, mode, holds):
    """Issue 41, item 8: with ``prefetching`` over the tables inside a PSModel, its step sends
    their next lookups with its pushes: one message per server per step (after the first
    forward's pull and lookup), where without prefetch each forward looks up again; outputs,
    rows and dense values bit-equal to the loop without. A collection's own counter (the
    demo's messages/step) counts that message too."""
    steps = 5
    plain = on(world, "trainer0", r.psmodel_tables, job(f"pf-psm-plain-{mode}-{holds}"), mode, False, holds, steps)
    ahead = on(world, "trainer0", r.psmodel_tables, job(f"pf-psm-{mode}-{holds}"), mode, True, holds, steps)
    equal(ahead["outs"], plain["outs"], f"{mode}: a PSModel's outputs with prefetch")
    assert plain["rows"].keys() == ahead["rows"].keys()
    for key in plain["rows"]:
        assert torch.equal(ahead["rows"][key], plain["rows"][key]), (mode, key)
    assert plain["messages"] == {"ps0": 2 * steps + 1, "ps1": 2 * steps + 1}, plain["messages"]
    assert ahead["messages"] == {"ps0": steps + 2, "ps1": steps + 2}, ahead["messages"]
    if holds == "collection":  # (the first forward's lookup, then one message per step)
        assert ahead["traffic"] == {"ps0": steps + 1, "ps1": steps + 1}, ahead["traffic"]


@pytest.mark.parametrize("given", ["model", "number"])
def test_prefetching_over_what_is_not_a_table_says_what_to_pass(given):
    # a model holding tables (a PSModel, say) is not what prefetching looks up: it says to pass
    # the tables or their collection, at the first batch, before any lookup
    from torch import nn

    from remote_module.ps import prefetching

    bad = nn.Sequential(nn.Linear(2, 2), nn.ReLU()) if given == "model" else 5
    with pytest.raises(TypeError, match="prefetching takes a ShardedEmbedding") as err:
        next(prefetching([1, 2], bad))
    if given == "model":
        assert "pass the tables (or their collection) it holds" in str(err.value)
