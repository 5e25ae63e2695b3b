"""A host that dies: the next calls fail within the proxy's timeout, naming the dead worker,
and proxies on live workers keep working. Its own world (it kills a worker)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from rpc_backend.loopback import fresh_file_rendezvous, loopback_env
from tests import _dead_host

ROOT = Path(__file__).resolve().parent.parent


def test_dead_host_fails_fast_and_others_keep_working():
    init_method, path = fresh_file_rendezvous()
    env = {**os.environ, **loopback_env(), "PYTHONPATH": str(ROOT)}
    procs = {
        role: subprocess.Popen(
            [sys.executable, "-m", "tests._dead_host", role, init_method],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        for role in _dead_host.ROLES
    }
    try:
        out, _ = procs["caller"].communicate(timeout=90)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        if os.path.exists(path):
            os.unlink(path)
    line = next(line for line in out.splitlines() if line.startswith("REPORT "))
    report = json.loads(line[len("REPORT "):])
    limit = report["timeout"] + 3.0
    assert report["before"]["ok"]
    for key in ("sync", "async"):
        failure = report[key]
        assert not failure["ok"], failure
        assert failure["seconds"] < limit, failure
        assert "doomed" in failure["message"], failure
    assert report["survivor"]["ok"] and report["survivor_async"]["ok"]
    after = report["after_shutdown"]
    assert not after["ok"] and after["type"] == "RuntimeError"
    assert "call rpc.init_rpc" in after["message"], after
