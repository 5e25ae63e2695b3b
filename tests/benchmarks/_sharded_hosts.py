"""The sharded benchmark's modules and host-side functions (importable on every worker).

* a tiny module for the small-forward figure;
* the Megatron MLP, ``Linear(d_model, hidden) + ReLU + Linear(hidden, d_model)``, built from
  a fixed seed, so every process that builds it holds the same weights; ``ColumnShard`` and
  ``RowShard`` hold mesh rank ``r``'s slice of it (hidden units split as ``torch.tensor_split``
  splits them). The same two classes serve the sharded variant (inside ``LocalModule``) and
  the by-hand variant (one ``RemoteModule`` of each per worker), so both compute the same.

Functions called over RPC are module level (RPC pickles them by reference).
"""

from __future__ import annotations

import torch
from torch import nn


def noop() -> None:
    return None


def handler_threads() -> int:
    """``torch.get_num_threads()`` as an RPC handler thread of this process sees it."""
    return torch.get_num_threads()


def held_count() -> int:
    """How many shards this worker's sharded store holds (to wait for releases to land)."""
    from remote_module.sharded import _host

    return len(_host._store)


_by_hand: dict[str, object] = {}


def linear_by_hand(x: torch.Tensor) -> None:
    """The small forward's work written as a raw RPC handler: this host's ``Linear(16, 16)``
    (made on first use) on ``x``, without grad, the output kept here until the next call (the
    sharded variant keeps its output until a release arrives); nothing travels back."""
    linear = _by_hand.get("linear")
    if linear is None:
        linear = _by_hand.setdefault("linear", nn.Linear(16, 16))
    with torch.no_grad():
        _by_hand["output"] = linear(x)


class Tiny(nn.Module):
    """The small forward: ``x * 2`` (no parameters; the cost measured is the call's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


# ---- the Megatron MLP ------------------------------------------------------------------------


def build_mlp(cfg: dict) -> nn.Sequential:
    """The whole MLP, seeded: ``Linear(d_model, hidden)``, ``ReLU``, ``Linear(hidden, d_model)``."""
    gen = torch.Generator().manual_seed(cfg["seed"])
    d, h = cfg["d_model"], cfg["hidden"]
    up, down = nn.Linear(d, h), nn.Linear(h, d)
    with torch.no_grad():
        up.weight.normal_(0.0, (2.0 / d) ** 0.5, generator=gen)
        up.bias.uniform_(-0.01, 0.01, generator=gen)
        down.weight.normal_(0.0, (1.0 / h) ** 0.5, generator=gen)
        down.bias.uniform_(-0.01, 0.01, generator=gen)
    return nn.Sequential(up, nn.ReLU(), down)


def mlp_input(cfg: dict) -> torch.Tensor:
    return torch.randn(cfg["batch"], cfg["d_model"], generator=torch.Generator().manual_seed(cfg["seed"] + 1))


def _hidden_slice(cfg: dict, rank: int, size: int) -> slice:
    index = torch.arange(cfg["hidden"]).tensor_split(size)[rank]
    return slice(int(index[0]), int(index[-1]) + 1)


class ColumnShard(nn.Module):
    """Mesh rank ``rank`` of ``size``: ``relu(x @ W1[s].T + b1[s])`` for its hidden units ``s``."""

    def __init__(self, cfg: dict, rank: int, size: int) -> None:
        super().__init__()
        up = build_mlp(cfg)[0]
        s = _hidden_slice(cfg, rank, size)
        self.linear = nn.Linear(cfg["d_model"], s.stop - s.start)
        with torch.no_grad():
            self.linear.weight.copy_(up.weight[s])
            self.linear.bias.copy_(up.bias[s])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class RowShard(nn.Module):
    """Mesh rank ``rank`` of ``size``: ``h_s @ W2[:, s].T`` (no bias: it is added once, after
    the partial sums are reduced)."""

    def __init__(self, cfg: dict, rank: int, size: int) -> None:
        super().__init__()
        down = build_mlp(cfg)[2]
        s = _hidden_slice(cfg, rank, size)
        self.linear = nn.Linear(s.stop - s.start, cfg["d_model"], bias=False)
        with torch.no_grad():
            self.linear.weight.copy_(down.weight[:, s])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h)
