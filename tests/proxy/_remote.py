"""Modules and functions the tests create or run on other ranks (module level: RPC pickles
them by reference).

This file must not import remote_module: the bare-host test creates these modules on a
worker that never imported it and checks that it did not have to.
"""

from __future__ import annotations

import sys
from collections import namedtuple
from typing import Any

import torch
from torch import nn

Pair = namedtuple("Pair", ["first", "second"])


class Affine(nn.Module):
    """``x @ W.T + b`` times ``scale`` with a few kinds of parameters to bind."""

    def __init__(self, n: int = 4, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(n, n, generator=g))
        self.bias = nn.Parameter(torch.randn(n, generator=g))
        self.calls = 0

    def forward(self, x: torch.Tensor, scale: float = 1.0, *, shift: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        out = (x @ self.weight.T + self.bias) * scale
        return out if shift is None else out + shift


class VarArgs(nn.Module):
    def forward(self, a, /, b, *rest, c=3, **extra):
        return {"a": a, "b": b, "rest": list(rest), "c": c, "extra": dict(extra)}


class Weighted(nn.Module):
    """``(x * w).sum()`` plus ``(x * pair[0] * pair[1]).sum()``: gradients reach ``w`` and
    both items of ``pair`` (the same tensor twice is one tensor)."""

    def forward(self, x, w, pair):
        return (x * w).sum() + (x * pair[0] * pair[1]).sum()


class Nested(nn.Module):
    """Returns a nested structure of tensors, built from nested inputs."""

    def forward(self, batch: dict) -> Any:
        t = batch["x"]
        return Pair(t + 1, [t * 2, {"y": batch["ys"][0]}])


class ModeReporter(nn.Module):
    def forward(self) -> bool:
        return self.training


class Boom(nn.Module):
    def forward(self, x):
        raise KeyError(f"no such key {x}")


class FailsInInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        raise ZeroDivisionError("constructor failed on purpose")


def not_a_module_factory(n: int = 1) -> list:
    return [n]


def call_counter(module_rref) -> int:
    return module_rref.local_value().calls


def loaded_modules(prefix: str) -> list[str]:
    return sorted(m for m in sys.modules if m == prefix or m.startswith(prefix + "."))


def training_of(proxy) -> bool:
    """Runs on a third worker: the training flag a received proxy reports."""
    return proxy.training


def use_proxy(proxy, x: torch.Tensor) -> tuple:
    """Runs on a third worker: the proxy arrived in an RPC message."""
    return proxy(x), proxy.forward_async(x).wait(), type(proxy).__name__


def echo(obj: Any) -> Any:
    return obj


def has_attribute(obj: Any, name: str) -> bool:
    return hasattr(obj, name)



class UserError(Exception):
    """A user's own exception type, importable on both sides."""


class Raiser(nn.Module):
    """Raises the exception named by ``kind`` inside forward."""

    def forward(self, kind: str) -> None:
        if kind == "builtin":
            raise ValueError("bad value inside forward")
        if kind == "torch":
            torch.ones(2) @ torch.ones(3)  # RuntimeError from torch
        if kind == "user":
            raise UserError("the user's own error")
        if kind == "local":
            raise type("LocalOnlyError", (Exception,), {"__module__": __name__})("defined inside forward")
        return None


class Sleeper(nn.Module):
    def forward(self, seconds: float) -> float:
        import time

        time.sleep(seconds)
        return seconds


class Hybrid(nn.Module):
    """A remote embedding bag (given) feeding a local MLP."""

    def __init__(self, embedding: nn.Module, dim: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.embedding = embedding
        self.mlp = nn.Sequential(nn.Linear(dim, 8), nn.ReLU(), nn.Linear(8, classes))
        self.register_buffer("scale", torch.ones(1))

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embedding(ids, offsets)) * self.scale


def tensor_views(module_rref) -> dict:
    """(class name, dtype, requires_grad) of every parameter and buffer of the module on the host."""
    module = module_rref.local_value()
    if isinstance(module, torch._C.ScriptModule):  # an RRef typed with a TorchScript interface
        module = torch.jit._recursive.wrap_cpp_module(module)
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return {name: (type(t).__name__, str(t.dtype), t.requires_grad) for name, t in tensors}


def registered_keys() -> set:
    """The keys of the objects this worker holds for proxies (for leak checks)."""
    from remote_module._core import host_objects

    return host_objects.keys()


def rss_mb() -> float:
    import gc
    import os

    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Unhashable(nn.Module):
    """Defines __eq__ without __hash__: instances cannot be dict keys."""

    def __eq__(self, other):
        return isinstance(other, Unhashable)

    __hash__ = None

    def forward(self, x):
        return x + 1


def frozen_linear(n_in: int, n_out: int) -> nn.Module:
    """An ``nn.Linear`` whose parameters do not require grad (an inference-only module)."""
    return nn.Linear(n_in, n_out).requires_grad_(False)


def untrained_warnings(thing, *args) -> int:
    """How many warnings of training outside dist autograd two forwards of ``thing`` (a proxy,
    pipeline or LocalModule that arrived over RPC) raise here, grad mode on."""
    import warnings

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with torch.enable_grad():
            thing(*args)
            thing(*args)
    return sum("outside a torch.distributed.autograd context" in str(w.message) for w in got)


def frozen_lstm(n_in: int, n_hidden: int) -> nn.Module:
    """An ``nn.LSTM`` whose parameters do not require grad: ``forward(x, (h0, c0))``."""
    return nn.LSTM(n_in, n_hidden).requires_grad_(False)


class LinearNorm(nn.Module):
    """``BatchNorm1d(Linear(x))``: floating parameters and buffers, and an int64 buffer
    (``num_batches_tracked``), to compare casts with a local copy."""

    def __init__(self, n_in: int = 4, n_out: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(n_in, n_out)
        self.norm = nn.BatchNorm1d(n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


class HoldsLock(nn.Linear):
    """An ``nn.Linear`` holding a lock: ``copy.deepcopy`` of it fails (as locally)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        import threading

        super().__init__(n_in, n_out)
        self.lock = threading.Lock()
