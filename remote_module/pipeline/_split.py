"""split_sequential: a RemotePipeline cut from a local ``nn.Sequential``."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from torch import nn

from remote_module.pipeline._balance import balance_by_parameters, check_balance
from remote_module.pipeline._pipeline import RemotePipeline


def split_sequential(
    sequential: nn.Sequential,
    remote_devices: Sequence[str],
    balance: Sequence[int] | None = None,
    chunks: int = 1,
    *,
    timeout: float | None = None,
) -> RemotePipeline:
    """A :class:`RemotePipeline` whose stage ``i`` is a copy of a slice of ``sequential`` on
    ``remote_devices[i]``.

    ``balance`` gives the layers per stage; by default the cut makes the stages hold as equal
    a number of parameters as possible, and a layer without parameters stays with the layer
    before it. Each stage is an ``nn.Sequential`` of the slice's layers under their original
    names, so a stage's ``state_dict`` keys are those of ``sequential`` (``2.weight``) and
    ``pipe.state_dict()`` is ``sequential.state_dict()`` with ``stages.<i>.`` in front. The
    weights are copied to the hosts when the pipeline is made; ``sequential`` itself is not
    changed or used afterwards.

    Example (worker0 drives; worker1 and worker2 only join RPC and wait)::

        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        pipe = split_sequential(model, ["worker1/cpu", "worker2/cpu"], chunks=4)
        # pipe.stages[0] holds layers 0-1 (or 0-3), pipe.stages[1] the rest
        out = pipe(torch.randn(32, 16))            # equal to model(x)
    """
    if not isinstance(sequential, nn.Sequential):
        raise TypeError(f"split_sequential takes an nn.Sequential, got {type(sequential).__name__}")
    if isinstance(remote_devices, str):
        raise TypeError(f"remote_devices must be a list of remote devices, one per stage, got the string {remote_devices!r}")
    devices = list(remote_devices)
    if not devices:
        raise ValueError("remote_devices is empty: give one remote device (e.g. 'worker1/cpu') per stage")
    layers = list(sequential._modules.items())
    if len(layers) < len(devices):
        raise ValueError(
            f"cannot split an nn.Sequential of {len(layers)} layers into {len(devices)} stages: "
            "each stage needs at least one layer"
        )
    if balance is None:
        sizes = [sum(p.numel() for p in layer.parameters()) for _, layer in layers]
        counts = balance_by_parameters(sizes, len(devices))
    else:
        counts = check_balance(balance, len(layers), len(devices))
    stages = []
    start = 0
    for device, count in zip(devices, counts):
        part = OrderedDict(layers[start:start + count])
        stages.append((device, nn.Sequential, (part,), None))
        start += count
    return RemotePipeline(stages, chunks, timeout=timeout)
