"""remote_module._core.fanout across RPC worlds: a worker name is this world's (the WorkerInfos
kept per world: a new world, or a worker that left a dynamic one, is looked up again). Each
case in a process of its own (tests/core/_worlds_script.py: it starts and ends its worlds)."""

import json
import subprocess
import sys

from tests._deadlines import HANG_S, SETUP_S


def _run(case: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.core._worlds_script", case], capture_output=True,
                          text=True, timeout=SETUP_S + HANG_S)  # (a hang guard)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_name_of_the_last_world_is_not_in_the_next():
    """(and a call outside any world says to call init_rpc, as call_async does)"""
    got = _run("reinit")
    for case in ("before_init", "before_init_default_timeout", "after_shutdown"):
        kind, message = got[case]
        assert kind == "RuntimeError" and message.startswith("call_async needs torch.distributed.rpc"), got
    assert got["first_world"] == ["ok", [3]], got
    (kind, message), new_name = got["after_reinit"]
    assert kind == "ValueError" and "worker 'a' is not in this RPC world (workers: b)" in message, got
    assert new_name == ["ok", [3]], got


def test_a_worker_that_left_a_dynamic_world_is_not_in_it():
    """(init_rpc without world_size: its workers join and leave; a name is looked up at each call)"""
    got = _run("leave")
    assert got["before_leave"] == ["ok", [3]], got
    kind, message = got["after_leave"]
    assert kind == "ValueError" and "worker 'w' is not in this RPC world (workers: srv)" in message, got
