"""Modules whose ``forward`` defaults must be evaluated on the host, and the functions the
tests run with a received proxy (module level: RPC pickles them by reference).

Used by tests/proxy/test_defaults_on_host.py and tests/proxy/test_errors.py.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch
from torch import nn


class _Default:
    """A module-level default object: each process has its own, so ``is`` tells whether a
    value is the host's own default or a copy that travelled."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<default {self.name}>"


MISSING = _Default("missing")  # a sentinel default, as in `def forward(self, x, mask=MISSING)`
BIG = torch.zeros(4 * 2**20)  # a 16 MB default tensor


class SentinelDefault(nn.Module):
    def forward(self, x: Any, mask: Any = MISSING) -> bool:
        return mask is MISSING  # evaluated where forward runs


class MutableDefault(nn.Module):
    def forward(self, x: Any, seen: list = []) -> tuple[int, bool]:  # noqa: B006 (on purpose)
        seen.append(x)
        return len(seen), seen is type(self).forward.__defaults__[0]


class LambdaDefault(nn.Module):
    """A default that cannot be pickled even by value (the lambda's own default is a lock)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor, fn: Any = lambda v, _guard=threading.Lock(): v * 2) -> tuple:
        self.calls += 1
        return fn(x), fn is type(self).forward.__defaults__[0]


class BigDefault(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor, table: torch.Tensor = BIG) -> tuple:
        self.calls += 1
        return x + table[: x.numel()].view_as(x), table is BIG


_B, _C, _D, _F = _Default("b"), _Default("c"), _Default("d"), _Default("f")


def _seen(value: Any, default: _Default) -> Any:
    return f"host default {default.name}" if value is default else value


class Kinds(nn.Module):
    """Every kind of parameter; reports which defaults were its own objects."""

    def forward(self, a, b=_B, /, c=_C, d=_D, *rest, e, f=_F, **extra) -> dict:
        return {
            "a": a, "b": _seen(b, _B), "c": _seen(c, _C), "d": _seen(d, _D), "rest": rest,
            "e": e, "f": _seen(f, _F), "extra": extra,
        }


def call_received(proxy: Any, args: tuple, kwargs: dict) -> tuple:
    """Runs on a third worker: the proxy arrived in an RPC message."""
    return proxy.forward(*args, **kwargs), proxy.forward_async(*args, **kwargs).wait()


def received_signature(proxy: Any) -> tuple[str, str, list]:
    """``str`` of both signatures, and ``forward``'s parameters as (name, repr of default)."""
    sig = inspect.signature(proxy.forward)
    params = [(p.name, None if p.default is p.empty else repr(p.default)) for p in sig.parameters.values()]
    return str(sig), str(inspect.signature(proxy.forward_async)), params


def wrong_call_on_receiver(proxy: Any) -> list[str]:
    """Wrong calls made on a third worker: the TypeError messages (empty string: no error)."""
    messages = []
    for call in (lambda: proxy.forward(), lambda: proxy.forward(torch.ones(1), 1, 2),
                 lambda: proxy.forward_async(torch.ones(1), nope=1)):
        try:
            call()
            messages.append("")
        except TypeError as exc:
            messages.append(str(exc))
    return messages


def module_calls(module_rref: Any) -> int:
    return module_rref.local_value().calls
