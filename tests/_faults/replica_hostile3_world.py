"""Batching replicas whose host is killed or frozen before this process ever called them
(run by tests/serving/test_hostile3.py).

    python -m tests._faults.replica_hostile3_world ROLE INIT_METHOD

ROLE is caller (rank 0), r1 (killed), r2 (frozen, then thawed) or r3. The caller prints one
``REPORT`` line:

- ``frozen``: a ReplicatedModule on r2 and r3 (batching), r2 stopped before any call; how long
  each ``forward_async`` took to return, and each call's outcome;
- ``killed``: a ReplicatedModule on r1 and r3 (batching), r1 killed before any call; each
  call's outcome (r3 answers every one).
"""

import os
import signal
import sys
import time

import torch

from tests._faults.replica_world import Echo, pid  # (x * w; the host's pid)

ROLES = ("caller", "r1", "r2", "r3")
TIMEOUT = 8.0
HEDGE_MS = 200.0


def _outcome(f) -> dict:
    try:
        f.wait()
        return {"ok": True}
    except Exception as exc:  # noqa: BLE001 (reported to the test)
        return {"ok": False, "type": type(exc).__name__, "message": str(exc)[:300]}


def caller() -> None:
    import json

    import torch.distributed.rpc as rpc

    from remote_module.serving import BatchPolicy, ReplicatedModule
    from tests._faults.dead_host import wait_until_dead, wait_until_stopped

    policy = BatchPolicy(max_batch=8, max_wait_ms=1)
    pids = {r: rpc.rpc_sync(r, pid) for r in ("r1", "r2", "r3")}
    x = torch.ones(2, 4)
    report = {}
    frozen = ReplicatedModule(["r2/cpu", "r3/cpu"], Echo, timeout=TIMEOUT, hedge_ms=HEDGE_MS,
                              batching=policy).eval()
    killed = ReplicatedModule(["r1/cpu", "r3/cpu"], Echo, timeout=TIMEOUT, hedge_ms=HEDGE_MS,
                              batching=policy).eval()
    with torch.no_grad():
        os.kill(pids["r2"], signal.SIGSTOP)
        wait_until_stopped(pids["r2"])
        returned, futs = [], []
        for _ in range(4):  # (in turn: one of the first two goes to r2)
            start = time.monotonic()
            futs.append(frozen.forward_async(x))
            returned.append(time.monotonic() - start)
        report["frozen"] = {"returned_s": returned, "calls": [_outcome(f) for f in futs]}
        os.kill(pids["r2"], signal.SIGCONT)
        os.kill(pids["r1"], signal.SIGKILL)
        wait_until_dead(pids["r1"])
        futs = []
        for _ in range(4):
            try:
                futs.append(killed.forward_async(x))
            except Exception as exc:  # noqa: BLE001 (a call that raised at once)
                report.setdefault("raised", []).append(f"{type(exc).__name__}: {exc}"[:300])
        report["killed"] = {"calls": [_outcome(f) for f in futs], "states": killed.replica_states()}
    print("REPORT " + json.dumps(report), flush=True)
    rpc.shutdown(graceful=False)
    os._exit(0)


def main(role: str, init_method: str) -> None:
    from tests._faults.subworld import join_and_serve

    join_and_serve(role, init_method, ROLES, caller)


if __name__ == "__main__":
    main(*sys.argv[1:])
