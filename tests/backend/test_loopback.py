"""Local worlds listen on loopback only."""

from datetime import timedelta

import torch.distributed as dist

from rpc_backend import loopback_env, loopback_store, run_local
from tests._deadlines import HANG_S, SETUP_S
from tests.backend import _sockets


def test_is_loopback_helper():
    assert _sockets.is_loopback("127.0.0.1:80") and _sockets.is_loopback("127.3.2.1:1")
    assert _sockets.is_loopback("::1:80") and _sockets.is_loopback("::ffff:127.0.0.1:5")
    assert not _sockets.is_loopback("0.0.0.0:80") and not _sockets.is_loopback(":::80")
    assert not _sockets.is_loopback("10.1.2.3:80")


def test_local_world_listens_on_loopback_only():
    reports = run_local(_sockets.rank_report, 3, timeout=SETUP_S, rpc_timeout=SETUP_S)
    assert [r["name"] for r in reports] == ["worker0", "worker1", "worker2"]
    assert all(r["listening"] for r in reports), reports  # each rank does listen somewhere...
    for report in reports:
        outside = [a for a in report["listening"] if not _sockets.is_loopback(a)]
        assert outside == [], report  # ...but only on 127.0.0.0/8


def test_loopback_env_names_the_loopback_interface():
    env = loopback_env()
    assert env["TP_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] in ("lo", "lo0")
    assert env["MASTER_ADDR"] == "127.0.0.1"


def test_loopback_store_listens_on_loopback_only():
    store = loopback_store(timeout=HANG_S)
    mine = [a for a in _sockets.listening_addresses() if a.endswith(f":{store.port}")]
    assert mine == [f"127.0.0.1:{store.port}"]  # a plain TCPStore(is_master=True) binds every interface
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=HANG_S))
    client.set("k", "v")
    assert store.get("k") == b"v"
