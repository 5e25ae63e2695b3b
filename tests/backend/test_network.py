"""Zero-configuration networking (rpc_backend/network.py), without namespaces or RPC.

The multi-machine runs are in tests/test_machines.py; here the decisions, with the routing and
interface table injected where a real one would depend on this machine's network.
"""

import logging
import socket
import sys

import pytest

from rpc_backend import loopback_store, network
from rpc_backend.network import IFNAME_VARIABLES, NetworkChoice, choose_network, configure_network, interface_of

TABLE = [("lo", "127.0.0.1"), ("eth0", "10.1.0.2"), ("ib0", "192.168.7.2"), ("lo", "::1"), ("eth0", "fd00::2")]
TORCHRUN = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "RANK": "2", "WORLD_SIZE": "4"}


def routes(table):
    """A route function from a dict: destination -> source address; anything else fails."""
    def route(host, port):
        assert isinstance(port, int)
        if host not in table:
            raise OSError(f"no route toward {host}")
        return table[host]
    return route


def never(*args):
    raise AssertionError("not to be called")


@pytest.fixture(autouse=True)
def _fresh_module_state(monkeypatch):
    monkeypatch.setattr(network, "_reported_partial", False)
    monkeypatch.setattr(network, "_published", set())


def test_is_loopback():
    assert network.is_loopback("127.0.0.1") and network.is_loopback("127.0.1.1") and network.is_loopback("::1")
    assert network.is_loopback("::ffff:127.0.0.1")
    assert not network.is_loopback("10.1.0.2") and not network.is_loopback("fe80::1%eth0")


def test_interface_of_maps_an_address_to_the_interface_holding_it():
    assert interface_of("10.1.0.2", TABLE) == "eth0"
    assert interface_of("192.168.7.2", TABLE) == "ib0"
    assert interface_of("fd00:0::2", TABLE) == "eth0"  # compared as addresses, not strings
    assert interface_of("::ffff:10.1.0.2", TABLE) == "eth0"  # IPv4-mapped
    assert interface_of("10.1.0.3", TABLE) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="interface_addresses reads Linux interfaces")
def test_this_machines_loopback_is_in_the_interface_table():
    table = network.interface_addresses()
    assert ("lo", "127.0.0.1") in table, table
    assert interface_of("127.0.0.1") == "lo"


def test_the_source_address_toward_loopback_is_loopback():
    # a real UDP probe: nothing is sent, the routing table answers
    assert network.is_loopback(network.route_source("127.0.0.1", 29500))
    assert network.is_loopback(network.route_source("localhost", 29500))


def test_a_loopback_master_changes_nothing():
    env = {**TORCHRUN, "MASTER_ADDR": "127.0.0.1"}
    assert choose_network(env) is None  # the real route: one machine, as before
    assert configure_network(env) is None
    assert not any(name in env for name in IFNAME_VARIABLES)


def test_a_master_elsewhere_gives_the_interface_holding_the_source_address():
    choice = choose_network(TORCHRUN, route=routes({"node0": "10.1.0.2"}), interfaces=lambda: TABLE)
    assert choice == NetworkChoice("eth0", "10.1.0.2", "the source address toward MASTER_ADDR=node0")
    # the route decides, not the order of the interfaces: a master on the second network
    choice = choose_network(TORCHRUN, route=routes({"node0": "192.168.7.2"}), interfaces=lambda: TABLE)
    assert choice.interface == "ib0"


@pytest.mark.parametrize("explicit", [
    {"TP_SOCKET_IFNAME": "ib0"},
    {"GLOO_SOCKET_IFNAME": "ib0"},
    {"TP_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"},
])
def test_an_explicit_variable_wins(explicit):
    env = {**TORCHRUN, **explicit}
    assert choose_network(env, route=never, interfaces=never, peer_address=never) is None


def test_setting_one_variable_leaves_both_alone_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(network, "route_source", routes({"node0": "10.1.0.2"}))
    monkeypatch.setattr(network, "interface_addresses", lambda: TABLE)
    env = {**TORCHRUN, "TP_SOCKET_IFNAME": "ib0"}
    with caplog.at_level(logging.INFO, logger="rpc_backend.network"):
        assert configure_network(env) is None
        assert configure_network(env) is None
    assert env["TP_SOCKET_IFNAME"] == "ib0" and "GLOO_SOCKET_IFNAME" not in env
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, caplog.text  # once per process
    assert "TP_SOCKET_IFNAME=ib0" in warned[0].getMessage() and "GLOO_SOCKET_IFNAME" in warned[0].getMessage()


def test_configure_network_sets_both_variables_and_logs_one_line(monkeypatch, caplog):
    monkeypatch.setattr(network, "route_source", routes({"node0": "10.1.0.2"}))
    monkeypatch.setattr(network, "interface_addresses", lambda: TABLE)
    env = dict(TORCHRUN)
    with caplog.at_level(logging.INFO, logger="rpc_backend.network"):
        choice = configure_network(env)
    assert choice.interface == "eth0"
    assert env["TP_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
    lines = [r.getMessage() for r in caplog.records if r.name == "rpc_backend.network"]
    assert len(lines) == 1, lines
    assert "TP_SOCKET_IFNAME=eth0" in lines[0] and "GLOO_SOCKET_IFNAME=eth0" in lines[0] and "10.1.0.2" in lines[0]
    # what it set now counts as explicit: a second call (init_role_process_group's) changes nothing
    assert configure_network(env) is None


def test_an_unresolvable_master_is_left_to_torch(monkeypatch):
    monkeypatch.setattr(network, "route_source", routes({}))
    env = dict(TORCHRUN)
    assert configure_network(env) is None
    assert not any(name in env for name in IFNAME_VARIABLES)


def test_an_address_on_no_interface_names_the_variables(monkeypatch, caplog):
    with pytest.raises(network.InterfaceNotFound, match=r"10\.1\.0\.9.*TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME"):
        choose_network(TORCHRUN, route=routes({"node0": "10.1.0.9"}), interfaces=lambda: TABLE)
    # configure_network then leaves the job as it was before, with a warning
    monkeypatch.setattr(network, "route_source", routes({"node0": "10.1.0.9"}))
    monkeypatch.setattr(network, "interface_addresses", lambda: TABLE)
    env = dict(TORCHRUN)
    assert configure_network(env) is None
    assert not any(name in env for name in IFNAME_VARIABLES)
    assert "10.1.0.9" in caplog.text and "TP_SOCKET_IFNAME" in caplog.text


def test_the_masters_machine_of_one_machine_job_asks_no_peer():
    loop = routes({"node0": "127.0.0.1"})
    assert choose_network(TORCHRUN, route=loop, interfaces=never, peer_address=never) is None
    one = {**TORCHRUN, "GROUP_WORLD_SIZE": "1"}
    assert choose_network(one, route=loop, interfaces=never, peer_address=never) is None


def test_the_masters_machine_routes_toward_a_peer_machine():
    # torchrun's c10d rendezvous sets MASTER_ADDR to the first machine's hostname, which its
    # own hosts file (Debian's layout) puts on 127.0.1.1
    env = {**TORCHRUN, "GROUP_WORLD_SIZE": "2"}
    route = routes({"node0": "127.0.0.1", "10.1.0.3": "10.1.0.2"})
    choice = choose_network(env, route=route, interfaces=lambda: TABLE, peer_address=lambda: "10.1.0.3")
    assert choice.interface == "eth0" and choice.address == "10.1.0.2"
    assert "10.1.0.3" in choice.reason and "MASTER_ADDR=node0" in choice.reason
    with pytest.raises(RuntimeError, match="loopback on this machine too"):
        choose_network(env, route=routes({"node0": "127.0.0.1", "10.1.0.3": "127.0.0.1"}),
                       interfaces=lambda: TABLE, peer_address=lambda: "10.1.0.3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_peer_address_travels_through_the_jobs_store(monkeypatch):
    # one real store on loopback stands for torchrun's agent store; the routes pretend that the
    # publisher is on a second machine (10.1.0.3) and the reader on the master's (10.1.0.2)
    store = loopback_store(timeout=30)
    job = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "GROUP_WORLD_SIZE": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "3"}
    monkeypatch.setattr(network, "route_source", routes({"127.0.0.1": "10.1.0.3"}))
    monkeypatch.setattr(network, "interface_addresses", lambda: [("eth1", "10.1.0.3")])
    second = {**job, "TP_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1"}  # explicit: still publishes
    assert configure_network(second, timeout=30) is None
    assert store.get("rpc_backend/network/3/peer_address") == b"10.1.0.3"

    monkeypatch.setattr(network, "route_source", routes({"127.0.0.1": "127.0.0.1", "10.1.0.3": "10.1.0.2"}))
    monkeypatch.setattr(network, "interface_addresses", lambda: TABLE)
    first = dict(job)
    choice = configure_network(first, timeout=30)
    assert choice.interface == "eth0" and choice.address == "10.1.0.2", choice
    assert first["TP_SOCKET_IFNAME"] == first["GLOO_SOCKET_IFNAME"] == "eth0"
    # the next attempt (a torchrun restart) waits for its own key, not this one's
    assert network.peer_address_key({**job, "TORCHELASTIC_RESTART_COUNT": "4"}) != network.peer_address_key(job)


def test_the_masters_machine_without_a_peer_fails_within_its_timeout_naming_the_fix():
    store = loopback_store(timeout=30)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "GROUP_WORLD_SIZE": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with pytest.raises(RuntimeError, match=r"no rank on another machine published.*TP_SOCKET_IFNAME and GLOO"):
        configure_network(env, timeout=0.5)
    assert not any(name in env for name in IFNAME_VARIABLES)
    without_store = {**env, "TORCHELASTIC_USE_AGENT_STORE": "False", "MASTER_PORT": str(_free_port())}
    with pytest.raises(RuntimeError, match="no agent store"):
        configure_network(without_store, timeout=0.5)


def test_the_peer_address_goes_under_the_attempts_world_when_given(monkeypatch):
    # init_from_env passes its attempt's store prefix (rpc_backend/connect.py): torchrun's
    # restart count differs between machines, the prefix does not
    store = loopback_store(timeout=30)
    job = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "GROUP_WORLD_SIZE": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "1"}
    monkeypatch.setattr(network, "route_source", routes({"127.0.0.1": "10.1.0.3"}))
    monkeypatch.setattr(network, "interface_addresses", lambda: [("eth1", "10.1.0.3")])
    configure_network(dict(job), timeout=30, store_prefix="rpc_backend/world7")
    assert store.get("rpc_backend/world7/network/peer_address") == b"10.1.0.3"
    assert network.peer_address_key(job, "rpc_backend/world7") == "rpc_backend/world7/network/peer_address"
    assert network.peer_address_key(job) == "rpc_backend/network/1/peer_address"  # called by itself: as before
