"""A small world whose host is killed mid-run (run by tests/proxy/test_dead_host.py).

    python -m tests._faults.dead_host ROLE INIT_METHOD

ROLE is caller (rank 0), doomed (rank 1, killed by the caller with SIGKILL once it answered
a call) or survivor (rank 2). The caller prints one JSON line with what it saw and leaves
without a graceful shutdown (a peer is dead).
"""

import json
import os
import signal
import sys
import time

from tests._deadlines import HANG_S

ROLES = ("caller", "doomed", "survivor")
#: the timeout of the calls to the doomed host (the survivor's calls get HANG_S: they must work)
TIMEOUT = 5.0


def wait_until_dead(pid: int, seconds: float = HANG_S) -> None:
    """Poll until ``pid`` is gone or a zombie (the host runs on this Linux machine)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # killed, not yet reaped
                    return
        except (FileNotFoundError, ProcessLookupError):  # gone (ESRCH: reaped while being read)
            return
        time.sleep(0.02)
    raise AssertionError(f"hang guard: process {pid} still alive after {seconds} s")


def wait_until_stopped(pid: int, seconds: float = HANG_S) -> None:
    """Poll until ``pid`` is stopped (SIGSTOP has taken effect: state T), so that nothing it does
    after the signal was sent is mistaken for an answer from a frozen process."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.005)
    raise AssertionError(f"hang guard: process {pid} not stopped after {seconds} s")


def attempt(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return {"ok": False, "type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {"ok": True, "seconds": time.monotonic() - start}


def caller() -> None:
    import torch
    import torch.distributed.rpc as rpc

    from remote_module import RemoteModule
    from tests.proxy import _contract_remote as cr

    doomed = RemoteModule("doomed/cpu", torch.nn.Linear, (4, 4), timeout=HANG_S)
    survivor = RemoteModule("survivor/cpu", torch.nn.Linear, (4, 4), timeout=HANG_S)
    agent_default = RemoteModule("survivor/cpu", torch.nn.Linear, (4, 4))  # timeout=None
    x = torch.ones(1, 4)
    before = attempt(lambda: doomed(x))
    pid = rpc.rpc_sync("doomed", cr.pid)  # answered: killed only now (not while it answers)
    os.kill(pid, signal.SIGKILL)
    wait_until_dead(pid)
    doomed.timeout = TIMEOUT
    report = {
        "before": before,
        "sync": attempt(lambda: doomed(x)),
        "async": attempt(lambda: doomed.forward_async(x).wait()),
        "survivor": attempt(lambda: survivor(x)),
        "survivor_async": attempt(lambda: survivor.forward_async(x).wait()),
        "timeout": TIMEOUT,
    }
    rpc.shutdown(graceful=False)  # a peer is dead: no barrier
    report["after_shutdown"] = attempt(lambda: survivor(x))
    report["after_shutdown_agent_default"] = [
        attempt(lambda: agent_default(x)),
        attempt(lambda: agent_default.forward_async(x).wait()),
        attempt(lambda: agent_default.training),
    ]
    print("REPORT " + json.dumps(report), flush=True)
    os._exit(0)


def main(role: str, init_method: str) -> None:
    from tests._faults.subworld import join_and_serve

    join_and_serve(role, init_method, ROLES, caller)


if __name__ == "__main__":
    main(*sys.argv[1:])
