"""Host side of the batching tests: an MLP that records the batch size of each forward and can
be held on a gate (module level: RPC runs these by reference)."""

from __future__ import annotations

import threading

import torch
from torch import nn

from remote_module._proxy import batching
from tests._faults import gates

_lock = threading.Lock()
_sizes: dict[str, list[int]] = {}


class RecordingMLP(nn.Module):
    """``Linear(8, 16) -> tanh -> Linear(16, 4)``, seeded; ``forward(x, gate=None, name="m")``:
    held on ``gate`` when given, records ``x.shape[0]`` under ``name``, refuses rows with NaN."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, gate: str | None = None, name: str = "m") -> torch.Tensor:
        if gate is not None:
            gates.hold(gate)
        if torch.isnan(x).any():
            raise ValueError("a row with NaN")
        with _lock:
            _sizes.setdefault(name, []).append(int(x.shape[0]))
        return self.net(x)


def sizes(name: str) -> list[int]:
    """The batch sizes of the forwards recorded under ``name`` so far."""
    with _lock:
        return list(_sizes.get(name, []))


def queued() -> int:
    """Calls waiting in every batcher of this host."""
    total = 0
    for b in list(batching._batchers.values()):
        with b._cond:
            total += len(b._queue)
    return total


def wait_queued(n: int, host: str = "worker1") -> None:
    """(On the caller) poll ``host`` until at least ``n`` calls wait in its batchers."""
    import time

    import torch.distributed.rpc as rpc

    from tests._deadlines import HANG_S

    deadline = time.monotonic() + HANG_S
    while rpc.rpc_sync(host, queued) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"{n} calls never queued on {host}")
        time.sleep(0.01)


def held_first(proxy, gate: str, shape: tuple = (1, 8), host: str = "worker1"):
    """(On the caller) start a no-grad call of ``proxy`` that holds its batcher on ``gate``; its
    future, once the call is held on the host."""
    import time

    import torch.distributed.rpc as rpc

    from tests._deadlines import HANG_S

    with torch.no_grad():
        first = proxy.forward_async(torch.zeros(*shape), gate=gate, name=gate)
    deadline = time.monotonic() + HANG_S
    while not rpc.rpc_sync(host, gates.holding, (gate,)):
        assert time.monotonic() < deadline, "the first call never reached its gate"
        time.sleep(0.01)
    return first


def grad_enabled_forward(proxy, x):
    """(On another worker) a call with grad on through a proxy that arrived over RPC."""
    return proxy(x)


def no_grad_forward(proxy, x, name):
    """(On another worker) a call under no_grad through a proxy that arrived over RPC."""
    with torch.no_grad():
        return proxy(x, name=name)


class Flattened(nn.Module):
    """Sequence-first ``(seq, batch)`` in, ``(seq * batch, 2)`` out (flattened, as
    word_language_model's RNNModel returns): for 2 joined calls its size along dim 1 is 2 by
    chance, so a split along dim 1 would cut it wrong."""

    def forward(self, x: torch.Tensor, gate: str | None = None, name: str = "m") -> torch.Tensor:
        if gate is not None:
            gates.hold(gate)
        with _lock:
            _sizes.setdefault(name, []).append(int(x.shape[1]))
        return (x.unsqueeze(-1) * torch.tensor([1.0, -2.0])).reshape(-1, 2)


class Mixing(nn.Module):
    """Rows that are not independent along dim 0: each row minus the mean of all rows."""

    def forward(self, x: torch.Tensor, gate: str | None = None, name: str = "m") -> torch.Tensor:
        if gate is not None:
            gates.hold(gate)
        with _lock:
            _sizes.setdefault(name, []).append(int(x.shape[0]))
        return x - x.mean(dim=0, keepdim=True)
