"""Which network interface a rank's TensorPipe and Gloo use, found without configuration.

TensorPipe and Gloo listen on, and advertise to their peers, the address of the interface
named by ``TP_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME``. Without those variables both look up
the machine's hostname, and on the hosts file Debian and Ubuntu installs write (the machine's
own name on 127.0.1.1) that is loopback: every rank then tells the others to reach it on
127.0.0.1 or 127.0.1.1, and a job across machines fails in Gloo's ``connectFullMesh``.

:func:`configure_network` (which :func:`~rpc_backend.init_from_env` and
:func:`~rpc_backend.init_role_process_group` call before starting TensorPipe or Gloo) sets both
variables for this process when neither is set:

* the master (``MASTER_ADDR``, an address or a hostname) is not loopback here: the address is
  the source address the kernel picks toward it (a UDP socket connected to
  ``MASTER_ADDR:MASTER_PORT``, then ``getsockname``; connecting a UDP socket sends nothing),
  and the interface is the one holding that address;
* the master is loopback here but torchrun says the job spans machines (``GROUP_WORLD_SIZE`` >
  1): this is the master's own machine, whose name resolves to loopback. Every rank on the
  other machines publishes its own source address in the job's store (torchrun's agent store),
  and the ranks here take the source address toward the first one published;
* otherwise (one machine: a loopback master, ``run_local``, ``--standalone`` on a machine
  whose name is on loopback) nothing changes.

Explicit variables always win: with either of them set, this leaves both alone (setting only
one is reported, once: the other library would still look up the hostname). One line on the
``rpc_backend.network`` logger (INFO) names what was chosen.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
import sys
from datetime import timedelta
from typing import Callable, Iterable, Mapping, MutableMapping, NamedTuple

from rpc_backend.options import DEFAULT_CONNECT_TIMEOUT

#: The variables TensorPipe and Gloo read for the interface to listen on.
IFNAME_VARIABLES = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
#: Seconds the master's machine waits for a rank on another machine to publish its address
#: when :func:`configure_network` is called by itself (``init_from_env`` counts that wait in its
#: bound, ``connect_timeout``).
DEFAULT_PEER_WAIT = DEFAULT_CONNECT_TIMEOUT
#: The store key (under the restart count) where ranks on other machines publish their address.
PEER_ADDRESS_KEY = "rpc_backend/network/{restart}/peer_address"
#: The same key under the store prefix of one attempt's world (see rpc_backend/connect.py).
PREFIXED_PEER_ADDRESS_KEY = "{prefix}/network/peer_address"

_log = logging.getLogger("rpc_backend.network")
_SIOCGIFADDR = 0x8915  # Linux <linux/sockios.h>
_reported_partial = False
_published: set[str] = set()


class InterfaceNotFound(RuntimeError):
    """The address toward the peers is on no interface this module can read (see
    :func:`interface_addresses`): the variables are then left as they are."""


class NetworkChoice(NamedTuple):
    """What :func:`choose_network` picked: an interface, its address, and why."""

    interface: str
    address: str
    #: how the address was found, for the log line, e.g. "the source address toward MASTER_ADDR=node0"
    reason: str


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    parsed = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 scope ("fe80::1%eth0")
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return parsed.ipv4_mapped
    return parsed


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ``::1`` and IPv4-mapped loopback.

    Example::

        >>> is_loopback("127.0.1.1"), is_loopback("::ffff:127.0.0.1"), is_loopback("10.0.0.2")
        (True, True, False)
    """
    return _ip(address).is_loopback


def route_source(host: str, port: int) -> str:
    """The source address this machine's kernel picks for traffic toward ``host:port``.

    ``host`` is an address or a name (resolved as a connect would). A UDP socket is connected
    to it and asked for its own address: connecting a UDP socket only consults the routing
    table, it sends nothing. Raises ``OSError`` when the name does not resolve or no route
    leads there.

    Example::

        route_source("10.0.0.1", 29500)   # "10.0.0.2" on a machine whose eth0 holds 10.0.0.2
        route_source("localhost", 29500)  # "127.0.0.1" (or "::1")
    """
    errors: list[OSError] = []
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(sockaddr)
                return str(probe.getsockname()[0])
        except OSError as exc:
            errors.append(exc)
    raise OSError(f"no route from this machine toward {host}:{port}: {errors[0] if errors else 'no address'}")


def interface_addresses() -> list[tuple[str, str]]:
    """``(interface, address)`` for the addresses of this machine's interfaces (Linux).

    IPv4: each interface's address (``SIOCGIFADDR``, the one TensorPipe and Gloo advertise for
    it); IPv6: ``/proc/net/if_inet6``. Elsewhere, or where neither can be read, ``[]``.

    Example::

        interface_addresses()   # [("lo", "127.0.0.1"), ("eth0", "10.0.0.2"), ("lo", "::1"), ...]
    """
    if not sys.platform.startswith("linux"):
        return []
    found: list[tuple[str, str]] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            found.append((name, socket.inet_ntoa(reply[20:24])))
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) >= 6:
                    found.append((fields[5], str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))))
    except OSError:
        pass
    return found


def interface_of(address: str, table: Iterable[tuple[str, str]] | None = None) -> str | None:
    """The interface that holds ``address`` in ``table`` (default: :func:`interface_addresses`).

    Example::

        >>> interface_of("10.0.0.2", [("lo", "127.0.0.1"), ("eth0", "10.0.0.2")])
        'eth0'
        >>> interface_of("10.9.9.9", [("eth0", "10.0.0.2")]) is None
        True
    """
    wanted = _ip(address)
    for name, held in interface_addresses() if table is None else table:
        if _ip(held) == wanted:
            return name
    return None


def spans_machines(env: Mapping[str, str]) -> bool:
    """True when torchrun says the job runs on more than one machine (``GROUP_WORLD_SIZE`` > 1)."""
    try:
        return int(env.get("GROUP_WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def explicit_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The interface variables ``env`` sets (non-empty), by name."""
    return {name: env[name] for name in IFNAME_VARIABLES if env.get(name)}


def peer_address_key(env: Mapping[str, str], store_prefix: str | None = None) -> str:
    """The store key of the published peer address for this attempt: under ``store_prefix``
    (the attempt's world, as ``init_from_env`` passes it) when given, else under torchrun's
    restart count (which agrees across machines only when every machine restarted as often)."""
    if store_prefix:
        return PREFIXED_PEER_ADDRESS_KEY.format(prefix=store_prefix)
    return PEER_ADDRESS_KEY.format(restart=env.get("TORCHELASTIC_RESTART_COUNT", "0"))


def choose_network(
    env: Mapping[str, str],
    *,
    route: Callable[[str, int], str] | None = None,
    interfaces: Callable[[], Iterable[tuple[str, str]]] | None = None,
    peer_address: Callable[[], str] | None = None,
) -> NetworkChoice | None:
    """The interface this rank should use, or ``None`` to leave the variables as they are.

    ``None`` when either variable of :data:`IFNAME_VARIABLES` is set (explicit wins), when
    ``MASTER_ADDR``/``MASTER_PORT`` are missing, and when the master is loopback here on a job
    of one machine. A master that is loopback here on a job across machines is this machine's
    own: ``peer_address()`` then gives the address of a rank on another machine, and the
    source address toward it is used (without ``peer_address``, ``None``). Raises
    :class:`InterfaceNotFound` when the address found belongs to no interface in the table
    (name the interface yourself then), and ``OSError`` when ``MASTER_ADDR`` does not resolve
    or no route leads there. ``route`` and ``interfaces`` default to :func:`route_source` and
    :func:`interface_addresses`.

    Example::

        choose_network({"MASTER_ADDR": "node0", "MASTER_PORT": "29500"})
        # NetworkChoice(interface='eth0', address='10.0.0.2', reason='the source address toward MASTER_ADDR=node0')
    """
    route = route_source if route is None else route
    interfaces = interface_addresses if interfaces is None else interfaces
    if explicit_variables(env):
        return None
    master, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not master or not port:
        return None
    source = route(master, int(port))
    reason = f"the source address toward MASTER_ADDR={master}"
    if is_loopback(source):
        if not spans_machines(env) or peer_address is None:
            return None  # one machine: as before
        peer = peer_address()
        source = route(peer, int(port))
        reason = (f"MASTER_ADDR={master} is this machine on loopback, so the source address toward "
                  f"{peer}, a rank on another machine")
        if is_loopback(source):
            raise RuntimeError(
                f"a rank on another machine published {peer}, which is loopback on this machine too; "
                f"set {' and '.join(IFNAME_VARIABLES)} to the interface of the network the machines share"
            )
    table = list(interfaces())
    interface = interface_of(source, table)
    if interface is None:
        raise InterfaceNotFound(
            f"this machine's address toward its peers is {source} ({reason}), but no interface holds it "
            f"(interfaces: {', '.join(sorted({f'{n} {a}' for n, a in table})) or 'none readable'}); "
            f"set {' and '.join(IFNAME_VARIABLES)} to the interface of the network the machines share"
        )
    return NetworkChoice(interface, source, reason)


def _store(env: Mapping[str, str], timeout: float):  # -> torch.distributed.TCPStore
    import torch.distributed as dist

    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout))


def _publish_own_address(env: Mapping[str, str], timeout: float, store_prefix: str | None) -> None:
    """On a machine other than the master's, put this rank's source address toward the master
    in the job's store, where the master's machine looks for a peer (once per process)."""
    if not (spans_machines(env) and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        return
    master, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    key = peer_address_key(env, store_prefix)
    if not master or not port or key in _published:
        return
    try:
        source = route_source(master, int(port))
    except (OSError, ValueError):
        return
    if is_loopback(source):
        return  # the master's own machine: it reads the key, never writes it
    _store(env, timeout).set(key, source)
    _published.add(key)


def _wait_for_peer(env: Mapping[str, str], timeout: float, store_prefix: str | None) -> str:
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise RuntimeError(
            f"MASTER_ADDR={env.get('MASTER_ADDR')} is loopback on this machine, but the job spans "
            f"{env.get('GROUP_WORLD_SIZE')} machines and there is no agent store to learn another machine's "
            f"address from; set {' and '.join(IFNAME_VARIABLES)} to the interface of the network the machines share"
        )
    store = _store(env, timeout)
    key = peer_address_key(env, store_prefix)
    try:
        store.wait([key], timedelta(seconds=timeout))
    except Exception as exc:
        raise RuntimeError(
            f"MASTER_ADDR={env.get('MASTER_ADDR')} is loopback on this machine (the master's), and no rank on "
            f"another machine published its address within {timeout} s ({exc}); set "
            f"{' and '.join(IFNAME_VARIABLES)} to the interface of the network the machines share"
        ) from exc
    return store.get(key).decode()


def configure_network(env: MutableMapping[str, str] | None = None, *,
                      timeout: float = DEFAULT_PEER_WAIT, store_prefix: str | None = None) -> NetworkChoice | None:
    """Set ``TP_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` for this process when neither is set
    and the job's peers cannot be reached through loopback; return what was chosen.

    Call it before TensorPipe or Gloo start (``init_rpc``, ``init_process_group``):
    :func:`~rpc_backend.init_from_env` and :func:`~rpc_backend.init_role_process_group` do.
    See the module docstring for the rules; on the master's own machine of a job across
    machines it waits up to ``timeout`` seconds for a rank on another machine to publish its
    address. Logs one INFO line on ``rpc_backend.network`` naming the interface and address.
    ``store_prefix`` puts the published address under one attempt's keys
    (:func:`peer_address_key`); ``init_from_env`` passes its world's.

    Example (every rank, under torchrun, before ``rpc.init_rpc``)::

        choice = configure_network()
        # on a second machine: NetworkChoice(interface='eth0', address='10.0.0.2', reason=...)
    """
    global _reported_partial
    env = os.environ if env is None else env
    _publish_own_address(env, timeout, store_prefix)
    explicit = explicit_variables(env)
    if explicit and len(explicit) < len(IFNAME_VARIABLES) and not _reported_partial:
        _reported_partial = True
        unset = [name for name in IFNAME_VARIABLES if name not in explicit]
        _log.warning(
            "rpc_backend: %s set and %s not: leaving both as they are, so %s falls back on this machine's "
            "hostname; set both to the same interface", ", ".join(f"{k}={v}" for k, v in explicit.items()),
            ", ".join(unset), " and ".join(unset),
        )
    try:
        choice = choose_network(env, peer_address=lambda: _wait_for_peer(env, timeout, store_prefix))
    except OSError as exc:  # MASTER_ADDR does not resolve, or no route: torch's own start says so
        _log.debug("rpc_backend: no interface chosen: %s", exc)
        return None
    except InterfaceNotFound as exc:  # e.g. a secondary IPv4 address: as before, and say so
        _log.warning("rpc_backend: leaving TensorPipe and Gloo to this machine's hostname: %s", exc)
        return None
    if choice is None:
        return None
    for name in IFNAME_VARIABLES:
        env[name] = choice.interface
    _log.info(
        "rpc_backend: %s (address %s: %s); set them yourself to choose another interface",
        " ".join(f"{name}={choice.interface}" for name in IFNAME_VARIABLES), choice.address, choice.reason,
    )
    return choice
