"""Hostile use of the parameter servers (issue 11) by an ordinary PyTorch user: parameters that
are scalars, unused on some steps, frozen, integer or tied; partial checkpoints; optimizer state
of another shape; more num_trainers than trainers; a frozen (SIGSTOP) server.

One world for the file (tests/ps/_world.py: driver, ps0, ps1, trainer0, trainer1); the frozen
server comes last. Local references are plain torch on the same model (tests/ps/_dense_edge_cases_remote.py)."""

from __future__ import annotations

import pytest
import torch

from tests._deadlines import HANG_S
from tests.ps import _dense_edge_cases_remote as h
from tests.ps import _dense_remote as r
from tests.ps._stalls import assert_stalled
from tests.ps._world import PSWorld, job

pytestmark = pytest.mark.slow

SERVERS = ["ps0", "ps1"]
#: the timeout under test: set on a job only for the calls expected to reach it (no server
#: answers them while the test holds the fault)
TIMEOUT = 2.0
SGD_MOMENTUM = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1})
ADAM = (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.1})


@pytest.fixture(scope="module")
def world():
    with PSWorld({"ps": 2, "trainer": 2}) as w:
        yield w


def reference(optimizer: tuple, steps: int, **model_kwargs) -> dict:
    """The same model and steps in one process with plain torch."""
    model = h.build(1, **model_kwargs)
    opt = optimizer[0](model.parameters(), **optimizer[1])
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        (model(h.x_of(step), h.uses_q(step)) ** 2).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_close(got: dict, expected: dict, what: str, atol: float = 1e-6) -> None:
    assert list(got) == list(expected), f"{what}: keys {list(got)}, expected {list(expected)}"
    for k in expected:
        assert got[k].dtype == expected[k].dtype, f"{what}: {k} is {got[k].dtype}, expected {expected[k].dtype}"
        err = (got[k].double() - expected[k].double()).abs().max().item()
        assert err <= atol, f"{what}: {k} differs from plain torch by {err:.3g}: {got[k]} vs {expected[k]}"


def _create_kw(name, kwargs):  # on trainer0
    model_kwargs = kwargs.pop("model_kwargs", None)
    return h.create(name, 1, SERVERS, model_kwargs, num_trainers=1, min_block_size=4, **kwargs)


# ---- parameters torch users have -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_unused_and_frozen_parameters_are_stepped_as_torch_steps_them(world, mode):
    """torch skips a parameter without a gradient (frozen, or unused this step): no weight
    decay, no momentum. Pushing zeros instead moves it."""
    name = job(f"unused-{mode}")
    world.run({"trainer0": (_create_kw, name, dict(ps_mode=mode, optimizer=SGD_MOMENTUM))})
    world.run({"trainer0": (h.train, name, 5)})
    got = world.run({"trainer0": (r.state, name)})["trainer0"]
    assert_close(got, reference(SGD_MOMENTUM, 5), f"{mode}, SGD with momentum and weight decay, 5 steps")


def test_an_integer_parameter_is_kept_not_trained(world):
    name = job("int")
    made = world.run({"trainer0": (_try_create_kw, name, dict(model_kwargs={"int_param": True}))})["trainer0"]
    assert made["ok"], f"a model with an integer parameter cannot be served: {made}"
    world.run({"trainer0": (h.train, name, 2)})
    got = world.run({"trainer0": (r.state, name)})["trainer0"]
    assert_close(got, reference((torch.optim.SGD, {"lr": 0.1}), 2, int_param=True), "with an integer parameter")


@pytest.mark.parametrize("mode", ["sync", "async", "half_async", "geo"])
def test_blocks_of_two_dtypes_travel_in_one_message_per_server_and_train_as_torch(world, mode):
    """float32 and float64 parameters on both servers: a server's blocks travel packed, one
    flat tensor per dtype, in one message (a pull, a push); the model trains as plain torch."""
    name = job(f"two-dtypes-{mode}")
    kwargs = dict(ps_mode=mode, model_kwargs={"double_q": True})
    if mode == "half_async":
        kwargs.update(half_async_merge_every=1)
    if mode == "geo":
        kwargs.update(geo_push_every=1)
    layout = world.run({"trainer0": (_create_small_blocks, name, kwargs)})["trainer0"]
    per_server = [[b for b, srv in layout if srv == s] for s in ("ps0", "ps1")]
    assert all(len(blocks) >= 3 for blocks in per_server), layout  # several blocks of a dtype on each
    world.run({"trainer0": (h.train, name, 3)})
    got = world.run({"trainer0": (r.state, name)})["trainer0"]
    # the values grow to ~3e2 in 3 steps; geo adds deltas (float32 rounding of another order)
    assert_close(got, reference((torch.optim.SGD, {"lr": 0.1}), 3, double_q=True), f"{mode}, float32 and float64",
                 atol=1e-3 if mode == "geo" else 1e-6)
    assert got["q"].dtype == torch.float64
    if mode in ("sync", "async"):
        counted = world.run({"trainer0": (h.messages, name)})["trainer0"]
        tensors = counted.pop("tensors")
        assert counted == {"forward": {"ps0": 1, "ps1": 1}, "step": {"ps0": 1, "ps1": 1}}, counted
        # a push carries one flat tensor per dtype its server holds, not one per block
        dtypes = {s: len({str(p) for p, srv in layout_dtypes(layout) if srv == s}) for s in ("ps0", "ps1")}
        assert tensors == dtypes, (tensors, dtypes, layout)


def _create_small_blocks(name, kwargs):  # on trainer0: blocks of 2 elements
    model_kwargs = kwargs.pop("model_kwargs", None)
    return h.create(name, 1, SERVERS, model_kwargs, num_trainers=1, min_block_size=2, **kwargs)


def layout_dtypes(layout: list) -> list[tuple[torch.dtype, str]]:
    """Each block's dtype (q is float64 with ``double_q``) and server, from a create() layout."""
    return [(torch.float64 if block.startswith("q") else torch.float32, server) for block, server in layout]


def _try_create_kw(name, kwargs):  # on trainer0
    return r._attempt(lambda: _create_kw(name, kwargs))


def test_tied_parameters_train_as_one(world):
    name = job("tied")
    world.run({"trainer0": (_create_kw, name, dict(optimizer=ADAM, model_kwargs={"tied": True}))})
    world.run({"trainer0": (h.train, name, 3)})
    got = world.run({"trainer0": (r.state, name)})["trainer0"]
    assert_close(got, reference(ADAM, 3, tied=True), "tied head/tail, Adam, 3 steps")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_module_registered_under_two_names_trains_as_one(world, mode):
    """A layer used twice (the same module under two names) beside tied weights: each forward
    runs on its own copy of the values, installed once per module, so both uses give their
    gradient and training equals torch's (torch's tie_weights left the copies installed)."""
    name = job(f"shared-module-{mode}")
    world.run({"trainer0": (_create_kw, name, dict(optimizer=ADAM, ps_mode=mode,
                                                    model_kwargs={"tied": True, "shared": True}))})
    world.run({"trainer0": (h.train, name, 3)})
    got = world.run({"trainer0": (r.state, name)})["trainer0"]
    assert_close(got, reference(ADAM, 3, tied=True, shared=True), f"{mode}: a layer used twice, Adam, 3 steps")


# ---- checkpoints -------------------------------------------------------------------------------------


def test_a_partial_load_leaves_the_servers_values_of_the_missing_keys(world):
    """load_state_dict(strict=False) with only ``p``: the other parameters keep the servers'
    values, not the trainer's local copy (one step stale after step())."""
    name = job("partial")
    world.run({"trainer0": (_create_kw, name, {})})
    world.run({"trainer0": (h.train, name, 2)})
    got = world.run({"trainer0": (h.partial_load, name, ["p"])})["trainer0"]
    assert "s" in got["missing"], got["missing"]
    for block, before in got["before"].items():
        after = got["after"][block]
        if block.startswith("p."):
            assert torch.equal(after, torch.zeros_like(after)), f"{block} was not loaded: {after}"
        else:
            assert torch.equal(after, before), f"{block} (not in the checkpoint) changed from {before} to {after}"


def test_adam_state_of_a_scalar_parameter_round_trips(world):
    name = job("scalar-adam")
    world.run({"trainer0": (_create_kw, name, dict(optimizer=ADAM))})
    world.run({"trainer0": (h.train, name, 2)})
    sd = world.run({"trainer0": (r.state, name)})["trainer0"]
    osd = world.run({"trainer0": (r.optimizer_state, name)})["trainer0"]
    world.run({"trainer0": (r.load, name, sd, osd)})
    outcome = world.run({"trainer0": (h.try_train, name, 1, 2)})["trainer0"]
    assert outcome["ok"], f"a step after reloading Adam's own state failed: {outcome}"
    got = world.run({"trainer0": (r.state, name)})["trainer0"]
    assert_close(got, reference(ADAM, 3), "Adam, 2 steps, reload, 1 step")


def test_optimizer_state_of_another_shape_is_refused_at_load_naming_the_parameter(world):
    big, small = job("adam16"), job("adam8")
    for name, n in ((big, 16), (small, 8)):
        world.run({"trainer0": (_create_linear, name, n)})
    world.run({"trainer0": (r.push_linear, big, 1)})
    osd = world.run({"trainer0": (r.optimizer_state, big)})["trainer0"]
    outcome = world.run({"trainer0": (h.try_load_optimizer, small, osd)})["trainer0"]
    assert not outcome["ok"], "a 16-element Adam state was loaded onto an 8-element parameter"
    assert outcome["type"] == "ValueError" and "'p'" in outcome["message"], outcome
    world.run({"trainer0": (r.push_linear, small, 1)})  # the job still trains


def _create_linear(name, n):  # on trainer0
    return r.create(name, "linear", 0, SERVERS, {"n": n}, num_trainers=1, optimizer=ADAM, min_block_size=4)


def test_geo_with_an_integer_parameter_trains(world):
    name = job("geo-int")
    world.run({"trainer0": (_create_kw, name, dict(ps_mode="geo", geo_push_every=1, model_kwargs={"int_param": True}))})
    out = world.run({"trainer0": (h.try_train, name, 3)})["trainer0"]
    assert out["ok"], f"geo with an integer parameter: {out}"
    got = world.run({"trainer0": (r.state, name)})["trainer0"]
    assert_close(got, reference((torch.optim.SGD, {"lr": 0.1}), 3, int_param=True), "geo, push every step, 1 trainer")


@pytest.mark.parametrize("split", ["round_robin", "all_on_ps0"])
def test_a_sync_trainer_that_builds_its_psmodel_again_continues_the_job(world, split):
    """A notebook cell run twice, or a restarted trainer: the new PSModel of the same job starts
    at the job's step (not at step 0, refused for good), also when a server holds no block."""
    name = job("rebuilt")
    kwargs = {} if split == "round_robin" else {"split_method": h.all_on_first}
    world.run({"trainer0": (_create_kw, name, dict(kwargs))})
    world.run({"trainer0": (h.train, name, 2)})
    world.run({"trainer0": (_create_kw, name, dict(kwargs))})  # the same job, a fresh model object
    out = world.run({"trainer0": (h.try_train, name, 1, 2)})["trainer0"]
    assert out["ok"], f"step 2 of the rebuilt PSModel: {out}"
    got = world.run({"trainer0": (r.state, name)})["trainer0"]
    assert_close(got, reference((torch.optim.SGD, {"lr": 0.1}), 3), "2 steps, rebuilt, 1 step")


def test_a_psmodel_built_again_right_after_a_step_counts_that_step(world):
    """The cell run again while the last step's pushes are still on their way: the new PSModel
    starts at the step they make (it waits for them), not one step behind, where its next step
    would be taken as a retry of the last one and dropped. The servers hold that push until the
    new model attached, or 2 s (then it was waited for)."""
    name = job("rebuilt-in-flight")
    world.run({"trainer0": (_create_kw, name, {})})
    world.run({"trainer0": (h.train, name, 1)})
    world.run({s: (h.hold_pushes, name, 2.0) for s in SERVERS})
    try:
        world.run({"trainer0": (h.train, name, 1, 1)})  # returns with step 1's pushes held
        world.run({"trainer0": (_create_kw, name, {})})
    finally:
        world.run({s: (h.release_pushes,) for s in SERVERS})
    out = world.run({"trainer0": (h.try_train, name, 1, 2)})["trainer0"]
    assert out["ok"], f"step 2 of the rebuilt PSModel: {out}"
    got = world.run({"trainer0": (r.state, name)})["trainer0"]
    assert_close(got, reference((torch.optim.SGD, {"lr": 0.1}), 3), "2 steps, rebuilt at once, 1 step")


def _create_sync_two(name, kwargs):  # a job of two trainers
    return h.create(name, 1, SERVERS, None, num_trainers=2, min_block_size=4, **kwargs)


def _try_create_sync_two(name, kwargs):
    return r._attempt(lambda: _create_sync_two(name, kwargs))


def test_a_psmodel_built_again_while_its_sync_step_waits_for_another_trainer_says_so_in_its_timeout(world):
    """sync, two trainers, trainer0 steps alone: its step's pushes are answered once trainer1
    pushed that step too. A PSModel built again meanwhile waits for them for its own timeout,
    not the earlier object's (10 s here), then raises CallTimeout saying why, attaching
    nothing; once trainer1 pushed, it is built."""
    name = job("rebuilt-sync-waiting")
    world.run({"trainer0": (_create_sync_two, name, dict(ps_mode="sync", timeout=10.0))})
    world.run({"trainer0": (h.train, name, 1)})  # returns with step 0's pushes waiting for trainer1
    out = world.run({"trainer0": (_try_create_sync_two, name, dict(ps_mode="sync", timeout=TIMEOUT))})["trainer0"]
    assert not out["ok"] and out["type"] == "CallTimeout", out
    assert out["seconds"] < TIMEOUT + 3, out
    assert "in flight" in out["message"] and name in out["message"], out
    world.run({"trainer1": (_create_sync_two, name, dict(ps_mode="sync", timeout=10.0))})
    world.run({"trainer1": (h.train, name, 1)})
    out = world.run({"trainer0": (_try_create_sync_two, name, dict(ps_mode="sync", timeout=TIMEOUT))})["trainer0"]
    assert out["ok"], out


def _create_sync_two_and_train_later(name, kwargs, delay):  # on trainer1
    import time

    time.sleep(delay)
    _create_sync_two(name, kwargs)
    return h.train(name, 1)


def test_a_sync_psmodel_built_again_after_its_step_timed_out_goes_on_at_the_next_step(world):
    """sync, two trainers: trainer0's step 0 is counted on the servers but not answered within
    the earlier object's timeout (trainer1 had not pushed), so the wait of the PSModel built
    again ends without the step applied. It attaches at step 1 (its forward waits for step 0),
    not at step 0, where its first step was taken as a retry of the earlier object's and
    dropped, and the job then stalled at step 1 waiting for trainer0."""
    name = job("rebuilt-sync-timed-out")
    world.run({"trainer0": (_create_sync_two, name, dict(ps_mode="sync", timeout=2.0))})
    world.run({"trainer0": (h.train, name, 1)})  # step 0, waiting for trainer1
    both = world.run({"trainer0": (_try_create_sync_two, name, dict(ps_mode="sync", timeout=10.0)),
                      "trainer1": (_create_sync_two_and_train_later, name, dict(ps_mode="sync", timeout=10.0), 3.0)})
    assert both["trainer0"]["ok"], both
    out = world.run({t: (h.try_train, name, 1, 1) for t in ("trainer0", "trainer1")})
    assert all(o["ok"] for o in out.values()), out
    got = world.run({"trainer1": (r.state, name)})["trainer1"]
    assert_close(got, reference((torch.optim.SGD, {"lr": 0.1}), 2), "2 sync steps, trainer0 built again between")


@pytest.mark.parametrize("opt", ["adagrad", "adam"])
def test_optimizer_state_resliced_from_two_servers_onto_one_continues_as_torch(world, opt):
    optimizer = {"adagrad": (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}), "adam": ADAM}[opt]
    two, one = job(f"{opt}-on-2"), job(f"{opt}-on-1")
    world.run({"trainer0": (_create_kw, two, dict(optimizer=optimizer))})
    world.run({"trainer0": (h.train, two, 2)})
    sd = world.run({"trainer0": (r.state, two)})["trainer0"]
    osd = world.run({"trainer0": (r.optimizer_state, two)})["trainer0"]
    world.run({"trainer0": (_create_on_ps1, one, optimizer)})
    world.run({"trainer0": (r.load, one, sd, osd)})
    world.run({"trainer0": (h.train, one, 1, 2)})
    got = world.run({"trainer0": (r.state, one)})["trainer0"]
    assert_close(got, reference(optimizer, 3), f"{opt}: 2 steps on 2 servers, then 1 on ps1 alone")


def _create_on_ps1(name, optimizer):  # on trainer0
    return h.create(name, 7, ["ps1"], num_trainers=1, min_block_size=4, optimizer=optimizer)


def _wrong_length(block_names, servers):
    return list(servers)[:1]


def _unknown_server(block_names, servers):
    return ["ps9"] * len(block_names)


@pytest.mark.parametrize("kwargs, kind, words", [
    (dict(servers=["ps0", "ps0"]), "ValueError", ["twice", "ps0"]),
    (dict(servers=["ps0", "nobody"]), "ValueError", ["'nobody'"]),
    (dict(servers="ps0"), "TypeError", ["'ps0'"]),
    (dict(ps_mode="asnyc"), "ValueError", ["'asnyc'"]),
    (dict(optimizer=torch.optim.SGD), "TypeError", ["optimizer"]),
    (dict(optimizer=(torch.nn.Linear, {})), "TypeError", ["optimizer"]),
    (dict(optimizer=(torch.optim.SGD, {"lr": -1.0})), "ValueError", ["-1"]),
    (dict(split_method=_wrong_length), "ValueError", ["split_method", "one of the servers"]),
    (dict(split_method=_unknown_server), "ValueError", ["split_method", "'ps9'"]),
])
def test_bad_arguments_fail_at_construction_naming_the_value_and_leave_no_job(world, kwargs, kind, words):
    name = job("bad")
    out = world.run({"trainer0": (_try_create_bad, name, kwargs)})["trainer0"]
    assert not out["ok"] and out["type"] == kind, out
    for word in words:
        assert word in out["message"], (word, out["message"])
    again = world.run({"trainer0": (_try_create_kw, name, {})})["trainer0"]  # the name is still free
    assert again["ok"], f"a good PSModel under the name a bad one failed with: {again}"


def _try_create_bad(name, kwargs):  # on trainer0
    servers = kwargs.pop("servers", SERVERS)
    return r._attempt(lambda: h.create(name, 1, servers, num_trainers=1, min_block_size=4, **kwargs))


def test_a_trainer_listed_among_the_servers_serves_its_blocks(world):
    """Servers need no code of their own, so a trainer may be one (even of its own job): sync,
    2 trainers, servers ps0 and trainer1, as in torch on the global batch."""
    name = job("trainer-serves")
    world.run({t: (_create_with_servers, name, ["ps0", "trainer1"], 2) for t in ("trainer0", "trainer1")})
    world.run({t: (h.train, name, 3) for t in ("trainer0", "trainer1")})
    got = world.run({t: (r.state, name) for t in ("trainer0", "trainer1")})
    expected = reference((torch.optim.SGD, {"lr": 0.1}), 3)  # both trainers see the same data: the mean is it
    for t, state in got.items():
        assert_close(state, expected, f"{t}, servers ps0 and trainer1")


def _create_with_servers(name, servers, n):  # on a trainer
    return h.create(name, 1, servers, num_trainers=n, min_block_size=4)


@pytest.mark.parametrize("mode", ["async", "half_async"])
def test_concurrent_pushes_from_threads_of_one_trainer_lose_nothing(world, mode):
    """4 threads of trainer0 and 1 of trainer1 push gradient 1 (SGD, lr 1) 5 times each, with
    pulls in between: every element moves by exactly 25 once half_async has flushed."""
    name = job(f"threads-{mode}")
    kwargs = dict(num_trainers=2, ps_mode=mode, optimizer=(torch.optim.SGD, {"lr": 1.0}), min_block_size=4,
                  half_async_merge_every=3)
    got = world.run({"trainer0": (_threads, name, 4, kwargs), "trainer1": (_threads, name, 1, kwargs)})
    assert got == {"trainer0": 20, "trainer1": 5}, got
    state = world.run({"trainer1": (_flushed_state, name, kwargs)})["trainer1"]
    assert torch.equal(state["p"], torch.full((16,), -25.0)), f"{mode}: expected -25 everywhere, got {state['p']}"


def _threads(name, threads, kwargs):  # on a trainer
    return h.threads_push(name, threads, 5, **kwargs)


def _flushed_state(name, kwargs):  # on a trainer: a fresh PSModel of the job, flushed
    from remote_module.ps import PSModel

    ps = PSModel(r.build("linear", 0), ["ps0", "ps1"], name=name, **kwargs)
    return dict(ps.state_dict())


# ---- jobs that cannot make progress ------------------------------------------------------------------


def assert_failed_in_time(out: dict, what: str, frozen: str) -> None:
    """The call failed by its own timeout (its error: no answer within TIMEOUT, naming the
    server ``frozen``), while the server was still frozen (thawed only once the outcome is in),
    and not before that timeout (the call was sent after the freeze). The only bound on its
    time is a hang guard: a call that never fails fails the test there."""
    assert not out["ok"] and out["type"] == "CallTimeout", f"{what}: not the timeout's error: {out}"
    assert f"'{frozen}'" in out["message"], f"{what}: the error does not name {frozen!r}: {out}"
    assert f"no answer within {TIMEOUT:g} s" in out["message"], f"{what}: not the call's own timeout: {out}"
    assert out["seconds"] >= TIMEOUT, f"{what}: failed before its timeout: {out}"
    assert out["seconds"] < TIMEOUT + HANG_S, f"{what}: hang guard: no end within timeout + {HANG_S} s: {out}"


def test_more_num_trainers_than_trainers_fails_the_pull_within_the_timeout(world):
    name = job("too-many")
    world.run({t: (_create_two, name, 3) for t in ("trainer0", "trainer1")})
    world.run({t: (r.set_timeout, name, TIMEOUT) for t in ("trainer0", "trainer1")})  # (the step: in flight)
    world.run({t: (h.train, name, 1) for t in ("trainer0", "trainer1")})
    out = world.run({"trainer0": (h.timed, name, "pull")})["trainer0"]
    # the servers' wait for step 0 reached its deadline: none missing of the 2 attached, 1 never attached
    assert_stalled(world, out, name, "a pull of step 1, one of 3 trainers never attached", TIMEOUT, (), never=1)


def _create_two(name, n):  # on a trainer
    return h.create(name, 1, SERVERS, num_trainers=n, min_block_size=4)


# ---- a frozen server (last: it disturbs the world) -----------------------------------------------------


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_frozen_server_is_named_within_the_timeout_and_the_job_continues_after_thawing(world, mode):
    name = job(f"frozen-{mode}")
    world.run({"trainer0": (_create_kw, name, dict(ps_mode=mode))})
    world.run({"trainer0": (r.set_timeout, name, TIMEOUT)})
    world.freeze("ps1")  # stopped before the pull is sent
    try:
        out = world.run({"trainer0": (h.timed, name, "pull")})["trainer0"]
    finally:
        world.thaw("ps1")
    assert_failed_in_time(out, f"{mode}: a pull with ps1 frozen", frozen="ps1")
    world.run({"trainer0": (r.set_timeout, name, HANG_S)})  # (thawed: the calls after must not time out)
    out = world.run({"trainer0": (h.try_train, name, 2)})["trainer0"]
    assert out["ok"], f"{mode}: training after ps1 thawed failed: {out}"
    got = world.run({"trainer0": (r.state, name)})["trainer0"]
    assert_close(got, reference((torch.optim.SGD, {"lr": 0.1}), 2), f"{mode}: 2 steps after a frozen pull")


def test_a_sync_step_that_failed_on_a_frozen_server_can_be_retried_after_thawing(world):
    """Step 0 reaches ps0 but times out on frozen ps1; after the thaw, step() again (the same
    gradients) is neither refused as a second push nor applied twice; training goes on as in torch."""
    name = job("frozen-step-sync")
    world.run({"trainer0": (_create_kw, name, {})})
    world.run({"trainer0": (r.set_timeout, name, TIMEOUT)})
    world.freeze("ps1")  # stopped before the step is sent
    try:
        out = world.run({"trainer0": (h.timed, name, "step")})["trainer0"]
    finally:
        world.thaw("ps1")
    assert_failed_in_time(out, "a sync step with ps1 frozen", frozen="ps1")
    world.run({"trainer0": (r.set_timeout, name, HANG_S)})  # (thawed: the calls after must not time out)
    retried = world.run({"trainer0": (h.retry_step, name)})["trainer0"]
    assert retried["ok"], f"step() retried after ps1 thawed: {retried}"
    world.run({"trainer0": (h.train, name, 2, 1)})
    got = world.run({"trainer0": (r.state, name)})["trainer0"]
    assert_close(got, reference((torch.optim.SGD, {"lr": 0.1}), 3), "a failed, retried step 0, then steps 1-2")
    stats = world.run({"trainer0": (r.stats, name)})["trainer0"]
    assert [st["version"] for st in stats.values()] == [3, 3], stats
