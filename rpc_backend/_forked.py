"""Imported only by ``run_local``'s forkserver (``rpc_backend._start.PRELOAD``): every rank it
forks reseeds the random generators that the server's imports created, right after the fork
and before the rank imports the caller's ``__main__``, so that ranks draw different numbers, as
spawned ranks (fresh interpreters) do, and a ``torch.manual_seed`` in the caller's script still
takes effect. Python's ``random`` reseeds itself after a fork."""

from __future__ import annotations

import os
import sys


def _reseed_after_fork() -> None:
    import torch

    torch.default_generator.seed()  # from OS entropy, as a new interpreter seeds it
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()


os.register_at_fork(after_in_child=_reseed_after_fork)
