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
