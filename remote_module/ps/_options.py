"""The arguments a PSModel and the tables share (``name``, ``ps_mode``, ``num_trainers``,
``optimizer``, ``timeout``, ``geo_push_every``, ``half_async_merge_every``,
``half_async_merge_s``), checked once, here. Users keep passing them as flat keywords; each
constructor builds a :class:`TrainingOptions` of them first, which raises naming the argument
and the value, and keeps each as the type it stands for (counts as ``int``: any integer
``operator.index`` takes, numpy's too; seconds as ``float``)."""

from __future__ import annotations

from dataclasses import InitVar, dataclass

import torch

from remote_module._core import positive_int, positive_seconds
from remote_module.ps._modes import PS_MODES


@dataclass(frozen=True)
class TrainingOptions:
    """How an owner of server-side parameters trains: checked when built (``ValueError`` or
    ``TypeError`` naming the argument). ``naming``: what ``name`` names, for its error ("the
    job", "the table").

    Example::

        >>> TrainingOptions("user", "async", 2, (torch.optim.SGD, {"lr": 0.1}), None, 100, 4, 0.1).num_trainers
        2
    """

    name: str
    ps_mode: str
    num_trainers: int
    optimizer: tuple[type, dict]
    timeout: float | None
    geo_push_every: int
    half_async_merge_every: int
    half_async_merge_s: float
    naming: InitVar[str] = "the table"

    def __post_init__(self, naming: str) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a non-empty str naming {naming}, got {self.name!r}")
        if not self.name:
            raise ValueError(f"name must be a non-empty str naming {naming}, got {self.name!r}")
        if self.ps_mode not in PS_MODES:
            raise ValueError(f"ps_mode must be one of {', '.join(PS_MODES)}, got {self.ps_mode!r}")
        optimizer = self.optimizer
        if not (isinstance(optimizer, tuple) and len(optimizer) == 2 and isinstance(optimizer[0], type)
                and issubclass(optimizer[0], torch.optim.Optimizer) and isinstance(optimizer[1], dict)):
            raise TypeError(f"optimizer must be (a torch.optim.Optimizer class, kwargs dict), got {optimizer!r}")
        checked = {
            "num_trainers": positive_int(self.num_trainers, "num_trainers"),
            "geo_push_every": positive_int(self.geo_push_every, "geo_push_every"),
            "half_async_merge_every": positive_int(self.half_async_merge_every, "half_async_merge_every"),
            "half_async_merge_s": positive_seconds(self.half_async_merge_s, "half_async_merge_s"),
            "timeout": None if self.timeout is None else positive_seconds(self.timeout, "timeout"),
        }
        for key, value in checked.items():  # (frozen: set once, here)
            object.__setattr__(self, key, value)
