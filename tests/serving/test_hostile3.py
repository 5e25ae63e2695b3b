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
