"""Row-wise optimizers for sparse tables equal torch's optimizers stepping the same sparse
gradient (no RPC)."""

from __future__ import annotations

import pytest
import torch

from remote_module.ps._rowwise import (
    bag_index,
    coalesce,
    new_state,
    pooled_rows,
    row_optimizer,
    step_rows,
)

CASES = [
    (torch.optim.SGD, {"lr": 0.5}),
    (torch.optim.SGD, {"lr": 0.1, "maximize": True}),
    (torch.optim.Adagrad, {"lr": 0.3, "lr_decay": 0.01, "initial_accumulator_value": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.3}),
    (torch.optim.SparseAdam, {"lr": 0.05, "betas": (0.8, 0.99)}),
]


@pytest.mark.parametrize("cls,kwargs", CASES, ids=lambda c: getattr(c, "__name__", str(c)))
def test_rowwise_steps_equal_torch_on_sparse_gradients(cls, kwargs):
    g = torch.Generator().manual_seed(0)
    rows, dim = 50, 4
    weight = torch.nn.Parameter(torch.randn(rows, dim, generator=g, dtype=torch.float64))
    reference = cls([weight], **kwargs)
    table = weight.detach().clone()
    opt = row_optimizer(cls, kwargs)
    state: dict[int, dict[str, torch.Tensor]] = {}  # per touched row, as a server keeps it
    for step in range(1, 8):
        ids = torch.randint(0, rows, (12,), generator=g)  # repeats included
        grad_rows = torch.randn(12, dim, generator=g, dtype=torch.float64)
        weight.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), grad_rows, (rows, dim), check_invariants=True)
        reference.step()
        uniq, summed = coalesce(ids, grad_rows)
        fresh = new_state(opt, 1, dim, torch.float64)
        before = {k: torch.stack([state.get(int(i), {k: v[0] for k, v in fresh.items()})[k] for i in uniq])
                  for k in fresh}
        new_rows, after = step_rows(opt, table[uniq], summed, before, step)
        table[uniq] = new_rows
        for j, i in enumerate(uniq.tolist()):
            state[i] = {k: v[j] for k, v in after.items()}
        torch.testing.assert_close(table, weight.detach(), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("cls,kwargs,match", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "momentum"),
    (torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.1}, "weight_decay"),
    (torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 0.1}, "weight_decay"),
    (torch.optim.Adam, {"lr": 0.1}, "SGD, Adagrad or SparseAdam"),
    (torch.optim.SparseAdam, {"lr": 0.1, "amsgrad": True}, "amsgrad"),
])
def test_settings_torch_cannot_apply_to_sparse_gradients_are_refused(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        row_optimizer(cls, kwargs)


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
    with pytest.raises(ValueError, match=option):
        row_optimizer(cls, kwargs)
    refused = False
    try:  # torch refuses it too: at construction, or at the first sparse step
        weight = torch.nn.Parameter(torch.zeros(4, 2))
        opt = cls([weight], **kwargs)
        weight.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 2), (4, 2))
        opt.step()
    except (ValueError, RuntimeError, TypeError):
        refused = True
    assert refused, f"torch accepts {cls.__name__}({kwargs}) on a sparse gradient"


def test_sgd_momentum_is_refused_saying_why():
    """torch accepts SGD momentum on a sparse gradient, but its buffer then moves every row ever
    touched on every step; a row-wise table cannot, so it refuses, saying so."""
    with pytest.raises(ValueError, match="momentum.*every row ever touched"):
        row_optimizer(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


def _bags(g: torch.Generator, num_bags: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids (repeats included, some bags empty) and each bag's start."""
    sizes = torch.randint(0, 5, (num_bags,), generator=g)
    return torch.randint(0, rows, (int(sizes.sum()),), generator=g), torch.cumsum(sizes, 0) - sizes


def test_pooled_rows_are_torchs_embedding_bag_gradient_and_the_trainers_sums_bit_for_bit():
    """A server computes a collection's row gradients from the pooled bags' gradient: the same
    rows, summed in the same order, as torch's sparse embedding_bag backward coalesced."""
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        ids, starts = _bags(g, 9, 6)
        weight = torch.randn(6, 3, generator=g, requires_grad=True)
        pooled = torch.nn.functional.embedding_bag(ids, weight, starts, mode="sum", sparse=True)
        grad = torch.randn(pooled.shape, generator=g)
        pooled.backward(grad)
        expected = weight.grad.coalesce()
        uniq, rows = pooled_rows(ids.to(torch.int32), bag_index(starts, ids.numel()), grad)
        assert torch.equal(uniq, expected.indices()[0])
        torch.testing.assert_close(rows, expected.values(), rtol=0, atol=1e-6)
        # the order of the old trainer-side computation: one index_add over the unique ids
        u, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        old = torch.zeros(u.numel(), 3).index_add_(0, inverse, grad.index_select(0, bag_index(starts, ids.numel())))
        assert torch.equal(rows, old)


def test_bags_that_do_not_fit_are_a_value_error():
    with pytest.raises(ValueError, match="bag starts must begin at 0"):
        bag_index(torch.tensor([1, 2]), 4)
    with pytest.raises(ValueError, match="bag starts must begin at 0"):
        bag_index(torch.tensor([0, 3, 2]), 4)
    with pytest.raises(ValueError, match="do not fit"):
        pooled_rows(torch.tensor([1, 2, 3]), torch.tensor([0, 1]), torch.zeros(2, 4))
