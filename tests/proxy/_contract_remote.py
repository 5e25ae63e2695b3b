"""Modules and functions the contract tests run on other ranks (module level: RPC pickles
them by reference)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import nn


class Counter(nn.Module):
    """Returns the position at which each call ran on the host (1, 2, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.lock = threading.Lock()

    def forward(self, x: Any = None) -> int:
        with self.lock:
            self.count += 1
            return self.count


class Mode(nn.Module):
    """Returns the training flag the call ran with."""

    def forward(self, x: Any = None) -> bool:
        return self.training


class Picky(nn.Module):
    """``x`` + 1, except: "unpicklable" returns an output that cannot be pickled, "exit"
    raises SystemExit, "interrupt" raises KeyboardInterrupt."""

    def forward(self, x: Any) -> Any:
        if x == "unpicklable":
            return threading.Lock()
        if x == "exit":
            raise SystemExit(3)
        if x == "interrupt":
            raise KeyboardInterrupt("from forward")
        return x + 1


class Describe(nn.Module):
    """What arrived: see :func:`describe`."""

    def forward(self, value: Any) -> dict:
        return describe(value)


def describe(value: Any) -> dict:
    """The facts about ``value`` that the wire must keep (computed where it arrived)."""
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(obj: Any, path: str, out: dict) -> None:
        if id(obj) in seen:
            out[path] = ("seen-before", type(obj).__name__)
            return
        seen.add(id(obj))
        out[path] = type(obj).__module__ + "." + type(obj).__qualname__
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            out[path + ".meta"] = (str(obj.dtype), tuple(obj.shape), obj.stride(), obj.storage_offset(),
                                   obj.untyped_storage().nbytes(), obj.requires_grad, obj.tolist())
        elif isinstance(obj, dict):
            out[path + ".default_factory"] = repr(getattr(obj, "default_factory", None))
            for k, v in obj.items():
                walk(v, f"{path}[{k!r}]", out)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]", out)

    out: dict = {}
    walk(value, "value", out)
    ptrs = [t.untyped_storage().data_ptr() for t in tensors]
    out["storage sharing"] = [[j for j, q in enumerate(ptrs) if q == p] for p in ptrs]
    return out


class Slow(nn.Module):
    def forward(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


class Log(nn.Module):
    """Appends each call's tag; ``forward(None)`` returns the log so far."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list = []

    def forward(self, tag: Any) -> Any:
        if tag is None:
            return list(self.log)
        self.log.append(tag)
        return tag


class ListSubclass(list):
    """A list subclass, importable on every rank."""


def pid() -> int:
    import os

    return os.getpid()


class CountingLinear(nn.Linear):
    """``nn.Linear`` that counts the calls it ran (``ran()``, through the module's RRef) and
    spends at least ``pause`` seconds of CPU on each (a busy wait: cheap calls still share
    messages, but a burst of them takes the host a while)."""

    def __init__(self, *args: Any, pause: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pause = pause
        self.calls = 0
        self.calls_lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        until = time.perf_counter() + self.pause
        with self.calls_lock:
            self.calls += 1
        while time.perf_counter() < until:
            pass
        return super().forward(x)

    def ran(self) -> int:
        return self.calls


class ExitInInit(nn.Module):
    """A module whose constructor raises ``SystemExit`` (as a script's ``sys.exit()`` would)."""

    def __init__(self) -> None:
        super().__init__()
        raise SystemExit(4)
