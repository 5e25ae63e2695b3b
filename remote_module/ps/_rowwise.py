"""Row-wise optimizers for embedding tables: the steps of ``torch.optim.SGD``, ``Adagrad`` and
``SparseAdam`` on a sparse gradient (row ids and gradient rows), written for a server that holds
state only for the rows ever touched. Pure functions of tensors: no RPC.

Each step takes the ids and rows of one sparse gradient (ids may repeat: their rows are summed,
as torch coalesces a sparse gradient), the table's current rows for those ids, and the per-row
state for them; it returns the new rows and the new state. Counters that torch keeps per
parameter (``step``) are per table here too, advanced once per step.

Example (a server applying one pushed gradient to rows never stepped before)::

    >>> opt = row_optimizer(torch.optim.Adagrad, {"lr": 0.5})
    >>> rows = torch.ones(4, 2)
    >>> ids, grad = coalesce(torch.tensor([2, 0, 2]), torch.ones(3, 2))   # row 2's rows summed
    >>> ids.tolist(), grad[:, 0].tolist()
    ([0, 2], [1.0, 2.0])
    >>> state = new_state(opt, len(ids), 2, torch.float32)                # Adagrad's sums: zeros
    >>> new_rows, state = step_rows(opt, rows[ids], grad, state, step=1)
    >>> new_rows[:, 0].tolist(), state["sum"][:, 0].tolist()
    ([0.5, 0.5], [1.0, 4.0])
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch


class RowOptimizer(NamedTuple):
    """An optimizer class and its settings, checked for row-wise use."""

    kind: str  # "sgd" | "adagrad" | "sparse_adam"
    lr: float
    lr_decay: float = 0.0
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    maximize: bool = False


def row_optimizer(cls: Any, kwargs: dict) -> RowOptimizer:
    """The row-wise form of ``cls(**kwargs)``; ``ValueError`` naming the setting for what torch
    refuses (a negative lr, eps, lr_decay or initial_accumulator_value, betas outside [0, 1),
    nesterov without momentum; SGD and Adagrad weight decay on a sparse gradient) and for SGD
    momentum (torch's sparse momentum moves every row ever touched on every step: not
    row-wise)."""
    kwargs = dict(kwargs)
    if cls is torch.optim.SGD:
        if kwargs.pop("weight_decay", 0) not in (0, 0.0):
            raise ValueError("torch.optim.SGD with weight_decay does not apply to sparse gradients; use weight_decay=0")
        for key in ("momentum", "dampening"):
            if kwargs.pop(key, 0) not in (0, 0.0):
                raise ValueError(
                    f"torch.optim.SGD with {key}: torch's momentum on a sparse gradient moves every row ever touched "
                    f"on every step, which a sparse table does not do (its steps touch the step's rows only); use "
                    f"{key}=0, or Adagrad / SparseAdam")
        if kwargs.pop("nesterov", False):
            raise ValueError("torch.optim.SGD with nesterov=True needs momentum (torch refuses it without): use "
                             "nesterov=False")
        kwargs.pop("foreach", None)
        kwargs.pop("differentiable", None)
        maximize = bool(kwargs.pop("maximize", False))
        lr = _non_negative(cls, "lr", kwargs.pop("lr", 1e-3))
        _no_more(cls, kwargs)
        return RowOptimizer("sgd", lr, maximize=maximize)
    if cls is torch.optim.Adagrad:
        if kwargs.pop("weight_decay", 0) not in (0, 0.0):
            raise ValueError("torch.optim.Adagrad with weight_decay does not apply to sparse gradients; use 0")
        for key in ("foreach", "differentiable", "fused"):
            kwargs.pop(key, None)
        opt = RowOptimizer(
            "adagrad", _non_negative(cls, "lr", kwargs.pop("lr", 1e-2)),
            lr_decay=_non_negative(cls, "lr_decay", kwargs.pop("lr_decay", 0.0)),
            eps=_non_negative(cls, "eps", kwargs.pop("eps", 1e-10)),
            initial_accumulator_value=_non_negative(cls, "initial_accumulator_value",
                                                    kwargs.pop("initial_accumulator_value", 0.0)),
            maximize=bool(kwargs.pop("maximize", False)),
        )
        _no_more(cls, kwargs)
        return opt
    if cls is torch.optim.SparseAdam:
        betas = tuple(float(b) for b in kwargs.pop("betas", (0.9, 0.999)))
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(
                f"torch.optim.SparseAdam: betas must be two numbers in [0, 1) (as torch checks), got {betas}"
            )
        opt = RowOptimizer("sparse_adam", _non_negative(cls, "lr", kwargs.pop("lr", 1e-3)),
                           eps=_non_negative(cls, "eps", kwargs.pop("eps", 1e-8)),
                           betas=betas, maximize=bool(kwargs.pop("maximize", False)))
        _no_more(cls, kwargs)
        return opt
    raise ValueError(
        f"a sparse table takes torch.optim.SGD, Adagrad or SparseAdam (row-wise, state only for touched "
        f"rows), got {getattr(cls, '__name__', cls)!r}"
    )


def _non_negative(cls: Any, key: str, value: Any) -> float:
    """``value`` as a float, checked as torch's optimizer checks ``key`` (``ValueError`` below 0)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"torch.optim.{cls.__name__}: {key} must be a number, got {value!r}") from None
    if not number >= 0.0:  # NaN too
        raise ValueError(f"torch.optim.{cls.__name__}: {key} must be >= 0 (as torch checks), got {value!r}")
    return number


def _no_more(cls: Any, kwargs: dict) -> None:
    if kwargs:
        raise ValueError(f"{cls.__name__}: settings {sorted(kwargs)} are not supported for a sparse table")


def coalesce(ids: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique ``ids`` and their rows summed (a sparse gradient's ``coalesce()``);
    ``ids`` already sorted and unique (a step's single lookup) are returned as they are."""
    if ids.numel() < 2 or bool((ids[1:] > ids[:-1]).all()):
        return ids, rows
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    summed = torch.zeros((unique.numel(),) + tuple(rows.shape[1:]), dtype=rows.dtype)
    summed.index_add_(0, inverse, rows)
    return unique, summed


def bag_ends(starts: torch.Tensor, n: int) -> torch.Tensor:
    """Where each bag starts among ``n`` positions (``starts``), then the end: bag ``b`` holds
    positions ``ends[b]`` to ``ends[b + 1]``, so ``ends[1:] > starts`` marks the bags with one."""
    return torch.cat([starts, starts.new_tensor([n])])


def bag_index(starts: torch.Tensor, n: int, check: bool = True) -> torch.Tensor:
    """Each of ``n`` positions' bag, for bags starting at ``starts`` (bag ``b`` holds positions
    ``starts[b]`` to ``starts[b + 1]``, the last one to the end); ``ValueError`` unless they
    start at 0 and do not decrease (``check=False``: starts the caller checked already)."""
    counts = torch.diff(starts.long(), append=torch.tensor([n]))
    if check and starts.numel():
        if int(starts[0]) != 0 or int(counts.min()) < 0:
            raise ValueError(f"bag starts must begin at 0, not decrease, and not pass the {n} positions")
        # (checked: the counts add up to n, so torch need not sum them to size its output)
        return torch.repeat_interleave(counts, output_size=n)
    return torch.repeat_interleave(counts)


def pooled_rows(ids: torch.Tensor, bag_of: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse row gradient (sorted unique ids, their summed rows) of bags pooled by sum,
    from the gradient ``grad`` of the pooled bags (one row per bag; ``bag_of``: each
    position's bag): each position's gradient is its bag's, as torch's ``embedding_bag``
    backward gives it, and each row's sum is taken in position order, so the same bits.
    ``ValueError`` for arguments that do not fit."""
    if ids.dim() != 1 or tuple(bag_of.shape) != (ids.numel(),) or grad.dim() != 2:
        raise ValueError(f"a pooled gradient of shape {tuple(grad.shape)} for ids of shape {tuple(ids.shape)} in bags "
                         f"of shape {tuple(bag_of.shape)} do not fit")
    return coalesce(ids.long(), grad.index_select(0, bag_of))


def row_gradients(entry: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A recorded gradient as (ids, rows): an ``(ids, rows)`` pair as it is, else its
    ``rows()`` (a collection's, computed from its pooled bags' gradient)."""
    return entry if isinstance(entry, tuple) else entry.rows()


def new_state(opt: RowOptimizer, n: int, dim: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state of ``n`` rows never touched before."""
    if opt.kind == "adagrad":
        return {"sum": torch.full((n, dim), opt.initial_accumulator_value, dtype=dtype)}
    if opt.kind == "sparse_adam":
        return {"exp_avg": torch.zeros(n, dim, dtype=dtype), "exp_avg_sq": torch.zeros(n, dim, dtype=dtype)}
    return {}


def step_rows(
    opt: RowOptimizer, rows: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], step: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One optimizer step on ``rows`` (coalesced ``grad``, same shape) with their ``state``;
    ``step`` is the table's step count including this one. Returns new rows and new state."""
    if opt.maximize:
        grad = -grad
    if opt.kind == "sgd":
        return rows.add(grad, alpha=-opt.lr), state
    if opt.kind == "adagrad":
        clr = opt.lr / (1 + (step - 1) * opt.lr_decay)
        total = state["sum"] + grad.pow(2)
        std = total.sqrt().add_(opt.eps)
        return rows.add(grad / std, alpha=-clr), {"sum": total}
    beta1, beta2 = opt.betas
    old_avg, old_sq = state["exp_avg"], state["exp_avg_sq"]
    avg_update = grad.sub(old_avg).mul_(1 - beta1)
    sq_update = grad.pow(2).sub_(old_sq).mul_(1 - beta2)
    exp_avg = old_avg + avg_update
    exp_avg_sq = old_sq + sq_update
    numer = avg_update.add_(old_avg)
    denom = sq_update.add_(old_sq).sqrt_().add_(opt.eps)
    bias1 = 1 - beta1 ** step
    bias2 = 1 - beta2 ** step
    step_size = opt.lr * math.sqrt(bias2) / bias1
    return rows.add(numer.div_(denom), alpha=-step_size), {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
