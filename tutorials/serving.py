"""Serving one module to many callers: host-side batching, and replicas with failover.

    python tutorials/serving.py      (or: python -m tutorials.serving)

Six local processes: ``client0`` drives; ``client0``, ``client1`` and ``client2`` make calls;
``server0``, ``server1`` and ``server2`` host the model and run no code of their own. Two parts:

1. **Batching.** A small MLP on ``server0``, made with ``batching=BatchPolicy(...)`` and put in
   eval mode. The three clients each make 16 batch-1 calls under ``no_grad`` at once; the host
   joins the calls that arrive together into one forward. Printed: the calls made, the
   forwards the host ran, and the largest difference of any result from the local model.
2. **Replicas with failover.** The same MLP on the three servers (``ReplicatedModule``, built
   on ``server0`` and copied to the others). A burst of calls is made and ``server2`` is
   killed (SIGKILL) right after; the calls it had are answered by the others. Printed: the
   calls that failed (none) and each replica's state.

The servers are an expendable role (``run_local(..., expendable=["server"])``), so losing one
ends nothing; the world's watcher names the lost server within ``lost_after`` (3 s here).
Classes and functions the servers run are module level here and referred to through the
module's importable name (``tutorials.serving``), so RPC sends them by reference.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # `python tutorials/serving.py`: the servers import tutorials.serving
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed.rpc as rpc
from torch import nn

from remote_module import BatchPolicy, RemoteModule
from remote_module.serving import ReplicatedModule
from rpc_backend import lost_workers, run_local

CLIENTS = ["client0", "client1", "client2"]
SERVERS = ["server0/cpu", "server1/cpu", "server2/cpu"]

# ---- what the servers and clients run (module level: RPC sends it by reference) -------------

_forwards = [0]
_lock = threading.Lock()


class MLP(nn.Module):
    """Two linear layers; counts the forwards it runs on its host."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _lock:
            _forwards[0] += 1
        return self.net(x)


def forwards_run() -> int:
    """(On a server) the forwards its MLPs have run."""
    with _lock:
        return _forwards[0]


def make_calls(model, xs: torch.Tensor) -> torch.Tensor:
    """(On a client) one batch-1 call per row of ``xs``, all in flight at once; the results."""
    with torch.no_grad():
        futures = [model.forward_async(x.unsqueeze(0)) for x in xs]
        return torch.cat([f.wait() for f in futures])


def pid() -> int:
    return os.getpid()


# ---- the driver -----------------------------------------------------------------------------


def batching(local: nn.Module) -> float:
    import tutorials.serving as here

    mlp = RemoteModule("server0/cpu", here.MLP, batching=BatchPolicy(max_batch=32, max_wait_ms=5)).eval()
    mlp.load_state_dict(local.state_dict())
    inputs = {c: torch.randn(16, 16) for c in CLIENTS}
    before = rpc.rpc_sync("server0", here.forwards_run)
    futures = {c: rpc.rpc_async(c, here.make_calls, (mlp, x)) for c, x in inputs.items()}  # the proxy travels
    results = {c: f.wait() for c, f in futures.items()}
    ran = rpc.rpc_sync("server0", here.forwards_run) - before
    with torch.no_grad():
        diff = max((results[c] - local(x)).abs().max().item() for c, x in inputs.items())
    print(f"batching: {16 * len(CLIENTS)} calls from {len(CLIENTS)} clients, {ran} forwards on server0; "
          f"max difference from the local model: {diff:.2e}")
    return diff


def failover(local: nn.Module) -> int:
    import tutorials.serving as here

    model = ReplicatedModule(SERVERS, here.MLP, hedge_ms=500).eval()
    model.load_state_dict(local.state_dict())
    x = torch.randn(1, 16)
    doomed = rpc.rpc_sync("server2", here.pid)
    with torch.no_grad():
        futures = [model.forward_async(x) for _ in range(30)]  # spread over the three servers
        os.kill(doomed, signal.SIGKILL)  # server2 dies with some of them
        futures += [model.forward_async(x) for _ in range(30)]
        failed = 0
        for f in futures:
            try:
                assert torch.allclose(f.wait(), local(x), atol=1e-6)
            except Exception as exc:  # noqa: BLE001 (counted and shown)
                failed += 1
                print(f"  a call failed: {exc}")
    print(f"failover: {len(futures)} calls, {failed} failed")
    for state in model.replica_states():
        why = f" ({state['why'][:60]}...)" if state["why"] else ""
        print(f"  {state['worker']}: {state['state']}{why}")
    # the world's watcher names the lost server too, within lost_after; the job's graceful end
    # then goes on without it (this rank leads the end, so it waits to know first)
    start = time.monotonic()
    while "server2" not in [w.name for w in lost_workers()]:
        if time.monotonic() - start > 60:
            raise RuntimeError("server2 was never named lost")
        time.sleep(0.1)
    print(f"the watcher named server2 lost after {time.monotonic() - start:.1f} s")
    return failed


def main() -> tuple | None:
    if rpc.get_worker_info().name != "client0":
        return None  # the other clients make calls when asked; the servers host
    torch.manual_seed(0)
    local = MLP().eval()
    diff = batching(local)
    failed = failover(local)
    return diff, failed


if __name__ == "__main__":
    print("Starting 6 local processes (client0 drives; three clients call, three servers host)...", flush=True)
    out = run_local(main, 6, roles={"client": 3, "server": 3}, expendable=["server"], lost_after=3, timeout=300,
                    progress=lambda message: print(f"  {message}", flush=True))
    diff, failed = out[0]
    if diff > 1e-5 or failed:
        raise SystemExit(f"unexpected results: difference {diff}, {failed} calls failed")
