"""A scheduler on the ps_optimizer of a collection inside a PSModel: ``model.step()`` steps the
collection's ps_optimizer, as the collection's own ``step()`` does, so torch's scheduler counts
it as the optimizer's step (no "lr_scheduler.step() before optimizer.step()" warning), as a
local loop's optimizer.step() then scheduler.step() gives none."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.ps import _collection_schedule_remote as r
from tests.ps._world import job

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def local_lrs(steps: int) -> tuple[list[str], list[float]]:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(2)]
    opt = torch.optim.SGD(groups, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            opt.step()
            sched.step()
    return [str(w.message) for w in caught], [g["lr"] for g in opt.param_groups]


def test_model_step_counts_as_the_collections_optimizer_step(world):
    got = world.run({"trainer0": (r.scheduled_in_psmodel, job("sched-in-psmodel"), 3)})["trainer0"]
    order = [w for w in got["warnings"] if "lr_scheduler.step()" in w]
    assert order == [], got["warnings"]
    local_warnings, lrs = local_lrs(3)
    assert local_warnings == []
    assert got["lrs"] == pytest.approx(lrs)  # the schedule reached every table: 0.1 halved 3 times
