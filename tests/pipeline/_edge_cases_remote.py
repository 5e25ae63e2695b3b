"""Stages and host-side probes for tests/pipeline/test_edge_cases.py (module level: RPC runs them
by reference)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import nn


class Returns(nn.Module):
    """Returns what ``kind`` names instead of a batch tensor (a stage that breaks the contract)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        if self.kind == "none":
            return None
        if self.kind == "dict":
            return {"x": x}
        if self.kind == "list":
            return [x]
        if self.kind == "scalar":
            return x.sum()
        if self.kind == "lock":  # does not pickle
            return threading.Lock()
        if self.kind == "mixed":  # a tensor for one micro-batch, a tuple for another
            return x if float(x.reshape(-1)[0]) == 1 else (x, x)
        raise NotImplementedError(self.kind)


class Add(nn.Module):
    """``x + add``, sleeping ``pause`` seconds first."""

    def __init__(self, add: float, pause: float = 0.0) -> None:
        super().__init__()
        self.add, self.pause = add, pause

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pause:
            time.sleep(self.pause)
        return x + self.add


def host_state() -> dict[str, int]:
    """On a host: sizes of the pipeline hop tables that must not grow with finished forwards."""
    from remote_module.pipeline import _host

    with _host._turns_lock:
        turns = [*_host._turns.values(), *_host._script_turns.values()]
    return {
        "next": sum(len(t._next) for t in turns),
        "queue": sum(len(t._queue) for t in turns),
        "busy": sum(bool(t._busy) for t in turns),
        "inbox": len(_host._inbox),
    }


def run_pipe(pipe: Any, x: torch.Tensor) -> torch.Tensor:
    """On a second caller: run ``pipe`` (pickled there) on ``x``."""
    return pipe(x)
