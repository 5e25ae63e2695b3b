"""Importable helpers for the same-script shipping jobs (tests/proxy/scripts/same_script_job.py).

They run on the host and report what the host really holds, judged against the host's own
``__main__`` (which is ``__mp_main__`` in spawned children).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn


class Holder(nn.Module):
    """An importable module class whose constructor takes nested user objects."""

    def __init__(self, items: list, extra: dict | None = None) -> None:
        super().__init__()
        self.items = list(items)
        self.extra = dict(extra or {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * sum(c.scale for c in (*self.items, *self.extra.values()))


def host_view(rref: Any) -> dict:
    """What the host object behind ``rref`` is, seen from the host's own ``__main__``."""
    obj = rref.local_value()
    main = sys.modules["__main__"]
    own = getattr(main, type(obj).__qualname__, None)
    own_config = getattr(main, "Config", None)
    configs = [*getattr(obj, "items", ()), *getattr(obj, "extra", {}).values()]
    if hasattr(obj, "cfg"):
        configs.append(obj.cfg)
    return {
        "main": main.__name__,
        "type": type(obj).__qualname__,
        "own_class": own is type(obj),
        "own_instances": getattr(own, "instances", None),
        "configs_own": [type(c) is own_config for c in configs],
        "config_scales": [c.scale for c in configs],
    }
