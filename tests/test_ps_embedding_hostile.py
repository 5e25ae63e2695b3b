"""Hostile use of the sharded embedding tables (issue 12) by an ordinary PyTorch user: the
idioms of a training loop (zero_grad between forward and backward, accumulation, backward
twice, steps with nothing to push), checkpoints that do not fit, optimizer state of tables
stepped on some servers only, optimizer settings torch refuses, max pooling with ties and
non-finite rows, two objects of one table, and servers that freeze or die.

Tests that kill nothing share the session's PS world (tests/conftest.py ``ps_world``); the
frozen and killed ranks get a small world of their own, at the end of the file. Local
references are plain torch (tests/_ps_embedding_hostile_remote.py runs the same code)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests import _ps_embedding_hostile_remote as h
from tests._ps_world import job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def world(ps_world):
    return ps_world


def on_trainer0(world, fn, *args, timeout: float = 60.0):
    return world.run({"trainer0": (fn, *args)}, timeout=timeout)["trainer0"]


def local_embedding(optimizer: tuple) -> tuple[nn.Embedding, torch.optim.Optimizer]:
    emb = nn.Embedding(20, 3, sparse=True, _weight=h.weights(0))
    return emb, optimizer[0](emb.parameters(), **optimizer[1])


# ---- a training loop's idioms ---------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", [(torch.optim.SGD, {"lr": 1.0}), (torch.optim.Adagrad, {"lr": 0.5})],
                         ids=["sgd", "adagrad"])
def test_training_loop_idioms_step_the_table_as_torch_steps_a_local_embedding(world, optimizer):
    """zero_grad between forward and backward, two backwards before a step, backward twice,
    steps after a no_grad lookup / with nothing looked up / without backward, zero_grad
    before a step: the rows equal a local nn.Embedding(sparse=True) with the same optimizer."""
    got = on_trainer0(world, h.idioms_sharded, job("idioms"), optimizer)
    emb, opt = local_embedding(optimizer)
    h.idioms(emb, opt.step, opt.zero_grad)
    torch.testing.assert_close(got, emb.weight.detach(), atol=1e-6, rtol=1e-5)


def test_training_loop_idioms_through_a_psmodel_equal_torch(world):
    got = on_trainer0(world, h.idioms_in_psmodel, job("idioms-psm"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 3, sparse=True, _weight=h.weights(0)), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    h.idioms(model, opt.step, opt.zero_grad)
    assert set(got) == set(model.state_dict())
    for key, value in model.state_dict().items():
        torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-5, msg=key)


def test_a_lookup_never_backpropagated_is_freed_with_its_output(world):
    got = on_trainer0(world, h.dropped_lookup_is_freed, job("eval"))
    assert got["alive"] == [False] * 3, f"lookups kept alive after their outputs were dropped: {got}"


# ---- optimizer state of tables stepped on some servers only ------------------------------------------


OPTIMIZERS = {
    "adagrad": (torch.optim.Adagrad, {"lr": 0.5, "lr_decay": 0.1, "initial_accumulator_value": 0.1}),
    "sparse_adam": (torch.optim.SparseAdam, {"lr": 0.1}),
}


def local_steps(optimizer: tuple, steps) -> tuple[nn.Embedding, torch.optim.Optimizer]:
    emb, opt = local_embedding(optimizer)
    h.train_steps(emb, steps, lambda: (opt.step(), opt.zero_grad()))
    return emb, opt


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("side", ["ps1-only", "ps0-only", "one-then-both"])
def test_steps_touching_one_server_and_their_optimizer_state_equal_torch(world, opt, side):
    """A step whose rows all live on one server is still one optimizer step of the table (torch
    counts steps per parameter: Adagrad's lr_decay, SparseAdam's bias correction), and the
    optimizer state of a table whose rows on some server were never stepped is saved and
    loads back, continuing as torch."""
    steps = {"ps1-only": h.ONE_SIDE_THEN_BOTH[0], "ps0-only": h.ONE_SIDE_THEN_BOTH[1],
             "one-then-both": h.ONE_SIDE_THEN_BOTH[0] + h.ONE_SIDE_THEN_BOTH[2]}[side]
    got = on_trainer0(world, h.one_side_state, job(f"osd-{opt}"), OPTIMIZERS[opt], steps)
    emb, torch_opt = local_steps(OPTIMIZERS[opt], steps)
    torch.testing.assert_close(got["rows"], emb.weight.detach(), atol=1e-6, rtol=1e-5)
    assert got["state"]["ok"], f"optimizer_state_dict() of a table stepped on {side}: {got['state']}"
    state = got["state"]["value"]
    touched = sorted({i for ids in steps for i in ids})
    assert state["ids"].tolist() == touched, state
    local_state = torch_opt.state[emb.weight]
    for key in {"adagrad": ["sum"], "sparse_adam": ["exp_avg", "exp_avg_sq"]}[opt]:
        assert key in state, f"{key!r} missing from the saved optimizer state: {sorted(state)}"
        torch.testing.assert_close(state[key], local_state[key][touched], atol=1e-6, rtol=1e-5, msg=key)
    h.train_steps(emb, [[1, 16]], lambda: (torch_opt.step(), torch_opt.zero_grad()))
    torch.testing.assert_close(got["continued"], emb.weight.detach(), atol=1e-6, rtol=1e-5)


# ---- two objects of one table on one trainer --------------------------------------------------------


def test_a_sync_trainer_steps_a_table_through_its_newest_object_and_an_older_one_is_refused(world):
    """Two ShardedEmbedding objects of one sync table on one trainer would push the same step
    twice (the second push replaced the first, silently): the older object's step is refused
    naming the cause, the newer one (a rebuilt model's) trains as the trainer's."""
    name = job("two-objects")
    got = world.run({"trainer0": (h.two_objects_of_one_table, name), "trainer1": (h.one_sync_step, name, [3, 16])})
    older = got["trainer0"]["older"]
    assert not older["ok"] and older["type"] == "ValueError", older
    assert "another ShardedEmbedding" in older["message"] and "'trainer0'" in older["message"], older["message"]
    emb, opt = local_embedding((torch.optim.SGD, {"lr": 1.0}))
    loss = emb(torch.tensor([2, 16])).sum() + emb(torch.tensor([3, 16])).sum()
    (loss / 2).backward()  # sync: the mean of the two trainers' gradients
    opt.step()
    for t in ("trainer0", "trainer1"):
        torch.testing.assert_close(got[t]["rows"] if t == "trainer0" else got[t], emb.weight.detach())


# ---- servers that freeze or die, trainers that die (last: their own world) ----------------------------

TIMEOUT = 2.0
SLACK = 1.0  # a failure is reported at the latest this long after the call's timeout (a loaded machine)


@pytest.fixture(scope="module")
def faulty():
    from tests._ps_world import PSWorld

    with PSWorld({"ps": 2, "trainer": 2}) as w:
        w.killed = set()
        yield w


def assert_named_in_time(outcome: dict, worker: str, what: str) -> None:
    assert not outcome["ok"], f"{what} succeeded: {outcome}"
    assert outcome["seconds"] < TIMEOUT + SLACK, f"{what}: failed too late: {outcome}"
    assert f"'{worker}'" in outcome["message"], f"{what}: the error does not name {worker!r}: {outcome['message']}"


def timed(world, trainer, name, what, ids=None):
    return world.run({trainer: (h.timed, name, what, TIMEOUT, ids)})[trainer]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_frozen_server_is_named_in_time_other_tables_work_and_training_continues_after_the_thaw(faulty, mode):
    """ps1 stopped (SIGSTOP): a lookup and a step of a table with rows on it fail within the
    timeout naming ps1, while a table on ps0 alone keeps working. After SIGCONT, step() again
    retries the failed step (sync: the servers that had it take the retry as a no-op) and the
    rows equal torch's."""
    import os
    import signal

    name, healthy = job(f"frozen-{mode}"), job(f"healthy-{mode}")
    faulty.run({"trainer0": (_prepare_kw, name, [1, 15], {"ps_mode": mode})})
    faulty.run({"trainer0": (_prepare_kw, healthy, [1], {"ps_mode": mode, "servers": ["ps0"]})})
    pid = faulty.procs["ps1"].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        step = timed(faulty, "trainer0", name, "step")
        lookup = timed(faulty, "trainer0", name, "lookup")
        others = [timed(faulty, "trainer0", healthy, what, [1]) for what in ("step", "lookup")]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert_named_in_time(step, "ps1", f"{mode} step")
    assert_named_in_time(lookup, "ps1", f"{mode} lookup")
    assert all(o["ok"] and o["seconds"] < TIMEOUT for o in others), f"a table on ps0 alone, ps1 frozen: {others}"
    if mode == "sync":
        retried = timed(faulty, "trainer0", name, "step")
        assert retried["ok"], f"step() retried after ps1 thawed: {retried}"
        for _ in range(2):
            assert timed(faulty, "trainer0", name, "backward")["ok"]
            assert timed(faulty, "trainer0", name, "step")["ok"]
        rows = timed(faulty, "trainer0", name, "rows")["value"]
        emb, opt = local_steps((torch.optim.SGD, {"lr": 1.0}), [[1, 15]] * 3)
        torch.testing.assert_close(rows, emb.weight.detach())
    else:  # async: the frozen push arrived after the thaw; the table trains on
        assert timed(faulty, "trainer0", name, "backward")["ok"]
        assert timed(faulty, "trainer0", name, "step")["ok"]


def _prepare_kw(name, ids, kwargs):  # on a trainer
    return h.prepare(name, ids, **kwargs)


# ---- max pooling with ties and non-finite rows ------------------------------------------------------


def test_max_pooling_with_ties_and_non_finite_rows_equals_torch_output_and_gradient(world):
    """torch's max keeps a bag's first row and replaces it only by a strictly greater one: a tie
    between rows on different servers goes to the earlier row (so does the gradient), a bag of
    -inf rows is -inf, a NaN in the bag's first row is kept and one later is skipped."""
    got = on_trainer0(world, h.max_pooling, job("max"))
    bag = nn.EmbeddingBag(20, 3, mode="max", _weight=h.max_weights())
    opt = torch.optim.SGD(bag.parameters(), lr=1.0)
    out = h.max_bag_step(bag, opt.step)
    torch.testing.assert_close(got["out"], out, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(got["rows"], bag.weight.detach(), equal_nan=True)


# ---- checkpoints that do not fit ------------------------------------------------------------------------


def test_checkpoints_that_do_not_fit_are_refused_as_torch_refuses_them_and_load_nothing(world):
    """A lazy checkpoint with rows past the table's num_embeddings, or rows of another width, is
    a size mismatch (strict or not, as torch's), before any server is written (nothing is half
    loaded); a key the table does not have is unexpected under strict=True and reported
    otherwise; optimizer state for rows the table does not have is a ValueError naming them."""
    got = on_trainer0(world, h.misfit_checkpoints, job("misfit"))
    for case in ("small strict", "small not strict", "wide"):
        assert not got[case]["ok"] and got[case]["type"] == "RuntimeError", (case, got[case])
        assert "size mismatch" in got[case]["message"], (case, got[case]["message"])
    assert "weight.ids" in got["small strict"]["message"] and "35" in got["small strict"]["message"]
    assert "weight.rows" in got["wide"]["message"], got["wide"]["message"]
    assert not got["small optimizer"]["ok"] and got["small optimizer"]["type"] == "ValueError", got["small optimizer"]
    assert "35" in got["small optimizer"]["message"], got["small optimizer"]["message"]
    strict = got["extra key strict"]
    assert not strict["ok"] and 'Unexpected key(s) in state_dict: "bias"' in strict["message"], strict
    assert got["extra key not strict"] == {**got["extra key not strict"], "ok": True, "value": ["bias"]}
    assert got["unchanged"] == {"small": True, "wide": True, "eager": False}, got["unchanged"]
    torch.testing.assert_close(got["eager rows"], h.weights(2))  # strict=False loaded its weight
    local = nn.Embedding(20, 3)
    with pytest.raises(RuntimeError, match='Unexpected key\\(s\\) in state_dict: "bias"'):
        local.load_state_dict({"weight": h.weights(1), "bias": torch.zeros(3)})  # as torch does


# ---- optimizer settings torch refuses (no RPC) -----------------------------------------------------------


@pytest.mark.parametrize("cls,kwargs,option", [
    (torch.optim.SGD, {"lr": -1.0}, "lr"),
    (torch.optim.SGD, {"lr": 0.1, "nesterov": True}, "nesterov"),
    (torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.1}, "weight_decay"),
    (torch.optim.Adagrad, {"lr": -0.1}, "lr"),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": -1.0}, "lr_decay"),
    (torch.optim.Adagrad, {"lr": 0.1, "eps": -1.0}, "eps"),
    (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": -1.0}, "initial_accumulator_value"),
    (torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 0.1}, "weight_decay"),
    (torch.optim.SparseAdam, {"lr": -0.1}, "lr"),
    (torch.optim.SparseAdam, {"lr": 0.1, "eps": -1.0}, "eps"),
    (torch.optim.SparseAdam, {"lr": 0.1, "betas": (1.5, 0.9)}, "betas"),
    (torch.optim.SparseAdam, {"lr": 0.1, "betas": (0.9, -0.1)}, "betas"),
    (torch.optim.SparseAdam, {"lr": 0.1, "weight_decay": 0.1}, "weight_decay"),
])
def test_optimizer_settings_torch_refuses_are_a_value_error_naming_the_option(cls, kwargs, option):
    """What torch's optimizer (or its sparse step) refuses, a table refuses when it is built,
    not by training in the wrong direction (a negative lr) or by ignoring the setting."""
    from remote_module.ps._rowwise import row_optimizer

    with pytest.raises(ValueError, match=option):
        row_optimizer(cls, kwargs)
    refused = False
    try:  # torch refuses it too: at construction, or at the first sparse step
        weight = nn.Parameter(torch.zeros(4, 2))
        opt = cls([weight], **kwargs)
        weight.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 2), (4, 2))
        opt.step()
    except (ValueError, RuntimeError, TypeError):
        refused = True
    assert refused, f"torch accepts {cls.__name__}({kwargs}) on a sparse gradient"


def test_sgd_momentum_is_refused_saying_why():
    """torch accepts SGD momentum on a sparse gradient, but its buffer then moves every row ever
    touched on every step; a row-wise table cannot, so it refuses, saying so."""
    from remote_module.ps._rowwise import row_optimizer

    with pytest.raises(ValueError, match="momentum.*every row ever touched"):
        row_optimizer(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


# ---- trainers that disagree -------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,words", [
    ({"dim": 4}, ["embedding_dim=3", "asks for 4"]),
    ({"ps_mode": "sync"}, ["ps_mode='async'", "asks for 'sync'"]),
    ({"optimizer": (torch.optim.Adagrad, {"lr": 1.0})}, ["optimizer=RowOptimizer(kind='sgd'", "asks for RowOptimizer(kind='adagrad'"]),
    ({"init": "lazy"}, ["init='eager'", "asks for 'lazy'"]),
    ({"servers": ["ps1", "ps0"]}, ["servers", "same order", "[(0, 10)]", "[(10, 10)]"]),
])
def test_a_trainer_attaching_with_other_arguments_is_told_which(world, kwargs, words):
    name = job("mismatch")
    on_trainer0(world, h.table_named, name)
    got = world.run({"trainer1": (h.mismatched_attach, name, kwargs)})["trainer1"]
    assert not got["ok"] and got["type"] == "ValueError", got
    for word in words:
        assert word in got["message"].split("\n")[0], (word, got["message"])


def test_a_trainer_killed_in_a_sync_step_is_named_by_the_others_next_lookup_in_time(faulty):
    """Both trainers attached and looked up; trainer1 is killed before its push: trainer0's push
    goes through, its next lookup fails within the timeout naming trainer1 (not itself), the
    waiting lookups are gone from the servers, and nothing was settled twice."""
    name = job("killed-trainer")
    faulty.run({t: (_prepare_kw, name, [1, 15], {"ps_mode": "sync", "num_trainers": 2}) for t in ("trainer0", "trainer1")})
    faulty.kill("trainer1")
    step = timed(faulty, "trainer0", name, "step")
    assert step["ok"], f"trainer0's push needs no other trainer: {step}"
    lookup = timed(faulty, "trainer0", name, "lookup")
    assert_named_in_time(lookup, "trainer1", "the lookup waiting for step 0")
    assert lookup["type"] == "CallTimeout", lookup
    assert "'trainer0'" not in lookup["message"].split("waiting for gradients from")[-1].split("\n")[0], lookup
    assert faulty.run({s: (h.waiters, name) for s in ("ps0", "ps1")}) == {"ps0": 0, "ps1": 0}
    assert "settling a remote call's future failed" not in faulty.stderr_tail(100_000)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_killed_server_is_named_by_lookup_and_step_and_tables_elsewhere_keep_working(faulty, mode):
    """ps1 killed (SIGKILL): a table with rows on it fails lookups and steps in time naming ps1;
    a table on ps0 alone trains on."""
    name, healthy = f"killed-server-{mode}", f"killed-server-healthy-{mode}"
    if "ps1" not in faulty.killed:
        for m in ("sync", "async"):
            faulty.run({"trainer0": (_prepare_kw, f"killed-server-{m}", [1, 15], {"ps_mode": m})})
            faulty.run({"trainer0": (_prepare_kw, f"killed-server-healthy-{m}", [1], {"ps_mode": m, "servers": ["ps0"]})})
        faulty.kill("ps1")
        faulty.killed.add("ps1")
    for what in ("step", "lookup"):
        assert_named_in_time(timed(faulty, "trainer0", name, what), "ps1", f"{mode} {what}")
    for what in ("step", "backward", "step", "lookup"):
        out = timed(faulty, "trainer0", healthy, what, [1])
        assert out["ok"], f"{mode}: {what} of a table on ps0 alone, ps1 dead: {out}"


# ---- memory on the servers ----------------------------------------------------------------------------


def test_an_eager_table_costs_its_rows_and_a_lazy_ones_optimizer_state_grows_per_touched_row(world):
    """1,000,000 x 16 float32 rows are 64 MB over the two servers, eagerly; a lazy table with
    SparseAdam stepped on 1,000 rows holds those rows and their two moments only."""
    servers = ("ps0", "ps1")
    before = world.run({s: (h.rss_bytes,) for s in servers})
    name = job("memory")
    on_trainer0(world, h.big_tables, name)
    after = world.run({s: (h.rss_bytes,) for s in servers})
    eager = world.run({s: (h.table_bytes, name + "-eager") for s in servers})
    lazy = world.run({s: (h.table_bytes, name + "-lazy") for s in servers})
    assert sum(eager.values()) == 1_000_000 * 16 * 4, eager  # rows only: no state before a step
    assert sum(lazy.values()) == 1000 * 16 * 4 * 3, lazy  # rows, exp_avg, exp_avg_sq of the touched rows
    grown = sum(after[s] - before[s] for s in servers)
    assert grown < 64e6 + 32e6, f"the servers grew by {grown / 1e6:.0f} MB for a 64 MB table and 1,000 lazy rows"


# ---- threads, a tied table, a load while another trainer trains ------------------------------------------


def test_threads_of_one_trainer_sharing_an_async_table_lose_no_gradient(world):
    got = on_trainer0(world, h.threads_train, job("threads"), 4, 5)
    assert got["errors"] == [], got["errors"]
    expected = h.weights(0)
    for k in range(4):  # 5 steps each: row k gets gradient 2 per step, row 10 + k gets 1
        expected[k] -= 2 * 5
        expected[10 + k] -= 5
    torch.testing.assert_close(got["rows"], expected)


def test_a_table_used_in_two_places_of_a_psmodel_trains_as_one_local_embedding(world):
    got = on_trainer0(world, h.tied_in_psmodel, job("tied"))
    model = h.Tied(nn.Embedding(20, 3, sparse=True, _weight=h.weights(0)))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    h.tied_train(model, opt.step, opt.zero_grad)
    assert list(got) == list(model.state_dict())  # both places' keys, as torch's
    for key, value in model.state_dict().items():
        torch.testing.assert_close(got[key], value, msg=key)


def test_a_checkpoint_loaded_while_another_trainer_trains_leaves_a_consistent_table(world):
    """trainer1 steps rows 2 and 12 while trainer0 loads a checkpoint again and again: both
    finish, and every row trainer1 does not touch is the checkpoint's."""
    name = job("load-while-training")
    got = world.run({"trainer1": (h.train_while_loaded, name, 30), "trainer0": (h.load_while_trained, name, 10)})
    rows, expected = got["trainer0"]["rows"], h.weights(3)
    others = [i for i in range(20) if i not in (2, 12)]
    torch.testing.assert_close(rows[others], expected[others], atol=0, rtol=0)
    moved = rows[[2, 12]] - expected[[2, 12]]  # by a whole number of steps since the last load
    torch.testing.assert_close(moved, moved.round(), atol=1e-5, rtol=0)
    assert bool((moved.round() <= 0).all()), moved


# ---- inputs of every odd shape ------------------------------------------------------------------------------


def test_odd_inputs_give_torchs_outputs_dtype_and_refusals(world):
    """Empty inputs and bags, 0-d input, int32 ids and offsets, huge bags, duplicate ids, ids on
    the block boundary, padding_idx=-1, and per_sample_weights / offsets torch refuses."""
    got = on_trainer0(world, h.odd_lookups, job("odd"))
    expected = h.odd_lookups(None)
    assert list(got) == list(expected)
    # torch refuses decreasing offsets only when it runs on several threads (on one, as the
    # trainers here, it returns uninitialised memory): the table refuses them, saying so
    decreasing = expected.pop("offsets decreasing")
    assert decreasing[0] == "RuntimeError", decreasing
    assert got["offsets decreasing"][0] == "ValueError" and "offsets[2]=1" in got["offsets decreasing"][1], got
    for case, want in expected.items():
        if isinstance(want[0], str):
            assert got[case] == want, f"{case}: torch refuses with {want}, the table with {got[case]}"
        else:
            assert got[case][0] == want[0] == torch.float32, (case, got[case][0], want[0])
            torch.testing.assert_close(got[case][1], want[1], atol=1e-5, rtol=1e-6, msg=case)


def test_the_optimizer_state_of_a_table_never_stepped_round_trips(world):
    got = on_trainer0(world, h.never_stepped, job("never"))
    assert got["state"]["step"] == 0 and got["state"]["ids"].numel() == 0, got["state"]
    emb, opt = local_steps((torch.optim.Adagrad, {"lr": 0.5}), [[1, 15]])
    torch.testing.assert_close(got["rows"], emb.weight.detach())


def test_lookups_in_flight_when_the_trainer_leaves_rpc_fail_saying_so_and_none_hangs(faulty, tmp_path):
    """Last in the file: trainer0's RPC agent is shut down (not gracefully: the servers of this
    world wait in their own shutdown) under three looping lookups: every thread ends with an
    error naming the server or saying to call init_rpc."""
    import json
    import time

    path = tmp_path / "outcomes.json"
    faulty.run({"trainer0": (h.shutdown_during_lookups, job("shutdown"), str(path))})
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, "the lookups did not end within 30 s of the shutdown"
        time.sleep(0.1)
    got = json.loads(path.read_text())
    assert got["ended"] == [True] * 3, got
    for outcome in got["outcomes"]:  # in flight, not sent, or made after: each says where or what
        assert outcome["type"] == "RuntimeError", outcome
        assert "'ps0'" in outcome["message"] or "init_rpc" in outcome["message"], outcome
