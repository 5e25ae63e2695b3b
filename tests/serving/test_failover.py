"""ReplicatedModule when replicas fail (tests/_faults/replica_world.py): a killed replica is
dropped and its calls in flight answered by others, none failing; a frozen one is set aside
after the hedge delay, every call completing within its timeout, and taken back once thawed."""

import pytest

from tests._deadlines import HANG_S, SETUP_S
from tests._faults import replica_world
from tests._faults.subworld import run_report

pytestmark = pytest.mark.slow


def test_a_killed_and_a_frozen_replica():
    report = run_report("tests._faults.replica_world", list(replica_world.ROLES), timeout=SETUP_S + 2 * HANG_S)
    killed, frozen, thawed = report["killed"], report["frozen"], report["thawed"]
    assert report["r1_queued_when_killed"] >= 1  # killed in the middle of a batch, with calls queued
    assert all(c["ok"] for c in killed["calls"]), killed["calls"]
    assert killed["equal"]
    assert killed["states"][0]["state"] == "lost" and killed["states"][0]["why"], killed["states"]
    assert all(c["ok"] for c in frozen["calls"]), frozen["calls"]
    assert frozen["equal"]
    assert max(c["seconds"] for c in frozen["calls"]) < replica_world.TIMEOUT
    assert frozen["states"][1]["state"] == "set aside", frozen["states"]
    assert all(c["ok"] for c in thawed["calls"]), thawed["calls"]
    assert thawed["states"][1]["state"] == "live" and thawed["r2_answered"] > 0, thawed
