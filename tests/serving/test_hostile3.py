"""Hostile review (3) of ReplicatedModule with batching replicas: a replica killed or frozen
before this process called it (tests/_faults/replica_hostile3_world.py)."""

import pytest

from tests._deadlines import HANG_S, SETUP_S
from tests._faults import replica_hostile3_world as world
from tests._faults.subworld import run_report

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report():
    return run_report("tests._faults.replica_hostile3_world", list(world.ROLES), timeout=SETUP_S + 2 * HANG_S)


def test_a_replica_killed_before_its_first_call_is_failed_over(report):
    # a batching replica's first call asked its host for its training mode (a blocking RPC) in
    # _send: the dead host's error failed the caller's call instead of dropping the replica
    assert "raised" not in report, report
    calls = report["killed"]["calls"]
    assert all(c["ok"] for c in calls), calls
    assert report["killed"]["states"][0]["state"] == "lost", report["killed"]["states"]


def test_a_replica_frozen_before_its_first_call_does_not_block_forward_async(report):
    # the same blocking training-mode RPC to a stopped host held forward_async for the timeout
    frozen = report["frozen"]
    assert all(c["ok"] for c in frozen["calls"]), frozen["calls"]
    assert max(frozen["returned_s"]) < world.TIMEOUT / 2, frozen["returned_s"]


@pytest.mark.usefixtures("rpc_world")
def test_a_call_whose_rpc_times_out_a_moment_early_still_fails_at_its_deadline(monkeypatch):
    # torch's RPC timeout (whole ms) ends a moment before the call's deadline: _send then leaves
    # the call to the watcher, which holds it weakly (held: the call is still failed at its deadline)
    import gc
    import time

    import torch
    import torch.distributed.rpc as rpc

    from remote_module._proxy import calls
    from remote_module.serving import ReplicatedModule
    from tests._faults import gates
    from tests.proxy import _batching_remote as host

    model = ReplicatedModule(["worker1/cpu"], host.RecordingMLP, (31,), timeout=2.0, hedge_ms=60_000).eval()
    real = calls.rpc_timeout_argument  # (torch's early end, made longer than a race: 0.3 s)
    monkeypatch.setattr(calls, "rpc_timeout_argument", lambda remaining: real(max(remaining - 0.3, 0.001)))
    try:
        with torch.no_grad():
            futs = [model.forward_async(torch.zeros(1, 8), gate="h3-early", name="h3-early") for _ in range(4)]
        deadline = time.monotonic() + 2.0 + 10.0
        while not all(f.done() for f in futs):
            gc.collect()
            assert time.monotonic() < deadline, [f.done() for f in futs]
            time.sleep(0.02)
    finally:
        rpc.rpc_sync("worker1", gates.release, ("h3-early",))
    for f in futs:
        with pytest.raises(Exception, match="no answer within"):
            f.wait()
