"""Stage modules and host-side helpers of the pipeline tests (module level: RPC pickles them by
reference). Imports only torch, like tests/proxy/_remote.py.

The modules take a ``seed`` and draw their weights from it, so a test builds the same module
locally as its reference.
"""

from __future__ import annotations

import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn


def seeded_linear(n_in: int, n_out: int, seed: int) -> nn.Linear:
    """An ``nn.Linear`` whose weights come from ``seed`` (same on every process)."""
    layer = nn.Linear(n_in, n_out)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, n_in, generator=g) / n_in**0.5)
        layer.bias.copy_(torch.randn(n_out, generator=g) * 0.1)
    return layer


# ---- stages with several inputs or outputs ---------------------------------------------------


class Fork(nn.Module):
    """Returns a tuple of two tensors (the next stage gets them as two positional arguments)."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__()
        self.lin = seeded_linear(n, n, seed)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), torch.tanh(x)


class Join(nn.Module):
    """Takes two positional tensors."""

    def __init__(self, n: int, n_out: int, seed: int) -> None:
        super().__init__()
        self.a = seeded_linear(n, n_out, seed)
        self.b = seeded_linear(n, n_out, seed + 1)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.a(a) * self.b(b)


class Heads(nn.Module):
    """A last stage returning a tuple: two heads of different widths."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__()
        self.head = seeded_linear(n, 3, seed)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(x), (x * x).mean(dim=1, keepdim=True)


class PickFirst(nn.Module):
    """Takes one tuple (what ``nn.Sequential`` passes on after an ``LSTM``) and returns its first
    item; anything else raises ``TypeError``, so a tuple unpacked into several arguments fails."""

    def forward(self, x: tuple) -> torch.Tensor:
        if not isinstance(x, tuple):
            raise TypeError(f"PickFirst takes one tuple, got {type(x).__name__}")
        return x[0]


class Tied(nn.Module):
    """A layer holding another layer's weight Parameter (tied weights), used transposed:
    ``x @ weight + own bias``."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.weight = other.weight  # the same Parameter object
        self.bias = nn.Parameter(torch.full((other.in_features,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class Mix(nn.Module):
    """A first stage with two inputs: ``forward(x, y)``."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__()
        self.lin = seeded_linear(n, n, seed)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * y


class GradProbe(nn.Module):
    """A linear layer that records, per call, the grad mode it ran in and whether its output
    required grad (so a test can see whether the host built a graph)."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__()
        self.lin = seeded_linear(n, n, seed)
        self.calls: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        self.calls.append((torch.is_grad_enabled(), out.requires_grad))
        return out


class Timed(nn.Module):
    """Passes ``x`` on after sleeping ``pause`` seconds; records per call
    ``(start, end, x[0, 0], rows)`` with ``time.monotonic`` (one clock for every process of a
    machine), so a test can see which micro-batches ran when, in which order, and their sizes.
    ``hold=(key, marker)``: the micro-batch whose ``x[0, 0]`` is ``marker`` waits on the gate
    ``key`` until the test releases it (tests._faults.gates)."""

    def __init__(self, pause: float, hold: tuple[str, float] | None = None) -> None:
        super().__init__()
        self.pause = pause
        self.hold = hold
        self.calls: list[tuple[float, float, float, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.monotonic()
        if self.pause:
            time.sleep(self.pause)
        if self.hold is not None and float(x[0, 0]) == self.hold[1]:
            from tests._faults import gates

            gates.hold(self.hold[0])
        out = x * 1.0
        self.calls.append((start, time.monotonic(), float(x[0, 0]), x.shape[0]))
        return out


class FailsOn(nn.Module):
    """Passes ``x`` on, but raises ``ValueError`` for the micro-batch whose ``x[0, 0]`` is
    ``marker``."""

    def __init__(self, marker: float) -> None:
        super().__init__()
        self.marker = marker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x[0, 0]) == self.marker:
            raise ValueError(f"micro-batch starting with {self.marker} refused on purpose")
        return x * 1.0


# ---- a tensor that says where it was unpickled -------------------------------------------------

#: The workers (names) on which a :class:`Tracer` was unpickled, in this process.
ARRIVALS: list[str] = []


class Tracer(torch.Tensor):
    """A tensor subclass whose unpickling appends this worker's name to :data:`ARRIVALS`.

    It pickles as its plain-tensor data plus :func:`rebuild_tracer`, so over RPC the data
    travels as an ordinary tensor (and distributed autograd records it as one)."""

    def __reduce_ex__(self, protocol):  # noqa: ANN001, ANN204
        return rebuild_tracer, (self.as_subclass(torch.Tensor),)


def rebuild_tracer(data: torch.Tensor) -> Tracer:
    ARRIVALS.append(rpc.get_worker_info().name)
    # The same tensor object, retyped (not an alias from ``as_subclass``): distributed autograd
    # attaches its receive function to ``data`` only after the arguments were unpickled, and an
    # alias made before that would point backward at a leaf that no longer is one.
    data.__class__ = Tracer
    return data


class Emit(nn.Module):
    """A stage whose output is a :class:`Tracer`."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__()
        self.lin = seeded_linear(n, n, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)).as_subclass(Tracer)


class Absorb(nn.Module):
    """A stage that records the type of what it received and returns a plain tensor."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__()
        self.lin = seeded_linear(n, 2, seed)
        self.received: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.received.append(type(x).__name__)
        return self.lin(x.as_subclass(torch.Tensor))


def arrivals() -> list[str]:
    return list(ARRIVALS)


def clear_arrivals() -> None:
    ARRIVALS.clear()


def make_tracer() -> Tracer:
    """Run on a host: a Tracer to send back (the caller's positive control)."""
    return torch.ones(2, 2).as_subclass(Tracer)


# ---- asking the hosts --------------------------------------------------------------------------


def on_host(proxy, fn, *args):  # noqa: ANN001, ANN201
    """Caller side: ``fn(module_rref, *args)`` run on the host of ``proxy`` (a RemoteModule)."""
    rref = proxy.get_module_rref()
    return rpc.rpc_sync(rref.owner(), fn, (rref, *args))


def recorded(module_rref: rpc.RRef, attribute: str) -> list:
    """What a stage module recorded in its list ``attribute``."""
    return list(getattr(module_rref.local_value(), attribute))


def training_flags(module_rref: rpc.RRef) -> dict[str, bool]:
    """The training flag of the host module and of each of its submodules, by name."""
    return {name: m.training for name, m in module_rref.local_value().named_modules()}


def gradients(module_rref: rpc.RRef, context_id: int) -> dict[str, torch.Tensor | None]:
    """This host's gradients in distributed autograd context ``context_id`` of the module's
    parameters, by parameter name (``None``: backward did not reach it)."""
    grads = dist_autograd.get_gradients(context_id)
    by_id = {id(t): g for t, g in grads.items()}
    return {name: by_id.get(id(p)) for name, p in module_rref.local_value().named_parameters()}



def child_names(module_rref: rpc.RRef) -> list[str]:
    """The names of the host module's direct children."""
    return list(module_rref.local_value()._modules)


def requires_grad_flags(module_rref: rpc.RRef) -> dict[str, bool]:
    """``requires_grad`` of each of the host module's parameters, by name."""
    return {name: p.requires_grad for name, p in module_rref.local_value().named_parameters()}
