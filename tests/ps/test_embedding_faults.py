"""Sharded embedding tables (issue 12) under failing ranks: a frozen server (SIGSTOP) and a
killed one (SIGKILL) during lookups and steps in sync and async, a trainer killed in a sync
step, and the trainer's own RPC agent stopping under lookups in flight. Their own small world
(tests/ps/_world.py: driver, ps0, ps1, trainer0, trainer1), since ranks die in it: frozen first,
then the killed trainer, the killed server, and the shutdown last."""

from __future__ import annotations

import time

import pytest
import torch

from tests._deadlines import HANG_S
from tests.ps import _embedding_edge_cases_remote as h
from tests.ps import _embedding_faults_remote as f
from tests.ps import _prefetch_remote as pf
from tests.ps import _retry_remote as rr
from tests.ps._stalls import assert_stalled
from tests.ps._world import job

pytestmark = pytest.mark.slow

#: the timeout under test: set on a call only while its fault holds (a rank frozen, or dead);
#: every call expected to succeed has HANG_S, a hang guard (a loaded machine may be slow)
TIMEOUT = 2.0


@pytest.fixture(scope="module")
def faulty():
    from tests.ps._world import PSWorld

    with PSWorld({"ps": 2, "trainer": 2}) as w:
        w.killed = set()
        yield w


def assert_named_in_time(outcome: dict, worker: str, what: str, fault: str = "frozen") -> None:
    """The call failed naming ``worker`` while the fault still held (a frozen ``worker`` is
    thawed only once every outcome is in; a dead one never comes back), so no late answer of it
    ended the call. How it failed, by ``fault``: "frozen", the call's own timeout (TIMEOUT, as
    its error says: not the world's default, nor a longer one); "dead", any error (a dead
    server's connection fails at once). (A sync wait for a dead trainer: tests/ps/_stalls.py.)
    The only bound on its time is a hang guard: a call that never fails fails there."""
    assert not outcome["ok"], f"{what} succeeded: {outcome}"
    assert f"'{worker}'" in outcome["message"], f"{what}: the error does not name {worker!r}: {outcome['message']}"
    if fault == "frozen":
        assert outcome["type"] == "CallTimeout", f"{what}: not the timeout's error: {outcome}"
        assert f"no answer within {TIMEOUT:g} s" in outcome["message"], f"{what}: not this call's timeout: {outcome}"
    assert outcome["seconds"] < TIMEOUT + HANG_S, f"{what}: hang guard: no end within timeout + {HANG_S} s: {outcome}"


def timed(world, trainer, name, what, ids=None, timeout=TIMEOUT):
    return world.run({trainer: (f.timed, name, what, timeout, ids)})[trainer]


def timed_ok(world, trainer, name, what, ids=None):
    """:func:`timed` for a call expected to succeed: its timeout is a hang guard."""
    return timed(world, trainer, name, what, ids, timeout=HANG_S)


def while_ps1_frozen(world, name, *calls):
    """Run each ``(fn, *args)`` on trainer0 in turn, with ps1 stopped (SIGSTOP) and the timeout
    of the object kept as ``name`` set to TIMEOUT; continue ps1 after them, whatever happened,
    and set that timeout to HANG_S (the calls after the thaw must not time out). Their
    outcomes, in order."""
    world.freeze("ps1")
    try:
        outcomes = [world.run({"trainer0": (f.with_timeout, name, TIMEOUT, *call)})["trainer0"] for call in calls]
    finally:
        world.thaw("ps1")
    world.run({"trainer0": (f.set_timeout, name, HANG_S)})
    return outcomes


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_frozen_server_is_named_in_time_other_tables_work_and_training_continues_after_the_thaw(faulty, mode):
    """ps1 stopped (SIGSTOP): a lookup and a step of a table with rows on it fail within the
    timeout naming ps1, while a table on ps0 alone keeps working (its calls succeed although
    ps1 stays frozen until they are done). After SIGCONT, step() again retries the failed step
    (sync: the servers that had it take the retry as a no-op) and the rows equal torch's."""
    name, healthy = job(f"frozen-{mode}"), job(f"healthy-{mode}")
    faulty.run({"trainer0": (_prepare_kw, name, [1, 15], {"ps_mode": mode})})
    faulty.run({"trainer0": (_prepare_kw, healthy, [1], {"ps_mode": mode, "servers": ["ps0"]})})
    # a bag ps1 holds whole: its lookups are one call each (an eval lookup: the arguments as given)
    lone = job(f"lone-{mode}")
    faulty.run({"trainer0": (_prepare_kw, lone, None, {"ps_mode": mode, "servers": ["ps1"], "bag": "sum"})})
    # a collection of plain bags: its lookups planned together, its pushes packed
    packed = job(f"packed-{mode}")
    faulty.run({"trainer0": (_prepare_collection_kw, packed, {"ps_mode": mode})})
    # stopped before the first call is sent (os.kill returns before the stop takes effect)
    faulty.freeze("ps1")
    try:
        step = timed(faulty, "trainer0", name, "step")
        lookup = timed(faulty, "trainer0", name, "lookup")
        lone_lookups = {what: timed(faulty, "trainer0", lone, what, [1, 15]) for what in ("eval", "lookup")}
        collection = {what: faulty.run({"trainer0": (f.timed_collection, packed, what, TIMEOUT)})["trainer0"]
                      for what in ("step", "forward", "eval")}
        others = [timed_ok(faulty, "trainer0", healthy, what, [1]) for what in ("step", "lookup", "eval")]
    finally:
        faulty.thaw("ps1")
    assert_named_in_time(step, "ps1", f"{mode} step")
    assert_named_in_time(lookup, "ps1", f"{mode} lookup")
    for what, outcome in lone_lookups.items():
        assert_named_in_time(outcome, "ps1", f"{mode} {what} of a table ps1 holds whole")
    assert all(o["ok"] for o in others), f"a table on ps0 alone, ps1 frozen: {others}"
    assert timed_ok(faulty, "trainer0", lone, "eval", [1, 15])["ok"]  # thawed: answered again
    for what, outcome in collection.items():
        assert_named_in_time(outcome, "ps1", f"{mode} collection {what} (packed)")
    for what in ("step", "forward", "step", "eval"):  # the failed step retried, then training goes on
        out = faulty.run({"trainer0": (f.timed_collection, packed, what, HANG_S)})["trainer0"]
        assert out["ok"], f"{mode}: collection {what} after ps1 thawed: {out}"
    if mode == "sync":
        retried = timed_ok(faulty, "trainer0", name, "step")
        assert retried["ok"], f"step() retried after ps1 thawed: {retried}"
        for _ in range(2):
            assert timed_ok(faulty, "trainer0", name, "backward")["ok"]
            assert timed_ok(faulty, "trainer0", name, "step")["ok"]
        rows = timed_ok(faulty, "trainer0", name, "rows")["value"]
        emb, opt = h.local_steps((torch.optim.SGD, {"lr": 1.0}), [[1, 15]] * 3)
        torch.testing.assert_close(rows, emb.weight.detach())
    else:  # async: the frozen push arrived after the thaw; the table trains on
        assert timed_ok(faulty, "trainer0", name, "backward")["ok"]
        assert timed_ok(faulty, "trainer0", name, "step")["ok"]


def _prepare_collection_kw(name, kwargs):  # on a trainer
    return f.prepare_collection(name, **kwargs)


def _prepare_kw(name, ids, kwargs):  # on a trainer
    return f.prepare(name, ids, **kwargs)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_server_frozen_with_a_step_in_flight_is_named_at_the_next_call_and_the_retry_applies_once(faulty, mode):
    """A step sent with the next batch's prefetch (one message per server) while ps1 is stopped:
    step() returns at once with its pushes in flight (still to be landed when it returned, ps1
    frozen all along: it did not wait for their answers); the next forward fails within the
    timeout naming ps1 (and the step's gradients are kept). After SIGCONT, step() again
    retries it and training goes on; in sync mode the servers that had the push take the retry
    as a no-op, so the rows equal torch's (nothing applied twice)."""
    name = job(f"flight-frozen-{mode}")
    faulty.run({"trainer0": (pf.prepare_in_flight, name, mode)})
    step, forward = while_ps1_frozen(faulty, name, (pf.on_table, name, "step"), (pf.on_table, name, "forward"))
    assert step["ok"] and step["in_flight"], f"{mode}: step() with ps1 frozen did not return at once: {step}"
    assert_named_in_time(forward, "ps1", f"{mode} forward after a step in flight")
    retried = faulty.run({"trainer0": (pf.on_table, name, "step")})["trainer0"]
    assert retried["ok"], f"{mode}: the step retried after the thaw: {retried}"
    for _ in range(2):
        trained = faulty.run({"trainer0": (pf.on_table, name, "train")})["trainer0"]
        assert trained["ok"], f"{mode}: training after the thaw: {trained}"
    rows = faulty.run({"trainer0": (pf.on_table, name, "rows")})["trainer0"]["value"]
    bag = pf.local_bag()
    opt = torch.optim.SGD(bag.parameters(), lr=1.0)
    for ids in ([[1, 15]], [[2, 16]], [[2, 16]]):
        opt.zero_grad()
        bag(torch.tensor(ids)).pow(2).sum().backward()
        opt.step()
    if mode == "async":
        # ps0 answered that it applied its part of the step: the retry leaves it out (its rows
        # equal torch's, not stepped twice); ps1, frozen, may have applied it before the thaw
        # (an async push carries no step identity: documented), so its rows are not compared
        owners = faulty.run({"trainer0": (pf.on_table, name, "owners")})["trainer0"]["value"]
        mine = torch.tensor([o == "ps0" for o in owners])
        assert owners[1] == owners[2] == "ps0" and owners[15] == owners[16] == "ps1", owners
        rows, want = rows[mine], bag.weight.detach()[mine]
    else:
        want = bag.weight.detach()
    torch.testing.assert_close(rows, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["async", "sync", "geo"])
def test_a_psmodel_step_in_flight_to_a_frozen_server_is_named_at_the_next_call_and_can_be_retried(faulty, mode):
    """A PSModel's step() returns with its pushes in flight, ps1 stopped: the next forward fails
    within the timeout naming ps1, and the step's gradients are back on the parameters; after
    SIGCONT step() again pushes them and training goes on. geo: a step that pushes the deltas
    waits for the merged values, so it is step() that fails in time naming ps1 (ps0's blocks
    merged, ps1's deltas kept for the next push), and the next forward runs."""
    name = job(f"psmodel-flight-{mode}")
    faulty.run({"trainer0": (pf.psmodel_prepare, name, mode)})
    step, forward, grads = while_ps1_frozen(faulty, name, *((pf.psmodel_do, name, what)
                                                            for what in ("step", "forward", "grads")))
    if mode == "geo":
        assert_named_in_time(step, "ps1", "a geo PSModel's step() pushing its deltas")
        assert forward["ok"], forward
    else:
        assert step["ok"] and step["in_flight"], f"step() with ps1 frozen did not return at once: {step}"
        assert_named_in_time(forward, "ps1", "a PSModel's forward after a step in flight")
    assert grads["ok"] and grads["value"] is True, grads
    for _ in range(2):
        retried = faulty.run({"trainer0": (pf.psmodel_do, name, "retry")})["trainer0"]
        assert retried["ok"], f"step() after the thaw: {retried}"
        assert faulty.run({"trainer0": (pf.psmodel_do, name, "forward")})["trainer0"]["ok"]
    if mode != "geo":
        # two steps in all (the retry is the failed step's): ps0 answered that it applied its
        # part of the first, so the retry left it out and its blocks equal torch's (before, it
        # stepped them twice); ps1, frozen, may have applied it before the thaw (no step
        # identity in async: documented), so its blocks are not compared
        diff = faulty.run({"trainer0": (pf.psmodel_do, name, "ps0_vs_torch")})["trainer0"]
        assert diff["ok"] and diff["value"] <= 1e-6, diff


def test_a_psmodel_retry_after_a_new_backward_gives_the_server_that_applied_the_step_only_the_new_gradient(faulty):
    """async: the step fails on a frozen ps1 after ps0 applied its part; after the thaw a new
    forward and backward add their gradients; the retry gives ps0 only the new ones (its part of
    the failed step is done), so ps0's blocks equal torch's two steps."""
    name = job("psmodel-retry-new-grads")
    faulty.run({"trainer0": (pf.psmodel_prepare, name, "async")})
    step, forward = while_ps1_frozen(faulty, name, (pf.psmodel_do, name, "step"), (pf.psmodel_do, name, "forward"))
    assert step["ok"], step
    assert_named_in_time(forward, "ps1", "a PSModel's forward after a step in flight")
    assert faulty.run({"trainer0": (pf.psmodel_do, name, "forward")})["trainer0"]["ok"]
    assert faulty.run({"trainer0": (pf.psmodel_do, name, "retry")})["trainer0"]["ok"]
    diff = faulty.run({"trainer0": (pf.psmodel_do, name, "ps0_vs_torch")})["trainer0"]
    assert diff["ok"] and diff["value"] <= 1e-6, diff


def test_a_step_failing_after_an_optimizers_zero_grad_is_pushed_again_by_the_retry(faulty):
    """Found by the third hostile review: a collection trained through prefetching(overlap=True),
    its grad markers zeroed by a local optimizer before each forward (an optimizer of
    model.parameters()); a step in flight to a frozen ps1 fails at the next call (an eval
    forward, after that zero_grad). The zero_grad ran before the failure was known, so the
    gradients kept for the retry count: step() again pushes them (it pushed nothing)."""
    name = job("zero-grad-retry")
    faulty.run({"trainer0": (pf.zero_grad_prepare, name)})
    step, evaluated = while_ps1_frozen(faulty, name, (pf.zero_grad_do, name, "train"), (pf.zero_grad_do, name, "eval"))
    assert step["ok"] and step["pushed"] > 0, step
    assert_named_in_time(evaluated, "ps1", "an eval forward after a step in flight")
    retried = faulty.run({"trainer0": (pf.zero_grad_do, name, "retry")})["trainer0"]
    # (ps0 answered that it applied its part: the retry pushes ps1's rows only, not ps0's twice)
    assert retried["ok"] and 0 < retried["pushed"] < step["pushed"], (step, retried)


def _on(world, fn, *args):
    return world.run({"trainer0": (fn, *args)})["trainer0"]


def _fail_on_frozen_ps1(world, do, name, after):
    """step() with ps1 frozen (returns in flight), then ``after`` fails naming ps1; thawed."""
    step, later = while_ps1_frozen(world, name, (do, name, "step"), (do, name, *after))
    assert step["ok"], step
    assert_named_in_time(later, "ps1", f"{after[0]} after a step in flight")


def test_a_table_retry_after_a_backward_with_no_rows_on_ps0_still_counts_a_step_there(faulty):
    """SparseAdam counts one step of the whole table per step (an empty push where a server
    holds none of the rows). Step 1 ([1, 15]) applied on ps0, failed on ps1; a backward of [16]
    (ps1's) since; the retry is a step for ps0 too (as a PSModel's, whose retry after a new
    backward pushes ps0 again), so after a third step ([1]) ps0's rows equal torch's three
    steps (its bias correction counts 3)."""
    opt = (torch.optim.SparseAdam, {"lr": 0.1})
    name = job("table-retry-count")
    _on(faulty, rr.table_prepare, name, opt)
    _fail_on_frozen_ps1(faulty, rr.table_do, name, ("flush",))
    assert _on(faulty, rr.table_do, name, "backward", [16])["ok"]
    assert _on(faulty, rr.table_do, name, "retry")["ok"]
    assert _on(faulty, rr.table_do, name, "train", [1])["ok"]
    rows = _on(faulty, rr.table_do, name, "rows")["value"]
    ref = rr.table_torch(opt, [[1, 15], [16], [1]])
    torch.testing.assert_close(rows[:10], ref[:10])


def test_a_psmodel_retry_pushes_no_zero_gradient_to_ps0_for_a_parameter_the_new_backward_left_out(faulty):
    """SGD with momentum: step 1 applied on ps0 (a, c), failed on ps1 (b); a new forward and
    backward that does not use c; the retry pushes ps0 the new gradient of a, and nothing of c
    (torch leaves a parameter without a gradient alone: no momentum step on a zero one)."""
    opt = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    name = job("model-retry-unused")
    _on(faulty, rr.model_prepare, name, opt)
    _fail_on_frozen_ps1(faulty, rr.model_do, name, ("forward",))
    assert _on(faulty, rr.model_do, name, "forward", False)["ok"]
    assert _on(faulty, rr.model_do, name, "retry")["ok"]
    values = _on(faulty, rr.model_do, name, "values")["value"]
    ref = rr.model_torch(opt, [True, False])
    for pname in ("a.weight", "a.bias", "c"):
        torch.testing.assert_close(values[pname].reshape(ref[pname].shape), ref[pname], msg=pname)


def test_a_trainer_killed_in_a_sync_step_is_named_by_the_others_next_lookup_in_time(faulty):
    """Both trainers attached and looked up; trainer1 is killed before its push: trainer0's push
    goes through, its next lookup fails within the timeout naming trainer1 (not itself), the
    waiting lookups are gone from the servers, and nothing was settled twice."""
    name = job("killed-trainer")
    faulty.run({t: (_prepare_kw, name, [1, 15], {"ps_mode": "sync", "num_trainers": 2})
                for t in ("trainer0", "trainer1")})
    faulty.kill("trainer1")
    step = timed_ok(faulty, "trainer0", name, "step")
    assert step["ok"], f"trainer0's push needs no other trainer: {step}"
    lookup = timed(faulty, "trainer0", name, "lookup")
    assert_stalled(faulty, lookup, name, "the lookup waiting for step 0", TIMEOUT)  # (naming trainer1 only)
    # each server drops its waiting lookup at its own deadline: the lookup failed at the first
    # server's, the other's may come later on a loaded machine (each about TIMEOUT after it came)
    deadline = time.monotonic() + HANG_S
    while (left := faulty.run({s: (f.waiters, name) for s in ("ps0", "ps1")})) != {"ps0": 0, "ps1": 0}:
        assert time.monotonic() < deadline, f"hang guard: sync lookups still waiting on the servers: {left}"
        time.sleep(0.1)
    assert "settling a remote call's future failed" not in faulty.stderr_tail(100_000)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_killed_server_is_named_by_lookup_and_step_and_tables_elsewhere_keep_working(faulty, mode):
    """ps1 killed (SIGKILL): a table with rows on it fails lookups and steps in time naming ps1;
    a table on ps0 alone trains on."""
    name, healthy = f"killed-server-{mode}", f"killed-server-healthy-{mode}"
    if "ps1" not in faulty.killed:
        for m in ("sync", "async"):
            faulty.run({"trainer0": (_prepare_kw, f"killed-server-{m}", [1, 15], {"ps_mode": m})})
            faulty.run({"trainer0": (_prepare_kw, f"killed-server-healthy-{m}", [1],
                                     {"ps_mode": m, "servers": ["ps0"]})})
        faulty.kill("ps1")
        faulty.killed.add("ps1")
    for what in ("step", "lookup"):
        assert_named_in_time(timed(faulty, "trainer0", name, what), "ps1", f"{mode} {what}", "dead")
    for what in ("step", "backward", "step", "lookup"):
        out = timed_ok(faulty, "trainer0", healthy, what, [1])
        assert out["ok"], f"{mode}: {what} of a table on ps0 alone, ps1 dead: {out}"


def test_lookups_in_flight_when_the_trainer_leaves_rpc_fail_saying_so_and_none_hangs(faulty, tmp_path):
    """Last in the file: trainer0's RPC agent is shut down (not gracefully: the servers of this
    world wait in their own shutdown) under three looping lookups: every thread ends with an
    error naming the server or saying to call init_rpc."""
    import json
    import time

    path = tmp_path / "outcomes.json"
    faulty.run({"trainer0": (f.shutdown_during_lookups, job("shutdown"), str(path))})
    deadline = time.monotonic() + 2 * HANG_S  # (longer than the threads' own hang guard, HANG_S)
    while not path.exists():
        assert time.monotonic() < deadline, "hang guard: the lookups did not end after the shutdown"
        time.sleep(0.1)
    got = json.loads(path.read_text())
    assert got["ended"] == [True] * 3, got
    for outcome in got["outcomes"]:  # in flight, not sent, or made after: each says where or what
        assert outcome["type"] == "RuntimeError", outcome
        assert "'ps0'" in outcome["message"] or "init_rpc" in outcome["message"], outcome
