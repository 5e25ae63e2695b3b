"""A scriptable module that can fail or hang on demand, for the scriptable-proxy contract
tests (top level, with source: TorchScript compiles these on both workers)."""

import torch
from torch import nn
from torch.futures import Future


@torch.jit.interface
class GateInterface:
    def forward(self, key: str) -> str:
        pass


@torch.jit.interface
class RemoteGateInterface:
    """What a scripted proxy of GateInterface offers."""

    def forward(self, key: str) -> str:
        pass

    def forward_async(self, key: str) -> Future[str]:
        pass


class Gate(nn.Module):
    """``forward(key)``: raises ValueError for "bad", blocks until released for "hold..."
    (HANG_S at most), else returns ``key``."""

    def forward(self, key: str) -> str:
        if key == "bad":
            raise ValueError("the key must not be 'bad'")
        if key.startswith("hold"):
            self._hold(key)
        return key

    @torch.jit.ignore
    def _hold(self, key: str) -> None:
        from tests._deadlines import HANG_S
        from tests._faults import gates

        gates.hold(key, HANG_S)  # until the test releases it: its timeout tests check while held


@torch.jit.script
def call_gate(proxy: RemoteGateInterface, key: str) -> str:
    return proxy.forward(key)


@torch.jit.script
def call_gate_async(proxy: RemoteGateInterface, key: str) -> str:
    return proxy.forward_async(key).wait()
