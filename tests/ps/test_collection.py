"""ShardedEmbeddingBagCollection: several tables looked up and pushed together, one message per
server, each table trained exactly as alone and as a local nn.EmbeddingBag (issue 24)."""

from __future__ import annotations

import pytest
import torch

from tests.ps import _collection_remote as r
from tests.ps._world import job as name

pytestmark = pytest.mark.slow


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def local_reference(steps):
    tables = r.local_tables()
    sparse = {k: t.mode != "max" for k, t in tables.items()}  # torch cannot make a max bag sparse
    local = {k: torch.nn.EmbeddingBag(t.num_embeddings, 4, mode=t.mode, padding_idx=t.padding_idx, sparse=sparse[k])
             for k, t in tables.items()}
    for k in local:
        local[k].load_state_dict(tables[k].state_dict())
    opts = [torch.optim.Adagrad(t.parameters(), lr=0.2) for t in local.values()]
    outs = []
    for feats, targets in r.features(1, steps):
        got = {k: local[k](*(v if isinstance(v, tuple) else (v,))) for k, v in feats.items()}
        outs.append({k: v.detach() for k, v in got.items()})
        for opt in opts:
            opt.zero_grad()
        sum(((got[k] - targets[k]) ** 2).sum() for k in got).backward()
        for opt in opts:
            opt.step()
    return outs, {f"{k}.weight": t.weight.detach() for k, t in local.items()}


@pytest.mark.parametrize("ps_mode", ["async", "sync"])
def test_a_collection_trains_each_table_as_alone_and_as_local_torch(world, ps_mode):
    got = world.run({"trainer0": (r.train, name("ebc"), 3, ps_mode, True),
                     "trainer1": (r.train, name("alone"), 3, ps_mode, False)})
    together, alone = got["trainer0"], got["trainer1"]
    outs, weights = local_reference(3)
    for step in range(3):
        for k in r.SPECS:
            assert torch.equal(together["outs"][step][k], alone["outs"][step][k])  # the same server work
            torch.testing.assert_close(together["outs"][step][k], outs[step][k], atol=1e-6, rtol=1e-5)
    for k, w in weights.items():
        assert torch.equal(together["weights"][k], alone["weights"][k])
        torch.testing.assert_close(together["weights"][k], w, atol=1e-6, rtol=1e-5)
        assert not torch.equal(w, r.local_tables()[k.split(".")[0]].weight.detach())  # it trained


@pytest.mark.parametrize("ps_mode", ["async", "sync"])
def test_one_message_per_server_for_a_forward_and_for_a_step(world, ps_mode):
    got = world.run({"trainer0": (r.messages, name("msgs"), ps_mode)})["trainer0"]
    # three tables, each on both servers: one lookup and one push message per server
    assert got == {"forward": {"ps0": 1, "ps1": 1}, "step": {"ps0": 1, "ps1": 1}}


def test_bad_collections_and_inputs_are_refused_naming_the_table(world):
    texts = world.run({"trainer0": (r.refusals, name("bad"))})["trainer0"]
    missing, unknown, too_long, mixed, not_bag, empty, no_table, twice, out_of_range, lists_ok, mapping = texts
    assert missing.startswith("KeyError") and "no input for table 'users'" in missing
    assert unknown.startswith("KeyError") and "no table 'nope'" in unknown
    assert too_long.startswith("TypeError") and "'tags'" in too_long
    assert mixed.startswith("ValueError") and "table 'b' has ps_mode='sync'" in mixed
    assert not_bag.startswith("TypeError") and "table 'a' must be a ShardedEmbeddingBag" in not_bag
    assert empty.startswith("TypeError")
    assert no_table.startswith("KeyError") and "'nope'" in no_table
    assert twice.startswith("ValueError") and "'a' and 'b' are the same table object" in twice
    assert out_of_range.startswith("IndexError") and "table 'users'" in out_of_range
    assert lists_ok == "True"  # (input, offsets) given as a list, as a tuple
    assert mapping == "3 ['items', 'users', 'tags'] True True"


def test_arguments_of_bags_pooled_on_the_trainer_are_refused_before_sending_naming_the_table(world):
    # per_sample_weights needing a gradient, and geo mode, fetch the rows and pool them here:
    # torch's refusals come before anything is sent, as on the other paths, naming the table
    got = world.run({"trainer0": (r.pooled_here_refusals, name("pooled-here"))})["trainer0"]
    for case, (kind, table) in {"weights with mean": ("NotImplementedError", "users"),
                                "weights too short": ("ValueError", "items"),
                                "geo 2-d input with offsets": ("ValueError", "users")}.items():
        text, sent = got[case]
        assert text.startswith(f"{kind}: ShardedEmbeddingBagCollection table {table!r}: "), (case, text)
        assert sent == {}, (case, sent)


def test_checkpoints_use_the_table_names_and_load_into_another_collection_local_bags_and_three_servers(world):
    got = world.run({"trainer0": (r.checkpoints, name("ckpt"))})["trainer0"]
    assert got["keys"] == ["items.weight", "tags.weight", "users.weight"]
    assert got["same_state"] and got["same_optimizer_state"]
    assert got["local_outputs"], "a collection's state_dict loaded into local nn.EmbeddingBags gives other outputs"
    assert got["resliced"] and got["moved"], "re-sliced onto three servers, the next step differs"


def test_an_optimizer_state_loaded_into_live_tables_replaces_theirs_as_torch_does(world):
    # rows stepped after the checkpoint have no state in it: loading it leaves them none, as a
    # torch optimizer's load_state_dict replaces its whole state (Adagrad: the next step of such
    # a row starts from the initial accumulator again)
    rolled, straight = world.run({"trainer0": (r.rollback, name("rollback"))})["trainer0"]
    for k in straight[0]:
        assert torch.equal(rolled[0][k], straight[0][k]), k
    for table, state in straight[1].items():
        assert rolled[1][table]["step"] == state["step"]
        assert torch.equal(rolled[1][table]["ids"], state["ids"]), table
        assert torch.equal(rolled[1][table]["sum"], state["sum"]), table


@pytest.mark.parametrize("how", ["refused", "packed"])
def test_a_step_whose_pushes_of_one_table_fail_keeps_that_tables_gradients_only(world, how):
    # each table succeeds or fails as its own step() would: a retry pushes the failed one only
    # ("packed": the failing pushes travel in one call per server with the other tables')
    got = world.run({"trainer0": (r.partial_failure, name(f"partial-{how}"), how)})["trainer0"]
    if how == "refused":
        assert "push refused" in got["error"] and "ps0" in got["error"]
    else:
        assert got["error"].startswith("LookupError: no sharded table") and "-missing'" in got["error"], got
        assert "'ps0'" in got["error"] or "'ps1'" in got["error"], got
    assert got["others_stepped_once"] and got["users_stepped_by_retry"] and got["as_if_nothing_failed"]


def test_a_sync_step_retried_after_one_table_failed_keeps_the_trainers_in_step(world):
    # the retry pushes the failed table only: a second push of a table stepped already would be
    # taken for its next round, one step ahead of the other trainer for good (lookups stall)
    trainers = ("trainer0", "trainer1")
    failed_job, clean_job = name("sync-retry"), name("sync-clean")
    failed = world.run({t: (r.sync_retry, failed_job, True) for t in trainers})
    clean = world.run({t: (r.sync_retry, clean_job, False) for t in trainers})
    for t in trainers:
        assert failed[t]["steps"] == clean[t]["steps"] == {k: 3 for k in r.SPECS}, (t, failed[t]["steps"])
        assert not isinstance(failed[t]["weights"], str), failed[t]["weights"]
        for k, w in clean[t]["weights"].items():
            assert torch.equal(failed[t]["weights"][k], w), k


def test_a_psmodel_step_sends_its_dense_blocks_and_tables_in_one_message_per_server(world):
    got = world.run({"trainer0": (r.psmodel_step_messages, name("psmodel"))})["trainer0"]
    assert got["messages"] == {"ps0": 1, "ps1": 1}
    assert got["changed"] == ["dense.bias", "dense.weight", "tables.items.weight", "tables.tags.weight",
                              "tables.users.weight"]


def test_a_psmodel_step_that_cannot_be_sent_keeps_every_parts_gradients(world):
    got = world.run({"trainer0": (r.psmodel_unsendable_step, name("unsendable"))})["trainer0"]
    assert "could not be sent" in got["error"]
    assert got["same"] == got["keys"]  # the retry pushed everything once: as a model that stepped once



# ---- plain sum / mean tables, planned together ---------------------------------------------------


@pytest.mark.parametrize("ps_mode", ["async", "half_async", "sync"])
def test_plain_tables_planned_together_equal_the_tables_alone_bit_for_bit(world, ps_mode):
    """Sum and mean tables with plain inputs (1-d ids with offsets, an empty bag, 2-d ids) are
    checked, deduplicated and split by server together (ps._packed), beside a max table and a
    frozen one: outputs, no_grad outputs after each step and weights equal the same tables used
    one by one, bit for bit; still one message per server for a forward."""
    got = world.run({"trainer0": (r.plain_train, name(f"plain-{ps_mode}"), 3, ps_mode, True),
                     "trainer1": (r.plain_train, name(f"plain-alone-{ps_mode}"), 3, ps_mode, False)})
    together, alone = got["trainer0"], got["trainer1"]
    for step in range(3):
        for k in r.PLAIN:
            assert torch.equal(together["outs"][step][k], alone["outs"][step][k]), (step, k)
            assert torch.equal(together["evals"][step][k], alone["evals"][step][k]), (step, k)
    for k in r.PLAIN:
        assert torch.equal(together["weights"][k], alone["weights"][k]), k
    assert together["messages"] == {"ps0": 1, "ps1": 1}
    # with grad: the three sum / mean tables that record (and the frozen one, on two servers);
    # under no_grad: the ones on two servers (the one on ps1 alone sends its arguments as given)
    assert together["planned"][:2] == [["clicks", "frozen", "small", "views"], ["clicks", "frozen", "views"]]


def test_plain_tables_planned_together_in_sync_with_two_trainers_equal_them_alone(world):
    n = name("plain-sync-two")
    got = world.run({f"trainer{i}": (r.plain_train, n, 2, "sync", True, 2, 1 + i) for i in range(2)})
    alone = world.run({f"trainer{i}": (r.plain_train, n + "-alone", 2, "sync", False, 2, 1 + i) for i in range(2)})
    for t in ("trainer0", "trainer1"):
        for k in r.PLAIN:
            assert torch.equal(got[t]["weights"][k], alone[t]["weights"][k]), (t, k)
            assert torch.equal(got[t]["evals"][-1][k], alone[t]["evals"][-1][k]), (t, k)


def test_plain_tables_planned_together_follow_torchs_gradient_idioms_as_alone(world):
    """Tables recorded together (one autograd node for the plan) as one by one: nothing is
    recorded by ``torch.autograd.grad`` or ``backward(inputs=dense)`` (their steps push
    nothing), two forwards and one backward push both, bit for bit as alone; a frozen
    table's output needs no gradient."""
    got = world.run({"trainer0": (r.plain_grad_idioms, name("idioms"), True),
                     "trainer1": (r.plain_grad_idioms, name("idioms-alone"), False)})
    together, alone = got["trainer0"], got["trainer1"]
    assert together["requires"] == alone["requires"] == {k: k != "frozen" for k in r.PLAIN}, together["requires"]
    for k in r.PLAIN:
        assert torch.equal(together["after_grad"][k], together["initial"][k]), k
        assert torch.equal(together["after_inputs"][k], together["initial"][k]), k
        assert torch.equal(together["after_two"][k], alone["after_two"][k]), k
    assert not torch.equal(together["after_two"]["clicks"], together["initial"]["clicks"])


def test_a_table_planned_together_whose_output_is_not_in_the_loss_is_not_stepped(world):
    """Tables recorded together: a loss of one table's output steps that table only (torch:
    the other tables' weights get no gradient), bit for bit as the tables alone; with
    SparseAdam a zero gradient pushed would move the rows."""
    got = world.run({"trainer0": (r.plain_unused_output, name("unused"), True),
                     "trainer1": (r.plain_unused_output, name("unused-alone"), False)})
    for k in ("clicks", "views", "small"):
        assert torch.equal(got["trainer0"][k], got["trainer1"][k]), k


@pytest.mark.parametrize("how", ["message", "entry"])
def test_tables_pushed_together_settle_each_table_as_alone_when_a_push_fails(world, how):
    """The tables recorded together push in one call per server; a call that fails (ps0's)
    fails the tables it carried, a table's entry refused fails that table only, as their own
    pushes would: those keep their gradients, the others count as stepped, and step() again
    pushes only those (sync: nothing applied twice), so two steps equal the run without it."""
    got = world.run({"trainer0": (r.together_failure, name(f"together-fail-{how}"), how)})["trainer0"]
    assert got["error"] is not None, got["error"]
    if how == "message":
        assert "push refused" in got["error"], got["error"]
        assert got["kept"] == ["clicks", "views"], got["kept"]  # "small" is on ps1 only
    else:
        assert "-clicks-not-here" in got["error"] and "'ps1'" in got["error"], got["error"]
        assert got["kept"] == ["clicks"], got["kept"]
    for k in r.PLAIN:
        assert torch.equal(got["weights"][k], got["reference"][k]), k


def test_pushed_bytes_count_every_servers_copy_of_a_packed_push(world):
    """``pushed_bytes`` counts what was sent: a push of tables recorded together sends every
    server the pooled bags' gradient in its own call, so the tables' counts add up to the
    tensor bytes of all the step's push calls, as they did when each server got its rows."""
    got = world.run({"trainer0": (r.pushed_bytes_counted, name("pushed-bytes"))})["trainer0"]
    assert got["counted"] == got["sent"], got
    assert all(b > 0 for b in got["sent"]), got

def test_a_packed_push_sends_each_server_the_gradient_of_its_bags_only(world):
    """A push of tables recorded together sends each server the pooled gradient of the bags
    holding ids there, not every bag of the batch: traffic that does not grow with the
    number of servers (a table on ps1 alone, an empty bag: ps0 has none of their bags)."""
    got = world.run({"trainer0": (r.packed_push_rows, name("packed-rows"))})["trainer0"]
    assert set(got["rows"]) == set(got["bags"]) == {"ps0", "ps1"}, got
    for server, bags in got["bags"].items():
        assert got["rows"][server] == bags < got["all_bags"], got

def test_bad_plain_inputs_are_refused_as_the_table_alone_refuses_them(world):
    texts = world.run({"trainer0": (r.plain_refusals, name("plain-bad"))})["trainer0"]
    for together, alone in zip(texts[::2], texts[1::2]):
        case, _, error = alone.partition(": ")
        assert "no error" not in error, alone
        kind, _, message = error.partition(": ")
        assert together.startswith(f"{case}: {kind}: ") and message in together, (together, alone)


def test_plain_tables_of_two_dims_no_bags_or_one_server_equal_the_tables_alone(world):
    """Tables of two embedding_dims are planned in two groups (each server answers a group's
    bags packed in one tensor); a table with no bag (2-d ids of 0 rows) last, and ids on one
    server only (the other is not called, as by the tables alone), give what the tables alone
    give; 2-d ids of 0 columns are refused as torch refuses them (not pooled as empty bags)."""
    got = world.run({"trainer0": (r.plain_edges, name("edges"), True),
                     "trainer1": (r.plain_edges, name("edges-alone"), False)})
    together, alone = got["trainer0"], got["trainer1"]
    for step, (a, b) in enumerate(zip(together["outs"], alone["outs"])):
        for k in r.EDGES:
            assert torch.equal(a[k], b[k]), (step, k)
    assert together["outs"][0]["views"].shape == (0, 4)
    for k in r.EDGES:
        assert torch.equal(together["weights"][k], alone["weights"][k]), k
    assert together["planned"][:2] == [["deep", "wide"], ["clicks", "views"]]
    assert together["messages"][1] == {"ps0": 1}  # every id of the second batch is on ps0
    assert "step must be nonzero" in together["refusal"] and "'views'" in together["refusal"]
    assert "step must be nonzero" in alone["refusal"]


def test_a_plan_finds_each_servers_ids_and_bags_as_searching_the_batch_does(world):
    """The plan takes each position's bag and each bag's first id on a server by counting
    (bag sizes, the ids there before its start): the same as searching the batch, with empty
    bags first, inside and last, a table with no bag, and a server with none of the ids."""
    assert world.run({"trainer0": (r.plain_plan_shares, name("plan-shares"))})["trainer0"] == []


def test_a_geo_collections_traffic_counts_the_rows_its_deltas_push_and_its_flush(world):
    # geo pushes row deltas (not gradients): they are rows pushed, not ids looked up, and the
    # flush's push of the last steps' rows travels (and is counted) one message per server
    got = world.run({"trainer0": (r.geo_traffic, name("geo-traffic"))})["trainer0"]
    steps, flushed, cached = got["steps"], got["flushed"], got["cached"]
    assert sum(t["rows_pushed"] for t in steps.values()) == cached[0]  # the push after step 2
    assert sum(t["rows_pushed"] for t in flushed.values()) == cached[0] + cached[1]
    assert {s: t["messages"] - steps[s]["messages"] for s, t in flushed.items()} == {"ps0": 1, "ps1": 1}
    assert {s: t["ids_looked_up"] for s, t in flushed.items()} == {s: t["ids_looked_up"] for s, t in steps.items()}


def test_servers_holding_every_table_a_run_of_them_or_tables_apart_add_as_the_tables_alone(world):
    """A collection's output adds each server's packed part where its tables' bags are: all of
    them, a run of tables (a slice) or tables apart (indices); outputs and rows after 3 steps
    equal the tables alone, bit for bit (sum and mean, three servers)."""
    got = world.run({"trainer0": (r.served_runs, name("runs"), True),
                     "trainer1": (r.served_runs, name("runs-alone"), False)})
    together, alone = got["trainer0"], got["trainer1"]
    assert together["servers"] == ["ps0", "ps1", "ps2"] and together["adds"] == [None, "slice", "index"]
    for step, (a, b) in enumerate(zip(together["outs"], alone["outs"])):
        for k in r.RUNS:
            assert torch.equal(a[k], b[k]), (step, k)
    for k in r.RUNS:
        assert torch.equal(together["weights"][k], alone["weights"][k]), k


def test_a_default_dtype_of_float64_sums_the_servers_parts_as_alone(world):
    # the servers' parts are added in float32 (as the servers pool), by a collection as by a
    # table alone, whatever the trainer's default dtype
    got = world.run({"trainer0": (r.default_double, name("ddt"), True),
                     "trainer1": (r.default_double, name("ddf"), False)})
    together, alone = got["trainer0"]["outs"], got["trainer1"]["outs"]
    for grad in range(2):
        for k in alone[grad]:
            assert together[grad][k].dtype == alone[grad][k].dtype == torch.float64
            assert torch.equal(together[grad][k], alone[grad][k]), (grad, k)


def test_a_default_dtype_of_float64_with_tables_apart_on_a_server(world):
    # (an index_add of the float32 parts into float64 zeros raised here)
    got = world.run({"trainer0": (r.default_double_apart, name("dat"), True),
                     "trainer1": (r.default_double_apart, name("daf"), False)})
    for k, v in got["trainer1"].items():
        assert torch.equal(got["trainer0"][k], v), k
