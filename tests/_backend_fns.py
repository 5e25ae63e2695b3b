"""Rank functions for the tests/test_backend_*.py files (run by run_local on every rank)."""

from __future__ import annotations

import operator
import time

import torch.distributed.rpc as rpc


def keep_calling_worker1(seconds: float) -> dict | None:
    """Rank 0 calls worker1 for ``seconds`` while worker1 has already returned (and waits in
    its graceful shutdown). Stops at the first failed call and says when it happened."""
    if rpc.get_worker_info().id != 0:
        return None
    start = time.monotonic()
    calls = 0
    failure = None
    while time.monotonic() - start < seconds:
        try:
            calls = rpc.rpc_sync("worker1", operator.add, (calls, 1), timeout=10)
        except RuntimeError as exc:
            failure = f"{time.monotonic() - start:.1f} s: {exc}"
            break
        time.sleep(0.02)
    return {"calls": calls, "seconds": time.monotonic() - start, "failure": failure}
