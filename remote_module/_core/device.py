"""Parsing ``remote_device`` strings and moving tensors between devices.

Everything here is a pure function (no RPC), so CPU-only tests can reach all of it,
including the logic that runs on an accelerator host.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from remote_module._core.walk import map_tensors

_PARSE_ERROR = "Could not parse remote_device: {}. The valid format is '<workername>/<device>'"
_RANK = re.compile(r"rank:(\d+)")


@dataclass(frozen=True)
class RemoteDevice:
    """A parsed ``remote_device``: a worker (by name or by rank) and a device on it."""

    worker_name: str | None
    rank: int | None
    device: torch.device

    @property
    def worker(self) -> str | int:
        """What ``torch.distributed.rpc`` accepts as a destination: the name, else the rank."""
        return self.worker_name if self.worker_name is not None else self.rank  # type: ignore[return-value]


def parse_remote_device(remote_device: str) -> RemoteDevice:
    """Parse ``"<worker>/<device>"``, ``"rank:<n>/<device>"`` or ``"<worker>"`` (device: cpu).

    Example::

        >>> parse_remote_device("worker1/cuda:0")
        RemoteDevice(worker_name='worker1', rank=None, device=device(type='cuda', index=0))
        >>> parse_remote_device("rank:2").rank
        2

    A string that does not have that shape raises ``ValueError``; a well-shaped string whose
    device part is not a device raises torch's own device error.
    """
    if not isinstance(remote_device, str):
        raise TypeError(
            f"remote_device must be a str such as 'worker1/cpu', got {type(remote_device).__name__}: "
            f"{remote_device!r}"
        )
    fields = remote_device.split("/")
    if len(fields) == 1:
        worker, device_str = fields[0], "cpu"
        if _looks_like_device(worker):
            # "cpu" or "cuda:0" alone names no worker: a RemoteModule needs one.
            raise ValueError(_PARSE_ERROR.format(remote_device))
    elif len(fields) == 2:
        worker, device_str = fields
    else:
        raise ValueError(_PARSE_ERROR.format(remote_device))
    if not worker or not device_str or worker != worker.strip() or any(c.isspace() for c in worker):
        raise ValueError(_PARSE_ERROR.format(remote_device))

    rank = None
    worker_name: str | None = worker
    if ":" in worker:
        match = _RANK.fullmatch(worker)
        if match is None:
            raise ValueError(_PARSE_ERROR.format(remote_device))
        rank, worker_name = int(match.group(1)), None
    device = torch.device(device_str)  # torch's own error for a bad device string
    return RemoteDevice(worker_name, rank, device)


def uses_device_map(device: str | torch.device, device_map: dict) -> bool:
    """Whether a proxy's outputs come back on the host's device: only for a module off the CPU
    and with a device map towards its host (torch's RemoteModule decides the same way);
    otherwise the host moves every output tensor to the CPU.

    Example::

        >>> uses_device_map("cuda:0", {"cuda:0": "cuda:1"}), uses_device_map("cuda:0", {})
        (True, False)
        >>> uses_device_map("cpu", {"cpu": "cuda:0"})
        False
    """
    return torch.device(device).type != "cpu" and bool(device_map)


def _looks_like_device(s: str) -> bool:
    try:
        torch.device(s)
    except RuntimeError:
        return False
    return True


# ----------------------------------------------------------------------------------------
# Moving tensors inside arbitrary (nested) arguments and outputs.


def move_cpu_tensors(obj: Any, device: torch.device) -> Any:
    """Move every CPU tensor in ``obj`` to ``device``; tensors already elsewhere stay put."""
    if device.type == "cpu":
        return obj
    return map_tensors(lambda t: t.to(device) if t.device.type == "cpu" else t, obj)


def tensors_to_cpu(obj: Any) -> Any:
    """Bring every tensor in ``obj`` to the CPU, whatever the structure (single tensor included)."""
    return map_tensors(lambda t: t.cpu() if t.device.type != "cpu" else t, obj)


def prepare_inputs(args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict]:
    """Host side, before ``forward``: CPU tensors in the arguments go to the module's device."""
    if device.type == "cpu":
        return args, kwargs
    return move_cpu_tensors(args, device), move_cpu_tensors(kwargs, device)


def prepare_output(out: Any, device: torch.device, is_device_map_set: bool) -> Any:
    """Host side, after ``forward``: without a device map only CPU tensors may travel back."""
    if device.type == "cpu" or is_device_map_set:
        return out
    return tensors_to_cpu(out)
