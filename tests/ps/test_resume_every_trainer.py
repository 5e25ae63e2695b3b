"""Resuming a two-trainer sync job as parameter-servers.md says: one trainer loads the servers'
state, every trainer restores its ps_optimizers' settings (an LR scheduler's state_dict() does
not hold the lr: torch keeps it in the optimizer's) and its schedulers; training then goes on
exactly as uninterrupted."""

from __future__ import annotations

import pytest
import torch

from tests.ps import _resume_remote as r
from tests.ps._world import job

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def both(world, fn, *args):
    """``fn(name, trainer, *rest)`` on both trainers at once (``args``: name, *rest)."""
    return world.run({f"trainer{t}": (fn, args[0], t, *args[1:]) for t in range(2)})


def test_a_resumed_sync_job_trains_as_uninterrupted(world):
    whole, first, resumed = job("resume-whole"), job("resume-first"), job("resume-again")
    for name in (whole, first):
        both(world, r.build, name)
    want = both(world, r.train, whole, 0, 4)
    saved = both(world, r.train, first, 0, 2)["trainer0"]
    both(world, r.build, resumed)
    world.run({"trainer0": (r.resume, resumed, 0, saved)})  # the servers' state, once
    world.run({"trainer1": (r.resume, resumed, 1, saved)})
    got = both(world, r.train, resumed, 2, 2)
    for t in ("trainer0", "trainer1"):
        for key, value in want["trainer0"]["state"].items():
            torch.testing.assert_close(got[t]["state"][key], value, rtol=1e-5, atol=1e-6, msg=f"{t} {key}")
        assert got[t]["optim"]["ps_optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.2 * 0.5 ** 4)
