"""``is_device_map_set`` describes the receiver's device map towards the host, so it is worked
out again wherever a proxy arrives (no GPU needed: the map lookup and the rule are separate)."""

import pytest
import torch.distributed.rpc as rpc

import remote_module._proxy.pickling as pickling
from remote_module import RemoteModule
from remote_module._core.device import uses_device_map
from tests._faults import gates
from tests.proxy._remote import Affine

pytestmark = pytest.mark.usefixtures("rpc_world")


def test_the_rule():
    assert uses_device_map("cuda:0", {"cuda:0": "cuda:1"}) is True
    assert uses_device_map("cuda:0", {}) is False
    assert uses_device_map("cpu", {"cpu": "cuda:0"}) is False  # a CPU module ignores the map (as torch)


def arrived_state(proxy, **claims):
    rebuild, (cls, state) = pickling.reduce_proxy(proxy)
    return rebuild, cls, {**state, **claims}


def test_a_senders_device_map_does_not_travel():
    proxy = RemoteModule("worker1/cpu", Affine)
    rebuild, cls, state = arrived_state(proxy, device="cuda:0", is_device_map_set=True)
    # this process has no device map towards worker1
    assert rebuild(cls, state).is_device_map_set is False


def test_the_receivers_device_map_counts(monkeypatch):
    proxy = RemoteModule("worker1/cpu", Affine)
    asked = []
    monkeypatch.setattr(pickling, "device_map_to", lambda worker: asked.append(worker) or {"cuda:0": "cuda:0"})
    rebuild, cls, state = arrived_state(proxy, device="cuda:0", is_device_map_set=False)
    assert rebuild(cls, state).is_device_map_set is True and asked == ["worker1"]
    rebuild, cls, state = arrived_state(proxy, device="cpu", is_device_map_set=True)
    assert rebuild(cls, state).is_device_map_set is False


def test_a_proxy_sent_over_rpc_reports_the_receivers_view():
    proxy = RemoteModule("worker1/cpu", Affine)
    proxy.device, proxy.is_device_map_set = "cuda:0", True  # as a sender with a map would see it
    assert rpc.rpc_sync("worker2", gates.attribute, (proxy, "is_device_map_set")) is False
