"""Module-level pieces of the serving benchmarks (RPC runs them by reference): the served MLP,
which records each forward's batch size and time on its host, and what a caller process runs."""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

_lock = threading.Lock()
_forwards: list[tuple[int, float]] = []  # (batch size, seconds) of each forward on this host


class TimedMLP(nn.Module):
    """``Linear(d_in, hidden) -> ReLU -> Linear(hidden, d_out)``, seeded; records the batch size
    and the seconds of each forward (:func:`forwards`)."""

    def __init__(self, d_in: int, hidden: int, d_out: int, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.net(x)
        took = time.perf_counter() - start
        with _lock:
            _forwards.append((int(x.shape[0]), took))
        return out


class Sized(nn.Module):
    """Does nothing but return a zero tensor of ``(rows, d_out)`` (the floor: RPC alone)."""

    def __init__(self, d_out: int) -> None:
        super().__init__()
        self.d_out = d_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.shape[0], self.d_out)


def forwards(clear: bool = True) -> list[tuple[int, float]]:
    """(On the host) the forwards recorded since the last call."""
    with _lock:
        out = list(_forwards)
        if clear:
            _forwards.clear()
    return out


def calls(proxy, n: int, d_in: int, seed: int) -> list[float]:
    """(On a caller) ``n`` batch-1 calls of ``proxy`` under ``no_grad``, one after another; each
    call's latency in seconds."""
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn(n, 1, d_in, generator=gen)
    out = []
    with torch.no_grad():
        for i in range(n):
            start = time.perf_counter()
            proxy(xs[i])
            out.append(time.perf_counter() - start)
    return out
