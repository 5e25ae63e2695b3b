"""A rank function whose module seeds every generator at import, as a training script's top
level does (for tests/backend/test_launcher.py): run_local's ranks each import it, as spawned
ranks did."""

from __future__ import annotations

import os
import random

import numpy
import torch
import torch.distributed.rpc as rpc

SEED = 1234
random.seed(SEED)
numpy.random.seed(SEED)
torch.manual_seed(SEED)


def expected_draws() -> dict:
    """What the first draws are right after the seeding above (computed in the caller)."""
    py, np_state, torch_state = random.getstate(), numpy.random.get_state(), torch.get_rng_state()
    random.seed(SEED)
    numpy.random.seed(SEED)
    torch.manual_seed(SEED)
    try:
        return {"python": random.random(), "numpy": float(numpy.random.random()), "torch": torch.rand(1).item()}
    finally:
        random.setstate(py)
        numpy.random.set_state(np_state)
        torch.set_rng_state(torch_state)


def exits_and_draws(exit_dir: str) -> dict:
    """Registers an ``atexit`` handler that writes ``exit<rank>`` into ``exit_dir``; returns
    the rank's first draw of each global generator and its default start method."""
    import atexit
    import multiprocessing

    rank = rpc.get_worker_info().id

    def mark_exit() -> None:
        with open(os.path.join(exit_dir, f"exit{rank}"), "w") as f:
            f.write("ran")

    atexit.register(mark_exit)
    return {"python": random.random(), "numpy": float(numpy.random.random()), "torch": torch.rand(1).item(),
            "start_method": multiprocessing.get_start_method()}
