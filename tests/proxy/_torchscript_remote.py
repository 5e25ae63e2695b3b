"""TorchScript interfaces and modules for the scriptable-proxy tests (top level, with source:
TorchScript compiles them on both workers)."""

from typing import Dict, List, Tuple

import torch
from torch import Tensor
from torch.futures import Future


@torch.jit.interface
class MyModuleInterface:
    def forward(self, tensor: Tensor, number: int, word: str = "default") -> Tuple[str, int, Tensor]:
        pass


@torch.jit.interface
class RemoteMyModuleInterface:
    """What a scripted proxy of MyModuleInterface offers: forward and forward_async."""

    def forward(self, tensor: Tensor, number: int, word: str = "default") -> Tuple[str, int, Tensor]:
        pass

    def forward_async(self, tensor: Tensor, number: int, word: str = "default") -> Future[Tuple[str, int, Tensor]]:
        pass


class MyModule(torch.nn.Module):
    def __init__(self, first_arg: int, first_kwarg: int = -1) -> None:
        super().__init__()
        self.param1 = torch.nn.Parameter(torch.ones(1))

    def forward(self, tensor: Tensor, number: int, word: str = "default") -> Tuple[str, int, Tensor]:
        return word, number, tensor + self.param1


@torch.jit.interface
class NestedInterface:
    def forward(self, xs: List[Tensor], d: Dict[str, Tensor]) -> Tuple[List[Tensor], Dict[str, Tensor]]:
        pass


class NestedModule(torch.nn.Module):
    def forward(self, xs: List[Tensor], d: Dict[str, Tensor]) -> Tuple[List[Tensor], Dict[str, Tensor]]:
        return [x * 2 for x in xs], {k: v + 1 for k, v in d.items()}


@torch.jit.script
def run_forward(proxy: RemoteMyModuleInterface, t: Tensor) -> Tuple[str, int, Tensor]:
    return proxy.forward(t, 2, "3")


@torch.jit.script
def run_forward_async(proxy: RemoteMyModuleInterface, t: Tensor) -> Tuple[str, int, Tensor]:
    return proxy.forward_async(t, 2, "3").wait()
