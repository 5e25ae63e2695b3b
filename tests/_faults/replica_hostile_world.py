"""A world of four replicas that a hostile caller kills and freezes (run by
tests/serving/test_replicas_hostile.py::test_kills_and_freezes).

    python -m tests._faults.replica_hostile_world ROLE INIT_METHOD

ROLE is caller (rank 0) or r1..r5 (r5: the one replica of a second module). The caller prints one ``REPORT`` line:

- ``unnoticed``: r1 killed, no call made since: what ``state_dict()`` and ``eval()`` do;
- ``burst``: 200 calls sent, r2 and r3 killed while they are in flight: every call's outcome;
- ``frozen``: r4 (the only live replica) stopped: calls' outcomes and seconds (timeout TIMEOUT);
- ``killed_frozen``: calls sent to the frozen r4, then it is killed: outcomes and seconds,
  then one more call (no replica left): its outcome and seconds;
- ``shutdown``: r5 (a second module's only replica) stopped, calls in flight to it and its
  probes running, ``rpc.shutdown(graceful=False)``: whether it returned, the calls' outcomes,
  and what was written to stderr meanwhile (callbacks that raised).
"""

import json
import os
import signal
import sys
import time

import torch

from tests._faults.replica_world import Echo, pid  # (x * w; the host's pid)

ROLES = ("caller", "r1", "r2", "r3", "r4", "r5")
TIMEOUT = 3.0


def _outcome(f, start, bound):
    deadline = time.monotonic() + bound
    while not f.done():
        if time.monotonic() > deadline:
            return {"ok": False, "type": "HANG", "seconds": time.monotonic() - start}
        time.sleep(0.01)
    try:
        f.wait()
        return {"ok": True, "seconds": time.monotonic() - start}
    except Exception as exc:  # noqa: BLE001 (reported to the test)
        return {"ok": False, "type": type(exc).__name__, "message": str(exc)[:300],
                "seconds": time.monotonic() - start}


def _try(fn):
    try:
        fn()
        return {"ok": True}
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "type": type(exc).__name__, "message": str(exc)[:300]}


def caller() -> None:
    import torch.distributed.rpc as rpc

    from remote_module.serving import ReplicatedModule
    from tests._deadlines import HANG_S
    from tests._faults.dead_host import wait_until_dead, wait_until_stopped

    names = ("r1", "r2", "r3", "r4")
    model = ReplicatedModule([f"{r}/cpu" for r in names], Echo, timeout=60, hedge_ms=300).eval()
    model.timeout_s = 20.0
    lone = ReplicatedModule(["r5/cpu"], Echo, timeout=60, hedge_ms=100).eval()
    pids = {r: rpc.rpc_sync(r, pid) for r in names + ("r5",)}
    x = torch.ones(2, 4)
    report = {}

    def kill(r):
        os.kill(pids[r], signal.SIGKILL)
        wait_until_dead(pids[r])

    with torch.no_grad():
        model(x)
        kill("r1")
        report["unnoticed"] = {"state_dict": _try(model.state_dict), "eval": _try(model.eval),
                               "states": model.replica_states()}
        start = time.monotonic()
        futs = [model.forward_async(x) for _ in range(200)]
        kill("r2")
        kill("r3")
        report["burst"] = {"calls": [_outcome(f, start, HANG_S) for f in futs], "states": model.replica_states()}
        model.timeout_s = TIMEOUT
        os.kill(pids["r4"], signal.SIGSTOP)
        wait_until_stopped(pids["r4"])
        start = time.monotonic()
        futs = [model.forward_async(x) for _ in range(5)]
        report["frozen"] = {"calls": [_outcome(f, start, HANG_S) for f in futs], "states": model.replica_states()}
        model.timeout_s = 20.0
        start = time.monotonic()
        futs = [model.forward_async(x) for _ in range(5)]
        time.sleep(0.5)  # (the calls are in flight to the frozen replicas, not a timing assertion)
        kill("r4")
        calls = [_outcome(f, start, HANG_S) for f in futs]
        start = time.monotonic()
        after = _outcome(model.forward_async(x), start, HANG_S)
        report["killed_frozen"] = {"calls": calls, "after": after, "states": model.replica_states()}
        os.kill(pids["r5"], signal.SIGSTOP)
        wait_until_stopped(pids["r5"])
        start = time.monotonic()
        futs = [lone.forward_async(x) for _ in range(5)]
        deadline = time.monotonic() + HANG_S
        while lone.replica_states()[0]["state"] != "set aside":  # (probes running)
            assert time.monotonic() < deadline, "r5 never set aside"
            time.sleep(0.01)
    err_path = f"/tmp/replica_hostile_{os.getpid()}.err"
    saved = os.dup(2)
    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    import threading

    done = threading.Event()
    threading.Thread(target=lambda: (rpc.shutdown(graceful=False), done.set()), daemon=True).start()
    returned = done.wait(60)
    calls = [_outcome(f, start, 60) for f in futs]
    time.sleep(2.5)  # (lets a probe's callback run after the shutdown; not a timing assertion)
    os.dup2(saved, 2)
    report["shutdown"] = {"returned": returned, "calls": calls, "stderr": open(err_path).read()[-2000:],
                          "states": lone.replica_states()}
    os.unlink(err_path)
    os.kill(pids["r5"], signal.SIGKILL)
    print("REPORT " + json.dumps(report), flush=True)
    os._exit(0)


def main(role: str, init_method: str) -> None:
    from tests._faults.subworld import join_and_serve

    join_and_serve(role, init_method, ROLES, caller)


if __name__ == "__main__":
    main(*sys.argv[1:])
