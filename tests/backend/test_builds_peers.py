"""How often a process asks its peers for their builds (rpc_backend/builds.py, ``check_peer``):
at most once per peer per world, whatever the threads and the memory do; never in a world
compared when it formed, but once for a package declared after that; a mismatch found holds
for the world; a proxy whose first call could not wait still checks later.

One subprocess runs every scenario, each in a world of its own (tests/backend/scripts/
builds_peers.py, whose stand-in for ``rpc_async`` answers the questions in that process).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rpc_backend import loopback_env
from tests._deadlines import HANG_S, SETUP_S

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    where = tmp_path_factory.mktemp("builds_peers")
    done = subprocess.run([sys.executable, "tests/backend/scripts/builds_peers.py", str(where)], cwd=ROOT,
                          capture_output=True, text=True, timeout=SETUP_S + HANG_S,
                          env={**os.environ, **loopback_env(), "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(2 * (SETUP_S + HANG_S))
def test_concurrent_first_calls_share_one_question_per_world(outcomes):
    # 16 threads at once, then 200 calls with allocations between: one question, one answer
    assert outcomes["burst"] == {"questions": 1, "outcomes": ["ok"]}
    assert outcomes["next_world"] == {"questions": 1, "outcomes": ["ok"]}  # a new world asks anew


@pytest.mark.slow
@pytest.mark.timeout(2 * (SETUP_S + HANG_S))
def test_a_mismatch_found_holds_for_the_world_without_asking_again(outcomes):
    assert outcomes["remembered"] == {"questions": 1, "outcomes": ["BuildMismatch"]}


@pytest.mark.slow
@pytest.mark.timeout(2 * (SETUP_S + HANG_S))
def test_a_world_compared_when_it_formed_asks_only_about_packages_declared_later(outcomes):
    assert outcomes["formed"]["before"] == 0
    late = ["late_package_of_this_test"]
    assert sorted(outcomes["formed"]["asked"]) == [["peer1", late], ["peer2", late]]


@pytest.mark.slow
@pytest.mark.timeout(2 * (SETUP_S + HANG_S))
def test_a_proxy_whose_first_call_ran_on_a_handler_thread_checks_later(outcomes):
    found = outcomes["handler_thread_proxy"]
    assert found["first"] == "ok"  # a handler thread never waits for the answer
    assert found["later"].startswith("BuildMismatch: worker 'peer1' cannot be called: "), found
    assert found["questions"] == 1
