"""Hostile review (3) of host-side batching: the first-batch check and the training-mode warning."""

import threading
import time

import pytest
import torch
import torch.distributed.rpc as rpc

from remote_module import BatchPolicy, RemoteModule
from tests._deadlines import HANG_S
from tests._faults import gates
from tests.proxy import _batching_remote as host

pytestmark = pytest.mark.usefixtures("rpc_world")

POLICY = BatchPolicy(dim=0, max_batch=64, max_wait_ms=0)


def _holding(gate: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not rpc.rpc_sync("worker1", gates.holding, (gate,)):
        assert time.monotonic() < deadline, "the call never reached its gate"
        time.sleep(0.01)


def test_the_first_no_grad_forward_async_does_not_wait_for_earlier_calls():
    # the first no-grad call of a batching proxy asks the host's training mode, a blocking call
    # in program order: forward_async waited until every earlier call was answered
    proxy = RemoteModule("worker1/cpu", host.RecordingMLP, (3,), batching=POLICY).eval()
    returned = threading.Event()
    got = []

    def burst():  # (one thread: program order is per thread)
        got.append(proxy.forward_async(torch.zeros(1, 8), gate="h3-order", name="h3-order"))  # grad on
        with torch.no_grad():
            got.append(proxy.forward_async(torch.ones(1, 8), name="h3-order"))
        returned.set()

    t = threading.Thread(target=burst, daemon=True)
    t.start()
    _holding("h3-order")
    try:
        ok = returned.wait(5.0)
    finally:
        rpc.rpc_sync("worker1", gates.release, ("h3-order",))
    t.join(HANG_S)
    for f in got:
        f.wait()
    assert ok, "forward_async under no_grad blocked until an earlier call was answered"
