"""Hostile use of the sharded embedding tables (issue 12) by an ordinary PyTorch user: the
idioms of a training loop (zero_grad between forward and backward, accumulation, backward
twice, steps with nothing to push), optimizer state of tables stepped on some servers only,
two objects of one table, max pooling with ties and non-finite rows, checkpoints that do not
fit, trainers that disagree, server memory, threads, a tied table, odd inputs.

These kill nothing: they share the session's PS world (tests/conftest.py ``ps_world``). Frozen
and killed ranks: tests/ps/test_embedding_faults.py; optimizer settings: tests/ps/test_rowwise.py.
Local references are plain torch running the same code (tests/ps/_embedding_edge_cases_remote.py,
tests/ps/_embedding_inputs_remote.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.ps import _embedding_edge_cases_remote as h
from tests.ps import _embedding_inputs_remote as inputs
from tests.ps._world import job

pytestmark = pytest.mark.slow


@pytest.fixture
def world(ps_world):
    return ps_world


def on_trainer0(world, fn, *args):
    return world.run({"trainer0": (fn, *args)})["trainer0"]


# ---- a training loop's idioms ---------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", [(torch.optim.SGD, {"lr": 1.0}), (torch.optim.Adagrad, {"lr": 0.5})],
                         ids=["sgd", "adagrad"])
def test_training_loop_idioms_step_the_table_as_torch_steps_a_local_embedding(world, optimizer):
    """zero_grad between forward and backward, two backwards before a step, backward twice,
    steps after a no_grad lookup / with nothing looked up / without backward, zero_grad
    before a step: the rows equal a local nn.Embedding(sparse=True) with the same optimizer."""
    got = on_trainer0(world, h.idioms_sharded, job("idioms"), optimizer)
    emb, opt = h.local_embedding(optimizer)
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


def test_a_table_can_be_deep_copied_and_pickled_and_copies_share_its_rows_not_its_gradients(world):
    got = on_trainer0(world, h.copies, job("copies"))
    expected = h.weights(0)[[1, 15]] - 1.0  # one step of gradient 1, lr 1: pushed once
    for key in ("original", "deep", "unpickled"):
        torch.testing.assert_close(got[key], expected, msg=key)


def test_a_table_moved_to_meta_and_back_with_to_empty_still_finds_its_servers(world):
    """model.to("meta") then model.to_empty(device="cpu") leaves a table's lookups and steps as
    they were: its rows live on the servers, and which server holds an id is not the module's
    tensor state (it was a buffer, which to_empty left uninitialised)."""
    got = on_trainer0(world, h.deferred_init, job("deferred-init"))
    torch.testing.assert_close(got["after"], got["before"], rtol=0, atol=0)
    expected = h.weights(0)
    expected[[1, 15, 9, 19, 0]] -= 1.0
    torch.testing.assert_close(got["rows"], expected)


def test_torch_save_of_a_model_holding_a_table_warns_that_its_rows_are_not_saved(world):
    """guoyang9/NCF keeps its best model with torch.save(model, path): with a sharded table the
    file holds no rows, so it warns, at the user's line; deepcopy and pickle (copies sharing
    the servers' rows, documented) stay silent."""
    got = on_trainer0(world, h.saved_whole, job("saved-whole"))
    for save in ("torch.save", "legacy torch.save"):  # (the legacy format: _use_new_zipfile_serialization=False)
        assert len(got[save]) == 1, got
        message, filename = got[save][0]
        assert "not their rows" in message and "state_dict()" in message, message
        assert filename == h.__file__, filename
    assert got["deepcopy"] == [] and got["pickle"] == [], got


def test_a_lookup_never_backpropagated_is_freed_with_its_output(world):
    got = on_trainer0(world, h.dropped_lookup_is_freed, job("eval"))
    assert got["alive"] == [False] * 3, f"lookups kept alive after their outputs were dropped: {got}"


# ---- optimizer state of tables stepped on some servers only ------------------------------------------


OPTIMIZERS = {
    "adagrad": (torch.optim.Adagrad, {"lr": 0.5, "lr_decay": 0.1, "initial_accumulator_value": 0.1}),
    "sparse_adam": (torch.optim.SparseAdam, {"lr": 0.1}),
}


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
    emb, torch_opt = h.local_steps(OPTIMIZERS[opt], steps)
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
    emb, opt = h.local_embedding((torch.optim.SGD, {"lr": 1.0}))
    loss = emb(torch.tensor([2, 16])).sum() + emb(torch.tensor([3, 16])).sum()
    (loss / 2).backward()  # sync: the mean of the two trainers' gradients
    opt.step()
    for t in ("trainer0", "trainer1"):
        torch.testing.assert_close(got[t]["rows"] if t == "trainer0" else got[t], emb.weight.detach())


# ---- max pooling with ties and non-finite rows ------------------------------------------------------


def test_max_pooling_with_ties_and_non_finite_rows_equals_torch_output_and_gradient(world):
    """torch's max keeps a bag's first row and replaces it only by a strictly greater one: a tie
    between rows on different servers goes to the earlier row (so does the gradient), a bag of
    -inf rows is -inf, a NaN in the bag's first row is kept and one later is skipped."""
    got = on_trainer0(world, inputs.max_pooling, job("max"))
    bag = nn.EmbeddingBag(20, 3, mode="max", _weight=inputs.max_weights())
    opt = torch.optim.SGD(bag.parameters(), lr=1.0)
    out = inputs.max_bag_step(bag, opt.step)
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


# ---- trainers that disagree -------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,words", [
    ({"dim": 4}, ["embedding_dim=3", "asks for 4"]),
    ({"ps_mode": "sync"}, ["ps_mode='async'", "asks for 'sync'"]),
    ({"optimizer": (torch.optim.Adagrad, {"lr": 1.0})},
     ["optimizer=RowOptimizer(kind='sgd'", "asks for RowOptimizer(kind='adagrad'"]),
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


@pytest.mark.parametrize("grad,layout", [(True, "two servers"), (False, "two servers"), (True, "one server"),
                                         (False, "one server"), (False, "one server, lazy"),
                                         (False, "one server, two blocks")])
def test_odd_inputs_give_torchs_outputs_dtype_and_refusals(world, grad, layout):
    """Empty inputs and bags, 0-d input, int32 ids and offsets, huge bags, duplicate ids, ids on
    the block boundary, padding_idx=-1, and per_sample_weights / offsets torch refuses; with
    grad on, and under no_grad (a shorter path on the trainer; none at all for a table held
    whole by one server, whose server checks and pools the arguments as given: eager, lazy,
    in two blocks; its outputs then equal torch's bit for bit)."""
    got = on_trainer0(world, inputs.odd_lookups, job("odd"), grad, layout)
    expected = inputs.odd_lookups(None, grad)
    assert list(got) == list(expected)
    # torch refuses decreasing offsets only when it runs on several threads (on one, as the
    # trainers and, under tests/conftest.py, this process, it returns uninitialised memory): the
    # table refuses them, saying so
    expected.pop("offsets decreasing")
    assert got["offsets decreasing"][0] == "ValueError" and "offsets[2]=1" in got["offsets decreasing"][1], got
    for case, want in expected.items():
        if isinstance(want[0], str):
            assert got[case] == want, f"{case}: torch refuses with {want}, the table with {got[case]}"
        else:
            assert got[case][0] == want[0] == torch.float32, (case, got[case][0], want[0])
            if not grad and layout != "two servers":  # pooled by the server as torch pools
                assert torch.equal(got[case][1], want[1]), (case, got[case][1], want[1])
            torch.testing.assert_close(got[case][1], want[1], atol=1e-5, rtol=1e-6, msg=case)


def test_the_optimizer_state_of_a_table_never_stepped_round_trips(world):
    got = on_trainer0(world, h.never_stepped, job("never"))
    assert got["state"]["step"] == 0 and got["state"]["ids"].numel() == 0, got["state"]
    emb, opt = h.local_steps((torch.optim.Adagrad, {"lr": 0.5}), [[1, 15]])
    torch.testing.assert_close(got["rows"], emb.weight.detach())


# ---- a ported model's constructor calls and print(model) ----------------------------------------------------


def test_torchs_sparse_keyword_is_taken_and_print_shows_the_tables_sizes(world):
    """A port of ``nn.EmbeddingBag(n, m, mode="sum", sparse=True)`` (facebookresearch/dlrm) keeps
    ``sparse=`` (the rows' gradients are per row either way), and ``print(model)`` shows each
    table's sizes and mode as torch's modules do, plus where it lives."""
    got = on_trainer0(world, h.ported_constructors, job("ported"))
    assert got["sparse"] == (True, False)
    assert got["moved"].abs().sum() > 0  # it trains
    assert got["bag"].startswith("ShardedEmbeddingBag(20, 3, mode='sum', sparse=True, name='ported-"), got["bag"]
    assert "servers=['ps0', 'ps1'], ps_mode='async'" in got["bag"], got["bag"]
    assert got["emb"].startswith("ShardedEmbedding(20, 3, padding_idx=2, name='ported-"), got["emb"]


def test_include_last_offset_bags_equal_torchs_and_other_keywords_are_refused_clearly(world):
    """torch's CSR offsets (``include_last_offset=True``), as a port from torchrec-style code
    passes them: outputs and one SGD step equal nn.EmbeddingBag's in every mode, alone and in a
    collection; no offsets refused as torch refuses them; a last offset that is not the
    input's length refused, saying so (torch's mean then divides the last bag by the rest of
    the input). max_norm and scale_grad_by_freq are refused, naming them."""
    got = on_trainer0(world, inputs.last_offset_lookups, job("last-offset"))
    want = inputs.last_offset_lookups(None)
    for mode in ("sum", "mean", "max"):
        torch.testing.assert_close(got[mode][0], want[mode][0], atol=1e-6, rtol=0, msg=mode)
        torch.testing.assert_close(got[mode][1], want[mode][1], atol=1e-6, rtol=0, msg=mode)
    assert got["no offsets"] == want["no offsets"]
    assert got["last not the end"][0] == "ValueError" and "the last offset must be the input's length 6" in \
        got["last not the end"][1], got
    from remote_module.ps import ShardedEmbeddingBag

    for kwargs, words in (({"max_norm": 1.0}, "max_norm is not supported"),
                          ({"scale_grad_by_freq": True}, "scale_grad_by_freq=True is not supported")):
        with pytest.raises(ValueError, match=words):
            ShardedEmbeddingBag(10, 2, ["ps0"], name="never-made", **kwargs)


@pytest.mark.parametrize("servers", [["ps0"], ["ps0", "ps1"]], ids=["one_server", "two_servers"])
def test_a_bag_table_reusing_its_last_bags_pools_and_trains_as_torch_when_they_change(world, servers):
    """A bag table keeps its last lookup's bags (offsets, input shape) and reuses them when the next
    lookup's are equal: lookups with the same offsets, offsets the caller changed in place after
    the lookup, decreasing offsets (refused: ValueError, nothing trained), the same offsets over
    more ids, and 2-d inputs of two shapes pool and train as a local nn.EmbeddingBag(sparse=True)
    with SGD, lookup by lookup (atol 1e-6, rtol 1e-5)."""
    got = on_trainer0(world, h.same_bags_sharded, job("same-bags"), servers)
    local = nn.EmbeddingBag(20, 3, mode="sum", sparse=True, _weight=h.weights(0).clone())
    opt = torch.optim.SGD(local.parameters(), lr=1.0)

    def step():
        opt.step()
        opt.zero_grad()

    def checked(ids, offsets):  # (torch checks decreasing offsets only when it pools on several threads)
        if offsets is not None and offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError("offsets decrease")
        return local(ids, offsets)

    want = h.same_bags_lookups(checked, step)
    assert [type(g).__name__ if isinstance(g, str) else "tensor" for g in got["outputs"]] == (
        [type(w).__name__ if isinstance(w, str) else "tensor" for w in want])
    assert "ValueError" in got["outputs"]
    for k, (g, w) in enumerate(zip(got["outputs"], want)):
        if isinstance(g, str):
            assert g == w, k
        else:
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"lookup {k}: {m}")
    torch.testing.assert_close(got["weight"], local.weight.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("servers", [["ps0"], ["ps0", "ps1"]], ids=["one_server", "two_servers"])
def test_a_bag_table_pickles_without_its_last_lookups_bags(world, servers):
    """A bag table keeps its last lookup's bags (as big as the batch) for the next lookup; a
    deep copy or pickle of it (torch.save(model), an RPC argument) carries none of them, and the
    copies pool as the table."""
    got = on_trainer0(world, h.pickled_sizes_around_a_lookup, job("bags-pickled"), servers, 40_000)
    assert got["after"] < got["before"] + 4_000, got
    for copied in got["copies"]:
        torch.testing.assert_close(copied, got["out"])


def _local_sgd_bag(mode):
    """A local nn.EmbeddingBag(sparse=True) of ``mode`` over the sharded tables' rows and a step()
    of SGD (lr 1.0) + zero_grad(), as the sharded table's step() pushes and forgets."""
    local = nn.EmbeddingBag(20, 3, mode=mode, sparse=True, _weight=h.weights(0).clone())
    opt = torch.optim.SGD(local.parameters(), lr=1.0)

    def step():
        opt.step()
        opt.zero_grad()
    return local, step


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_a_bag_lookups_gradient_is_pushed_as_its_bags_gradient_and_trains_as_torch(world, mode):
    """A float32 sum or mean lookup without padding row or weights pushes its pooled bags'
    gradient with the ids it sent each server (the servers compute the rows' gradients): an
    empty bag, a server with none of the ids (an empty push), two lookups in one step (pushed
    as rows, computed on the trainer) and a 2-d input train as a local
    nn.EmbeddingBag(sparse=True) + SGD (atol 1e-6, rtol 1e-5). A step of one 1-d lookup pushes
    ids (int32) + bag starts (int64) + bags' gradients per server called, not a row per
    distinct id, and only the bags with ids there."""
    got = on_trainer0(world, h.bags_form_sharded, job(f"bags-form-{mode}"), mode)
    local, step = _local_sgd_bag(mode)
    h.bags_form_steps(local, step)
    torch.testing.assert_close(got["weight"], local.weight.detach(), atol=1e-6, rtol=1e-5)
    dim = 3
    # step 0: ids 1, 2, 4, 5, 4 on ps0 (rows 0-9) in 3 of the 4 bags (one is empty), 19 on ps1 in
    # the last: each server gets the gradient of the bags with ids there
    assert got["pushed"][0] == (5 * 4 + 3 * 8 + 3 * dim * 4) + (1 * 4 + 1 * 8 + 1 * dim * 4), got["pushed"]
    # step 1: ps0 only (ps1's push is empty)
    assert got["pushed"][1] == 4 * 4 + 2 * 8 + 2 * dim * 4, got["pushed"]
    # step 2: two lookups: each one's rows (0, 11, 12, then 5, 11) as (int64 id, 3 floats)
    assert got["pushed"][2] == 5 * (8 + dim * 4), got["pushed"]


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_a_bag_lookups_gradient_given_by_the_caller_is_pushed_as_it_was_at_backward(world, mode):
    """out.backward(g) from a tensor the caller refills before the step (a reused buffer): the
    step pushes the gradient backward was given, as a local nn.EmbeddingBag(sparse=True) +
    SGD trains (its backward used it), for one lookup (the bags' form) and two (rows)."""
    got = on_trainer0(world, h.bags_form_given_gradient_sharded, job(f"bags-form-given-{mode}"), mode)
    local, step = _local_sgd_bag(mode)
    h.bags_form_given_gradient(local, step)
    step()
    torch.testing.assert_close(got, local.weight.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("servers", [1, 2])
def test_ids_changed_in_place_after_backward_do_not_move_the_step(world, servers):
    """As torch's gradient is the forward's ids', whatever the caller does to its id tensor
    after backward (a reused batch buffer): the step pushes to the rows looked up, also where
    the ids travel as int64 (a table of more than 2**31 rows) and one server holds them all."""
    got = on_trainer0(world, h.ids_changed_before_step, job(f"ids-changed-{servers}"), servers)
    want = torch.ones(10, 2)
    want[5:8] = 0.0
    torch.testing.assert_close(got, want, atol=0, rtol=0)
