"""Async retries of a step that failed on a frozen ps1 after ps0 applied its part (the retry
leaves out what ps0 applied): ps0's values against torch's. Their own small world (driver, ps0,
ps1, trainer0), since ps1 is frozen in it."""

from __future__ import annotations

import pytest
import torch

from tests.ps import _retry_remote as r
from tests.ps._world import job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TIMEOUT = 2.0


@pytest.fixture(scope="module")
def world():
    from tests.ps._world import PSWorld

    with PSWorld({"ps": 2, "trainer": 1}) as w:
        yield w


def on(world, fn, *args, timeout=30):
    return world.run({"trainer0": (fn, *args)}, timeout=timeout)["trainer0"]


def fail_on_frozen_ps1(world, do, name, after):
    """step() with ps1 frozen (returns in flight), then ``after`` fails naming ps1; thawed."""
    world.freeze("ps1")
    try:
        step = on(world, do, name, "step")
        later = on(world, do, name, *after)
    finally:
        world.thaw("ps1")
    assert step["ok"], step
    assert not later["ok"] and "'ps1'" in later["message"], later


def test_a_table_retry_after_a_backward_with_no_rows_on_ps0_still_counts_a_step_there(world):
    """SparseAdam counts one step of the whole table per step (an empty push where a server
    holds none of the rows). Step 1 ([1, 15]) applied on ps0, failed on ps1; a backward of [16]
    (ps1's) since; the retry is a step for ps0 too (as a PSModel's, whose retry after a new
    backward pushes ps0 again), so after a third step ([1]) ps0's rows equal torch's three
    steps (its bias correction counts 3)."""
    opt = (torch.optim.SparseAdam, {"lr": 0.1})
    name = job("table-retry-count")
    on(world, r.table_prepare, name, opt, TIMEOUT)
    fail_on_frozen_ps1(world, r.table_do, name, ("flush",))
    assert on(world, r.table_do, name, "backward", [16])["ok"]
    assert on(world, r.table_do, name, "retry")["ok"]
    assert on(world, r.table_do, name, "train", [1])["ok"]
    rows = on(world, r.table_do, name, "rows")["value"]
    ref = r.table_torch(opt, [[1, 15], [16], [1]])
    torch.testing.assert_close(rows[:10], ref[:10])


def test_a_psmodel_retry_pushes_no_zero_gradient_to_ps0_for_a_parameter_the_new_backward_left_out(world):
    """SGD with momentum: step 1 applied on ps0 (a, c), failed on ps1 (b); a new forward and
    backward that does not use c; the retry pushes ps0 the new gradient of a, and nothing of c
    (torch leaves a parameter without a gradient alone: no momentum step on a zero one)."""
    opt = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    name = job("model-retry-unused")
    on(world, r.model_prepare, name, TIMEOUT, opt)
    fail_on_frozen_ps1(world, r.model_do, name, ("forward",))
    assert on(world, r.model_do, name, "forward", False)["ok"]
    assert on(world, r.model_do, name, "retry")["ok"]
    values = on(world, r.model_do, name, "values")["value"]
    ref = r.model_torch(opt, [True, False])
    for pname in ("a.weight", "a.bias", "c"):
        torch.testing.assert_close(values[pname].reshape(ref[pname].shape), ref[pname], msg=pname)
