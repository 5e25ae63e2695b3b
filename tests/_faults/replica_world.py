"""A world of three replicas of one module, one killed and one frozen then thawed while a
caller serves from them (run by tests/serving/test_failover.py).

    python -m tests._faults.replica_world ROLE INIT_METHOD

ROLE is caller (rank 0), r1 (killed with SIGKILL while calls are held in its forward), r2
(frozen with SIGSTOP, then thawed with SIGCONT) or r3. The caller prints one ``REPORT`` line:

- ``killed``: a burst of calls while r1 holds some of them (the replicas batch: r1 holds a
  running batch, with more calls queued in its batcher); r1 is killed then; every call's
  outcome, and the replicas' states after;
- ``frozen``: r2 stopped; a burst of calls; every call's outcome and seconds, the replicas'
  states while r2 is stopped;
- ``thawed``: r2 continued; how long until it is live again, and how many of a later burst it
  answered.

The caller leaves without a graceful shutdown (a peer is dead).
"""

import json
import os
import signal
import sys
import threading
import time

import torch
from torch import nn

from tests._deadlines import HANG_S

ROLES = ("caller", "r1", "r2", "r3")
TIMEOUT = 20.0  # each call's (a frozen replica is hedged after HEDGE_MS, long before)
HEDGE_MS = 300.0

_hold = threading.Event()  # set: forward waits for _open (at most HANG_S)
_open = threading.Event()
_held = [0]
_answered = [0]
_lock = threading.Lock()


class Echo(nn.Module):
    """``x * w`` with a learnt ``w``; counts its answers and can hold its callers."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        if _hold.is_set():
            with _lock:
                _held[0] += 1
            _open.wait(HANG_S)
        with _lock:
            _answered[0] += 1
        return x * self.w


def hold() -> None:
    _hold.set()


def held() -> int:
    with _lock:
        return _held[0]


def answered() -> int:
    with _lock:
        return _answered[0]


def pid() -> int:
    return os.getpid()


def queued() -> int:
    """Calls waiting in this host's batchers."""
    from tests.proxy._batching_remote import queued as batchers_queued

    return batchers_queued()


def _outcomes(futs, start):
    out = []
    for f in futs:
        try:
            f.wait()
            out.append({"ok": True, "seconds": time.monotonic() - start})
        except Exception as exc:  # noqa: BLE001 (reported to the test)
            out.append({"ok": False, "type": type(exc).__name__, "message": str(exc)[:300]})
    return out


def caller() -> None:
    import torch.distributed.rpc as rpc

    from remote_module.serving import BatchPolicy, ReplicatedModule
    from tests._faults.dead_host import wait_until_dead, wait_until_stopped

    # batching replicas: when r1 is killed, one of its batches is running (held) and more calls
    # are queued in its batcher; every one of them is answered by the others
    model = ReplicatedModule(["r1/cpu", "r2/cpu", "r3/cpu"], Echo, timeout=TIMEOUT, hedge_ms=HEDGE_MS,
                             batching=BatchPolicy(max_batch=8, max_wait_ms=1)).eval()
    pids = {r: rpc.rpc_sync(r, pid) for r in ("r1", "r2", "r3")}
    x = torch.ones(2, 4)
    report = {}
    with torch.no_grad():
        want = model(x)
        # killed: r1 holds the calls it gets; once it holds one, it is killed
        rpc.rpc_sync("r1", hold)
        start = time.monotonic()
        futs = [model.forward_async(x) for _ in range(30)]
        deadline = time.monotonic() + HANG_S
        while rpc.rpc_sync("r1", held) < 1 or rpc.rpc_sync("r1", queued) < 1:
            assert time.monotonic() < deadline, "r1 never held a batch with more calls queued"
            time.sleep(0.01)
        report["r1_queued_when_killed"] = rpc.rpc_sync("r1", queued)
        os.kill(pids["r1"], signal.SIGKILL)
        wait_until_dead(pids["r1"])
        report["killed"] = {"calls": _outcomes(futs, start), "states": model.replica_states(),
                            "equal": all(torch.equal(f.wait(), want) for f in futs if _ok(f))}
        # frozen: r2 stopped
        os.kill(pids["r2"], signal.SIGSTOP)
        wait_until_stopped(pids["r2"])
        start = time.monotonic()
        futs = [model.forward_async(x) for _ in range(20)]
        report["frozen"] = {"calls": _outcomes(futs, start), "states": model.replica_states(),
                            "equal": all(torch.equal(f.wait(), want) for f in futs if _ok(f))}
        before = rpc.rpc_sync("r3", answered)
        os.kill(pids["r2"], signal.SIGCONT)
        start = time.monotonic()
        deadline = start + HANG_S
        while model.replica_states()[1]["state"] != "live":
            assert time.monotonic() < deadline, "r2 never taken back"
            time.sleep(0.02)
        back_after = time.monotonic() - start
        r2_before = rpc.rpc_sync("r2", answered)
        futs = [model.forward_async(x) for _ in range(20)]
        calls = _outcomes(futs, time.monotonic())
        report["thawed"] = {"back_after_s": back_after, "calls": calls, "states": model.replica_states(),
                            "r2_answered": rpc.rpc_sync("r2", answered) - r2_before,
                            "r3_answered_while_frozen": before}
    print("REPORT " + json.dumps(report), flush=True)
    rpc.shutdown(graceful=False)
    os._exit(0)


def _ok(f) -> bool:
    try:
        f.wait()
        return True
    except Exception:  # noqa: BLE001
        return False


def main(role: str, init_method: str) -> None:
    from tests._faults.subworld import join_and_serve

    join_and_serve(role, init_method, ROLES, caller)


if __name__ == "__main__":
    main(*sys.argv[1:])
