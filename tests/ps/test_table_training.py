"""Sharded tables train as torch trains a local sparse embedding (issue 20): ``zero_grad()`` of
any container or optimizer holding a table drops its recorded gradients; a step without a
gradient is no optimizer step in any mode; a checkpoint (rows and optimizer state, geo's
trainer-side state too) continues exactly as uninterrupted training in every mode; local
optimizers and DDP train unchanged beside the tables' zero-size grad markers; and a table whose
gradients are never pushed warns once, while gradient accumulation stays silent.

References are torch's own: ``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)``
with the same optimizer (tolerance atol 1e-6, rtol 1e-5: float32 rounding of the servers'
summation order)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.ps import _table_training_remote as r
from tests.ps._embedding_edge_cases_remote import weights
from tests.ps._world import job

pytestmark = pytest.mark.slow

MODES = ["sync", "async", "half_async", "geo"]
#: optimizers whose steps count (Adagrad's lr_decay, SparseAdam's bias correction)
OPTIMIZERS = {
    "adagrad": (torch.optim.Adagrad, {"lr": 0.5, "lr_decay": 0.3}),
    "sparse_adam": (torch.optim.SparseAdam, {"lr": 0.3}),
}


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def on_trainer0(world, fn, *args):
    return world.run({"trainer0": (fn, *args)})["trainer0"]


def close(a: torch.Tensor, b: torch.Tensor, msg: str = "") -> None:
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=msg or None)


def local_rows(optimizer: tuple, schedule: list) -> torch.Tensor:
    emb, opt = r.local(optimizer)
    r.train(emb, schedule, opt.step, opt.zero_grad)
    return emb.weight.detach()


# ---- a step without a gradient is no optimizer step --------------------------------------------------


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", MODES)
def test_steps_without_a_gradient_are_not_optimizer_steps_in_any_mode(world, mode, opt):
    """SCHEDULE has steps with no lookup (torch skips the parameter: its step count does not
    move) and steps touching one server's rows only (one step of the whole table)."""
    got = on_trainer0(world, r.steps_without_gradients, job(f"nograd-{mode}-{opt}"), mode, OPTIMIZERS[opt])
    close(got, local_rows(OPTIMIZERS[opt], r.SCHEDULE))


def test_a_sync_step_counts_when_any_trainer_had_a_gradient_and_not_when_none_had(world):
    optimizer = OPTIMIZERS["adagrad"]
    schedules = [[[1, 15], None, None, [2], [16], None], [[3], None, [17], None, [4, 15], None]]
    name = job("nograd-sync2")
    on_trainer0(world, r.load_rows, name, optimizer)
    got = world.run({f"trainer{i}": (r.sync_trainer, name, optimizer, s) for i, s in enumerate(schedules)})
    emb, opt = r.local(optimizer)
    for step in range(len(schedules[0])):
        opt.zero_grad()
        present = [s[step] for s in schedules if s[step] is not None]
        if present:  # the mean of the trainers' gradients (a trainer without one counts as zero)
            (sum(emb(torch.tensor(ids)).pow(2).sum() for ids in present) / 2).backward()
        opt.step()
    for t in ("trainer0", "trainer1"):
        close(got[t], emb.weight.detach(), t)


# ---- checkpoints continue as uninterrupted training ----------------------------------------------------


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", MODES)
def test_a_checkpoint_continues_as_uninterrupted_training_in_every_mode(world, mode, opt):
    """Train, checkpoint (state_dict and optimizer_state_dict), train on: a new table loaded
    with the checkpoint and trained on the same steps ends with the same rows (geo: the
    trainer-side optimizer state and step counts travel in optimizer_state_dict; the
    checkpoint is taken between two pushes)."""
    first, then = r.SCHEDULE[:3], r.SCHEDULE[3:]
    on = on_trainer0(world, r.checkpointed, job(f"ckpt-{mode}-{opt}"), mode, OPTIMIZERS[opt], first, then)
    again = on_trainer0(world, r.checkpointed, job(f"ckpt-again-{mode}-{opt}"), mode, OPTIMIZERS[opt], first, then,
                        on["checkpoint"])
    torch.testing.assert_close(again["rows"], on["rows"], atol=1e-6, rtol=0)
    close(on["rows"], local_rows(OPTIMIZERS[opt], r.SCHEDULE))  # and both are torch's
    assert on["checkpoint"]["optim"]["step"] == 2  # the steps with a gradient among the first three
    assert not torch.allclose(on["rows"], on["checkpoint"]["rows"]["weight"])  # it trained after it


# ---- zero_grad of containers and optimizers ------------------------------------------------------------


@pytest.mark.parametrize("how", ["module", "container", "optimizer"])
def test_zero_grad_of_a_model_a_container_or_an_optimizer_drops_the_tables_gradients(world, how):
    """A backward discarded by zero_grad() (the model's, an nn.ModuleList's around it, or that
    of an SGD over model.parameters()) is not applied by the next table.step(), as with a local
    nn.EmbeddingBag in the same optimizer."""
    got = on_trainer0(world, r.zero_grad_sharded, job(f"zero-{how}"), how)
    local = r.Clicks(nn.EmbeddingBag(20, 3, mode="sum", sparse=True, _weight=weights(0)))
    r.zero_grad_run(local, lambda: None, how)
    close(got["rows"], local.bag.weight.detach())
    for key, value in local.dense.state_dict().items():
        close(got["dense"][key], value, key)


# ---- local optimizers and DDP beside the grad markers ----------------------------------------------------


@pytest.mark.parametrize("optimizer", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.01}),
    (torch.optim.Adam, {"lr": 0.05, "foreach": False}),
    (torch.optim.AdamW, {"lr": 0.05}),
    (torch.optim.Adagrad, {"lr": 0.1}),
], ids=["sgd-momentum-wd", "adam-wd", "adam-for-loop", "adamw", "adagrad"])
def test_local_optimizers_of_model_parameters_train_the_dense_part_unchanged(world, optimizer):
    """model.parameters() holds each table's zero-size grad_marker: a local optimizer (with
    weight decay, momentum, foreach or not) and clip_grad_norm_ give the dense part exactly what
    they give it without a table, and state_dict() has the local model's keys only."""
    got = on_trainer0(world, r.local_optimizer_run, job("localopt"), optimizer)
    local = r.Clicks(nn.EmbeddingBag(20, 3, mode="sum", sparse=True, _weight=weights(0)))
    opt = optimizer[0](local.dense.parameters(), **optimizer[1])
    rows_opt = torch.optim.SGD(local.bag.parameters(), lr=0.5)
    for ids in r.BAGS * 2:
        opt.zero_grad()
        rows_opt.zero_grad()
        local(ids).pow(2).sum().backward()
        nn.utils.clip_grad_norm_(local.dense.parameters(), 10.0)
        opt.step()
        rows_opt.step()
    close(got["rows"], local.bag.weight.detach())
    for key, value in local.dense.state_dict().items():
        close(got["dense"][key], value, key)
    assert got["params"] == ["bag.grad_marker", "dense.weight", "dense.bias"]
    assert got["state_keys"] == sorted(local.state_dict())


def test_ddp_around_a_model_holding_a_table_trains_as_one_process(world, tmp_path):
    """DDP (gloo) wraps the whole model, table included: the marker is one of DDP's parameters
    (its zero-size gradient reduced with the others), the dense part's gradients are the
    trainers' mean, each trainer's rows (its own parity) get its gradient in full (async)."""
    name, store = job("ddp-inside"), str(tmp_path / "store")
    got = world.run({f"trainer{i}": (r.ddp_inside_run, name, i, store) for i in range(2)})
    local = r.Clicks(nn.EmbeddingBag(20, 3, mode="sum", sparse=True, _weight=weights(0)))
    opt = torch.optim.SGD(local.dense.parameters(), lr=0.5, momentum=0.9, weight_decay=0.01)
    rows_opt = torch.optim.SGD(local.bag.parameters(), lr=0.5)
    for ids in r.BAGS:
        opt.zero_grad()
        rows_opt.zero_grad()
        sum(local(ids // 2 * 2 + rank).pow(2).sum() for rank in range(2)).backward()
        for p in local.dense.parameters():
            p.grad /= 2
        opt.step()
        rows_opt.step()
    for t in ("trainer0", "trainer1"):
        close(got[t]["rows"], local.bag.weight.detach(), t)
        for key, value in local.dense.state_dict().items():
            close(got[t]["dense"][key], value, f"{t} {key}")


# ---- gradients never pushed warn; accumulation does not ---------------------------------------------------


@pytest.mark.parametrize("case", ["forgotten step", "forgotten step, dense optimizer", "many backward passes"])
def test_a_table_whose_gradients_are_never_pushed_warns_once(world, case):
    got = on_trainer0(world, r.unpushed_warnings, job("unpushed"), case)
    assert len(got["warnings"]) == 1, got["warnings"]
    assert got["categories"] == ["UserWarning"]
    assert "table.step()" in got["warnings"][0] and "'unpushed" in got["warnings"][0], got["warnings"][0]
    assert got["files"] == [r.__file__], got["files"]  # the user's line, not torch's nn.Module.__call__
    torch.testing.assert_close(got["rows"], weights(0), atol=0, rtol=0)  # indeed never trained


@pytest.mark.parametrize("case", ["accumulation", "demo loop", "long accumulation", "frozen", "discarded by zero_grad"])
def test_accumulation_stepped_tables_and_frozen_tables_do_not_warn(world, case):
    got = on_trainer0(world, r.unpushed_warnings, job("pushed"), case)
    assert got["warnings"] == []
    if case == "discarded by zero_grad":  # torch: zero_grad() drops them; nothing was left to push
        torch.testing.assert_close(got["rows"], weights(0), atol=0, rtol=0)
    elif case == "frozen":  # requires_grad_(False): as a frozen nn.EmbeddingBag, nothing recorded
        assert got["frozen_requires_grad"] is False and got["held"] == 0
        torch.testing.assert_close(got["rows"], weights(0), atol=0, rtol=0)
    else:
        assert not torch.allclose(got["rows"], weights(0))


# ---- an LR scheduler does not reach a table's lr: it warns ----------------------------------------------


@pytest.mark.parametrize("case", ["model.parameters()", "two tables", "dense only", "constant", "both"])
def test_a_scheduled_lr_of_the_group_holding_a_table_warns_once(world, case):
    """The rows step with the lr the table was built with, on the servers; a scheduler changing
    the lr of the optimizer group holding the table's grad_marker (dlrm's LRPolicyScheduler over
    model.parameters()) would leave the table behind silently: it warns once, naming the table.
    With a scheduler on the table's ps_optimizer too ("both", as a port of torch's
    text-classification tutorial schedules it), the rows follow one: no warning. Two tables in
    the scheduled group (a collection's, say) warn once, for the group, not once per table."""
    got = on_trainer0(world, r.scheduled_lr, job("sched"), case)
    if case in ("model.parameters()", "two tables"):
        assert len(got["warnings"]) == 1 and got["categories"] == ["UserWarning"], got
        assert "'sched" in got["warnings"][0] and "lr" in got["warnings"][0], got["warnings"][0]
        assert got["files"] == [r.__file__], got["files"]  # the user's opt.step(), not the scheduler's wrapper
    else:
        assert got["warnings"] == [], got


# ---- a model cast to another dtype; a copy of a sync table ------------------------------------------------


@pytest.mark.parametrize("bag", [None, "sum", "mean", "max"])
def test_a_table_in_a_model_cast_to_float64_outputs_float64_as_torch(world, bag):
    """``model.to(torch.float64)`` (or ``.double()``) casts the table's grad_marker: its
    outputs follow, as a local module's follow its weight (the servers keep float32 rows), so
    the layers after it run in float64 instead of raising a dtype mismatch."""
    got = on_trainer0(world, r.in_dtype, job(f"dtype-{bag}"), bag, torch.float64)
    want = r.local_in_dtype(bag, torch.float64)
    for a, b in zip(got["outs"] + got["grads"], want["outs"] + want["grads"]):
        assert a.dtype == b.dtype == torch.float64
        close(a, b)
    close(got["rows"], want["rows"].float())


@pytest.mark.parametrize("bag", [None, "sum", "mean", "max"])
def test_a_table_cast_to_float64_and_back_keeps_training(world, bag):
    """``model.double().float()`` (or a device and back) leaves the grad_marker as it was by
    dtype and device, with a new AccumulateGrad from torch: the lookups after record their
    gradients for that one, and the table trains on as a local module does."""
    got = on_trainer0(world, r.cast_and_back, job(f"cast-back-{bag}"), bag, torch.float64)
    want = r.local_cast_and_back(bag, torch.float64)
    for a, b in zip(got["outs"] + got["grads"], want["outs"] + want["grads"]):
        close(a, b)
    close(got["rows"], want["rows"])


@pytest.mark.parametrize("bag", [None, "sum"])
def test_a_table_whose_marker_torch_swapped_keeps_training(world, bag):
    """``model.float()`` with swap_module_params_on_conversion swaps a new Parameter of the same
    data into the grad_marker (same storage, another tensor: its AccumulateGrad and hooks stay
    with the old one): the table trains on as a local module does, not silently frozen."""
    got = on_trainer0(world, r.swapped_on_conversion, job(f"swapped-{bag}"), bag)
    want = r.swapped_on_conversion("", bag, local=True)
    for a, b in zip(got["outs"] + got["grads"], want["outs"] + want["grads"]):
        close(a, b)
    close(got["rows"], want["rows"])


def test_a_marker_given_back_after_functional_call_is_not_hooked_again(world):
    """torch.func.functional_call swaps another tensor in for the grad_marker and back: the
    marker keeps one hook, not one more per call (each would run at every backward)."""
    assert on_trainer0(world, r.marker_hooks_over_functional_calls, job("functional")) == [1] * 4


def test_a_copy_of_a_sync_table_is_refused_not_dropped_silently(world):
    """``copy.deepcopy`` of a sync table is another object of it: its step is refused with
    the one-object error, never taken for a retry of the original's step (dropped)."""
    got = on_trainer0(world, r.copied_sync_table, job("copied"))
    assert got["copy_error"] is not None and "a copy" in got["copy_error"], got["copy_error"]
    want = weights(0).clone()
    want[1] -= 1.0
    want[3] -= 1.0
    torch.testing.assert_close(got["rows"], want, atol=0, rtol=0)


def test_a_psmodel_step_that_failed_in_a_table_is_completed_by_calling_it_again(world):
    """PSModel.step() pushed its dense gradients, then a table's push failed: step() again
    steps only what was left (the table), not the dense part a second time (a sync server
    would take it for the next round). Training equals torch's, one dense step per step."""
    got = on_trainer0(world, r.psmodel_step_retried, job("retried"))
    want = r.local_psmodel_steps()
    assert got["failed"] == [True, True]
    assert got["versions"] == [3, 3], got["versions"]
    assert got["versions_after"] == [5, 5], got["versions_after"]  # dropped with zero_grad: next one whole
    close(got["rows"], want["rows"])
    for key, value in want["dense"].items():
        close(got["dense"][key], value, key)


def test_a_geo_psmodel_of_tables_alone_trains_and_checkpoints(world):
    """A geo PSModel whose model has no dense parameter (only a table's) is built (no local
    optimizer of nothing), trains as local torch and round-trips its optimizer state."""
    got = on_trainer0(world, r.geo_only_tables, job("geo-only-tables"))
    close(got["rows"], got["local"])


def test_autograd_grad_and_backward_inputs_without_the_table_record_nothing(world):
    """As a parameter's ``.grad``: ``torch.autograd.grad(loss, model.parameters())`` returns
    the gradients and sets no ``.grad`` (the table must not push them at its next step), and
    ``backward(inputs=dense parameters)`` leaves the table out."""
    got = on_trainer0(world, r.grads_not_accumulated_sharded, job("not-accumulated"))
    want = r.grads_not_accumulated_local()
    close(got["rows"], want["rows"])
    for key, value in want["dense"].items():
        close(got["dense"][key], value, key)
