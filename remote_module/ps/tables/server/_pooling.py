"""Pooling looked-up rows into bags, as ``nn.EmbeddingBag`` pools them, and the checks of ids
and offsets that trainers and servers share."""

from __future__ import annotations

import torch

from remote_module._core import embedding_bag_parts


def check_offsets(offsets: object) -> None:
    """``ValueError`` if 1-d ``offsets`` decrease (bag ``i`` starts at ``offsets[i]``): torch
    checks this only when it pools on several threads (on one it reads past the input and
    returns uninitialised memory)."""
    if isinstance(offsets, torch.Tensor) and offsets.dim() == 1 and offsets.numel() > 1:
        down = (offsets[1:] < offsets[:-1]).nonzero()
        if down.numel():
            i = int(down[0]) + 1
            raise ValueError(f"offsets must not decrease (bag i starts at offsets[i]), got offsets[{i}]="
                             f"{int(offsets[i])} after offsets[{i - 1}]={int(offsets[i - 1])}")


def with_padding_row(uniq: torch.Tensor, rows: torch.Tensor, padding_idx: int | None
                     ) -> tuple[torch.Tensor, int | None]:
    """``rows`` (row ``j`` is id ``uniq[j]``) and the ``padding_idx`` to pool them with
    torch's ``embedding_bag`` for a table whose padding row is ``padding_idx``: the padding
    id's index among ``uniq``, or, when no input holds it, a zero row appended that no input
    uses (with ``padding_idx=None`` torch pools with another kernel, whose sums differ in the
    last bit); ``None`` for a table without one."""
    if padding_idx is None:
        return rows, None
    hit = (uniq == padding_idx).nonzero().reshape(-1)
    if hit.numel():
        return rows, int(hit[0])
    return torch.cat([rows, rows.new_zeros(1, rows.shape[1])]), uniq.numel()


def check_ids(ids: torch.Tensor, num_embeddings: int) -> None:
    """``IndexError`` unless every one of ``ids`` (int64) is in ``[0, num_embeddings)``."""
    if ids.numel():
        low, high = torch.aminmax(ids)
        if int(low) < 0 or int(high) >= num_embeddings:
            raise IndexError(f"ids must be in [0, {num_embeddings}), got {int(low)}..{int(high)}")


def pool_rows(rows: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
              kind: str) -> object:
    """Pool ``rows`` (row ``j`` is id ``ids[j]``) into bags: bag ``b`` holds rows
    ``offsets[b]`` up to the next bag's offset (or the end), as ``nn.EmbeddingBag``'s offsets.

    ``kind="sum"``: the ``(bags, dim)`` sums of the rows (times ``weights``), in position
    order (a mean is this sum divided by the bag's size, which the trainer knows).
    ``kind="max"``: ``(values, winners, first_nan)``: the element-wise maxima of the rows that
    are not NaN (``-inf`` where a bag has none here), per element the id of the first row
    holding it (``-1`` where none: the trainer sends the gradient to that row), and whether the
    bag's first row here is NaN (torch's max keeps a bag's first row unless a strictly greater
    one follows, so a NaN counts only there; the trainer knows which server has that row).
    """
    n = rows.shape[0]
    positions = torch.arange(n)
    offsets = offsets.long()
    if kind == "sum":
        if weights is not None:
            weights = weights.to(rows.dtype)
        return embedding_bag_parts(rows, positions, offsets, "sum", weights)[0]
    num_bags, dim = offsets.numel(), rows.shape[1]
    bags = torch.searchsorted(offsets, positions, right=True) - 1
    where = bags.unsqueeze(1).expand(-1, dim)
    nan = rows.isnan()
    rows = rows.masked_fill(nan, float("-inf"))
    values = torch.full((num_bags, dim), float("-inf"), dtype=rows.dtype).scatter_reduce(0, where, rows, "amax")
    holds = (rows == values[bags]) & ~nan
    first = torch.full((num_bags, dim), n, dtype=torch.long).scatter_reduce(
        0, where, torch.where(holds, positions.unsqueeze(1).expand(-1, dim), n), "amin")
    winners = torch.where(first < n, ids[first.clamp(max=max(n - 1, 0))], -1)
    start = offsets.clamp(max=n)
    first_nan = torch.zeros(num_bags, dim, dtype=torch.bool)
    started = start < torch.cat([offsets[1:], offsets.new_tensor([n])]).clamp(max=n)  # bags with a row here
    first_nan[started] = nan[start[started]]
    return values, winners, first_nan
