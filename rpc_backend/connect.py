"""Joining a torchrun job's world: within a bound, naming what failed, and afresh on each restart.

**The bound.** :func:`join_world` (what :func:`~rpc_backend.init_from_env` runs) either returns
with this rank in the RPC world or raises :class:`ConnectError` within ``connect_timeout``
seconds (argument, else ``RPC_BACKEND_CONNECT_TIMEOUT``, else 300 s; see
:func:`~rpc_backend.options.connect_timeout`), counted from the call. The bound covers every
wait of the join: the other ranks' arrival, the master's machine waiting for a rank of another
machine to publish its address (rpc_backend/network.py), and ``rpc.init_rpc`` itself, whose
Gloo group and TensorPipe connections would otherwise wait on an unreachable or dead peer for
as long as torch's own timeouts allow (the Gloo group inside ``init_rpc`` has one of 24 days).
``init_rpc`` runs in a helper thread so that the bound holds even where torch blocks in C++;
past the bound this rank cannot join any world, so the error is meant to end the process (an
uncaught exception: torchrun then sees the rank fail). The error names this rank's machine,
interface and address, the address every peer advertised (or that it never arrived), torch's
own error when there is one, and what to set: the interface variables, a firewall's ports, or
the bound. :func:`join_role_group` (``init_role_process_group``) does the same for a role's
process group, within that group's own ``timeout``. Right after ``init_rpc`` the ranks compare
their builds of the packages whose names travel over RPC (:func:`check_world_builds`,
rpc_backend/builds.py): ranks of different builds all fail with
:class:`~rpc_backend.builds.BuildMismatch` naming both, before any call. The comparison ends
:data:`BUILDS_MARGIN_S` (at most a tenth of the bound) before the bound, and any failure of it
(another build, a rank that died or stays silent, a store gone) is a ``BuildMismatch`` with RPC
shut down on this rank, never a :class:`ConnectError`: the network worked.

**Restarts.** torchrun keeps its store across restarts (the static rendezvous keeps the first
``TCPStore``; ``c10d`` shares one bootstrap store across rounds), so keys that one attempt's
ranks wrote (TensorPipe's and Gloo's addresses) are still there when the next attempt's ranks
look for their peers, which then connect to dead addresses. torchrun's restart count does not
name the attempt either: it counts failures of the local worker group, so across machines it
differs (a machine whose workers were still healthy restarts them for the new round without
counting it). So each attempt's ranks agree on a fresh store prefix themselves
(:func:`agree_on_world`): rank 0 takes the next generation from a counter in the store and
welcomes every other rank into it by a nonce that rank made up, so that no rank can mistake a
dead attempt's generation for its own. Everything this package keeps in the job's store (RPC's
rendezvous, the network choice, the ranks' addresses, role groups) lives under that prefix.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import threading
import time
import uuid
from datetime import timedelta
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence
from urllib.parse import parse_qsl, urlparse

import torch.distributed as dist
import torch.distributed.rpc as rpc

from rpc_backend._torch_private import is_rpc_initialized
from rpc_backend.builds import BuildMismatch, check_world, world_checked
from rpc_backend.network import (
    IFNAME_VARIABLES,
    NetworkChoice,
    configure_network,
    interface_addresses,
    is_loopback,
    spans_machines,
)
from rpc_backend.options import CONNECT_TIMEOUT_VARIABLE, connect_timeout

#: A counter in the job's store: the generation of each attempt's world.
GENERATION_KEY = "rpc_backend/generation"
#: Where a rank other than 0 leaves its nonce for rank 0 (overwritten by each attempt).
HELLO_KEY = "rpc_backend/hello/{rank}"
#: Where rank 0 answers a nonce with the generation (a key no earlier attempt could have set).
WELCOME_KEY = "rpc_backend/welcome/{nonce}"
#: The prefix of one attempt's keys.
WORLD_PREFIX = "rpc_backend/world{generation}"
ARRIVED_KEY = "{prefix}/arrived/{rank}"
ENDPOINT_KEY = "{prefix}/endpoint/{rank}"
STORE_PHASE = "connecting to the job's store"
ARRIVAL_PHASE = "waiting for the other ranks of this attempt to arrive"
#: ``init_rpc``'s rendezvous under a world's prefix: ``rpcbackend://HOST:PORT?prefix=...``.
SCHEME = "rpcbackend"
#: The longest pause of rank 0 between two looks at which ranks have arrived (seconds).
ARRIVAL_POLL_S = 0.2
#: Seconds past a role group's own ``timeout`` before its join is abandoned (torch's fires first).
ROLE_GROUP_SLACK = 5.0
#: Seconds the error report may spend reading the peers' addresses from the store.
REPORT_STORE_TIMEOUT = 5.0
#: Seconds before the join's bound at which the comparison of the builds gives up (at most a
#: tenth of the bound), leaving time to shut RPC down so that its own error is the one raised.
BUILDS_MARGIN_S = 10.0
BUILDS_PHASE = "comparing the ranks' builds (rpc_backend/builds.py)"

_registered = threading.Lock()
_handler_registered = False
#: the store prefix of the world this process joined through :func:`join_world` ("" for none)
_world: list[str] = []


class ConnectError(RuntimeError):
    """This rank could not join its world (or role group) within the bound: the message names
    this rank's address and interface, the addresses its peers advertised, and the fix."""


class Endpoint(NamedTuple):
    """Where one rank listens, as it told the others (published in the job's store)."""

    rank: int
    name: str
    host: str
    interface: str
    address: str
    #: how the interface was chosen, e.g. "set in the environment" or "chosen by rpc_backend"
    how: str

    def encode(self) -> bytes:
        return json.dumps(self._asdict()).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Endpoint:
        return cls(**json.loads(raw.decode()))

    def describe(self) -> str:
        return f"rank {self.rank} ({self.name}) on {self.host} at {self.address} ({self.interface})"


def world_prefix() -> str:
    """The store prefix of the world this process joined with ``init_from_env`` ("" when none:
    ``run_local``, or a job without torchrun's agent store)."""
    return _world[-1] if _world else ""


def own_endpoint(rank: int, name: str, env: Mapping[str, str], choice: NetworkChoice | None = None,
                 table: Iterable[tuple[str, str]] | None = None) -> Endpoint:
    """Where TensorPipe will listen in this process: the interface ``TP_SOCKET_IFNAME`` names
    (its first address, IPv4 first), or without it the address of this machine's hostname (as
    TensorPipe and Gloo pick one then)."""
    host = socket.gethostname()
    table = list(interface_addresses() if table is None else table)
    named = env.get("TP_SOCKET_IFNAME")
    if named:
        held = sorted((a for n, a in table if n == named), key=lambda a: ":" in a)
        how = "chosen by rpc_backend" if choice is not None else "TP_SOCKET_IFNAME set in the environment"
        return Endpoint(rank, name, host, named, held[0] if held else "no address", how)
    try:
        address = socket.gethostbyname(host)
    except OSError:
        address = "unresolvable"
    interface = next((n for n, a in table if a == address), "no interface")
    return Endpoint(rank, name, host, interface, address,
                    "the address of the hostname: neither TP_SOCKET_IFNAME nor GLOO_SOCKET_IFNAME is set")


# -- one attempt's store prefix ------------------------------------------------------------------


class _Waiting(Exception):
    """A wait of the join ran out of time (the message says which)."""


def _remaining(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def agree_on_world(store: Any, rank: int, world_size: int, deadline: float,
                   chosen: Callable[[int], None] | None = None) -> int:
    """The generation of this attempt's world, agreed by every rank through ``store``.

    Rank 0 takes the next value of :data:`GENERATION_KEY` and answers each other rank's nonce
    (:data:`HELLO_KEY`) with it, until every rank has confirmed (:data:`ARRIVED_KEY`); a nonce
    left by a dead attempt's rank gets an answer nobody reads. Every other rank leaves a fresh
    nonce and waits for its answer, which only a live rank 0 can give. Raises ``_Waiting``
    past ``deadline`` (``time.monotonic()``) naming whom it waited for. ``chosen(generation)``
    is called on rank 0 as soon as it has taken the generation (before it waits).
    """
    if rank == 0:
        generation = int(store.add(GENERATION_KEY, 1))
        if chosen is not None:
            chosen(generation)
        prefix = WORLD_PREFIX.format(generation=generation)
        store.set(ARRIVED_KEY.format(prefix=prefix, rank=0), "1")
        pending = set(range(1, world_size))
        answered: dict[int, str] = {}
        pause = 0.01
        while pending:
            for peer in sorted(pending):
                if store.check([ARRIVED_KEY.format(prefix=prefix, rank=peer)]):
                    pending.discard(peer)
                    continue
                hello = HELLO_KEY.format(rank=peer)
                if store.check([hello]):
                    nonce = store.get(hello).decode()
                    if answered.get(peer) != nonce:
                        store.set(WELCOME_KEY.format(nonce=nonce), str(generation))
                        answered[peer] = nonce
            if not pending:
                break
            if time.monotonic() >= deadline:
                raise _Waiting(f"rank(s) {', '.join(map(str, sorted(pending)))} never arrived")
            # a short pause between looks (a timed-out store.wait would log a warning each time)
            pause = min(pause * 2, ARRIVAL_POLL_S)
            time.sleep(min(pause, _remaining(deadline)))
        return generation
    nonce = uuid.uuid4().hex
    store.set(HELLO_KEY.format(rank=rank), nonce)
    welcome = WELCOME_KEY.format(nonce=nonce)
    try:
        store.wait([welcome], timedelta(seconds=_remaining(deadline)))
    except dist.DistStoreError as exc:  # the wait's timeout; a store that is gone raises another error
        if "timeout" not in str(exc):
            raise
        raise _Waiting("rank 0 never welcomed this rank into the attempt's world (it has not reached "
                       "init_from_env, or died)") from None
    generation = int(store.get(welcome))
    store.set(ARRIVED_KEY.format(prefix=WORLD_PREFIX.format(generation=generation), rank=rank), "1")
    return generation


def _rendezvous_handler(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any):
    """``init_rpc``'s rendezvous for ``rpcbackend://HOST:PORT?prefix=P``: a client of the job's
    (torchrun agent's) store at HOST:PORT, under prefix P."""
    parsed = urlparse(url)
    query = dict(parse_qsl(parsed.query))
    if parsed.hostname is None or parsed.port is None or "prefix" not in query:
        raise ValueError(f"{SCHEME}:// rendezvous needs HOST:PORT and ?prefix=, got {url!r}")
    store = dist.TCPStore(parsed.hostname, parsed.port, is_master=False, timeout=timeout)
    yield dist.PrefixStore(query["prefix"], store), int(query["rank"]), int(query["world_size"])
    raise RuntimeError(f"the {SCHEME}:// rendezvous of rpc_backend forms a world once; start a new attempt")


def _register_handler() -> None:
    global _handler_registered
    with _registered:
        if not _handler_registered:
            dist.register_rendezvous_handler(SCHEME, _rendezvous_handler)
            _handler_registered = True


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# -- the bound -----------------------------------------------------------------------------------


class _Progress:
    """What the joining thread has got to, for the report."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.prefix = ""
        self.me: Endpoint | None = None
        self.error: BaseException | None = None
        self.done = False


def _bounded(work: Callable[[_Progress], None], deadline: float, progress: _Progress) -> None:
    """Run ``work`` in a helper thread until it returns or ``deadline`` passes (torch may block
    in C++, where no Python exception reaches it); joined in steps so that Ctrl-C still reaches
    the main thread."""

    def run() -> None:
        try:
            work(progress)
            progress.done = True
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            progress.error = exc

    thread = threading.Thread(target=run, name="rpc-backend-join", daemon=True)
    thread.start()
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(min(1.0, _remaining(deadline)))


#: A peer, as the report sees it: where it listens, or one of these.
NEVER_ARRIVED = "never arrived"
NO_ADDRESS_YET = "arrived, but published no address yet (it waits for another rank)"


def _peers(master: tuple[str, int], prefix: str, ranks: Sequence[int]) -> dict[int, Endpoint | str] | None:
    """Each rank's endpoint under ``prefix``, or :data:`NEVER_ARRIVED` / :data:`NO_ADDRESS_YET`,
    read on a connection of its own (the joining thread may hold its own in a blocking wait);
    ``{}`` without a prefix (nothing was published), ``None`` when the store does not answer."""
    if not prefix:
        return {}
    found: dict[int, Endpoint | str] = {}
    try:
        store = dist.TCPStore(master[0], master[1], is_master=False,
                              timeout=timedelta(seconds=REPORT_STORE_TIMEOUT))
        for rank in ranks:
            key = ENDPOINT_KEY.format(prefix=prefix, rank=rank)
            if store.check([key]):
                found[rank] = Endpoint.decode(store.get(key))
            elif store.check([ARRIVED_KEY.format(prefix=prefix, rank=rank)]):
                found[rank] = NO_ADDRESS_YET
            else:
                found[rank] = NEVER_ARRIVED
    except Exception:
        return None
    return found


def _own_loopback_hint(me: Endpoint | None, elsewhere: Sequence[str], shared: str) -> list[str]:
    if me is None or not is_loopback_address(me.address) or not elsewhere:
        return []
    return [f"this rank advertises {me.address} ({me.interface}, {me.how}), a loopback address that ranks on "
            f"{', '.join(elsewhere)} cannot reach: set {' and '.join(IFNAME_VARIABLES)} on {me.host} to the "
            f"interface of the network the machines share (here: {shared}), or unset both and rpc_backend picks "
            "the interface that reaches MASTER_ADDR"]


def _hints(me: Endpoint | None, peers: Mapping[int, Endpoint | str], names: Sequence[str], bound: float,
           table: Iterable[tuple[str, str]], spans: bool) -> list[str]:
    fix_variables = " and ".join(IFNAME_VARIABLES)
    shared = candidate_interfaces(table) or "none but loopback"
    others = [p for p in peers.values() if isinstance(p, Endpoint) and me is not None and p.host != me.host]
    elsewhere = sorted({p.host for p in others}) or (["other machines"] if spans else [])
    hints = _own_loopback_hint(me, elsewhere, shared)
    looped = [p for p in others if is_loopback_address(p.address)]
    if looped:
        hosts = sorted({p.host for p in looped})
        hints.append(
            f"{'; '.join(p.describe() for p in looped)} advertise{'s' if len(looped) == 1 else ''} a loopback "
            f"address, which from {me.host if me else 'here'} is this machine itself: set {fix_variables} on "
            f"{', '.join(hosts)} to the interface of the network the machines share, or unset both there"
        )
    missing = [r for r, p in sorted(peers.items()) if p == NEVER_ARRIVED]
    if missing:
        hints.append(
            f"rank(s) {', '.join(f'{r} ({names[r]})' for r in missing)} never arrived: each died or has not "
            "reached init_from_env (see the torchrun output of its machine); if ranks only start slowly, raise "
            f"the bound ({CONNECT_TIMEOUT_VARIABLE}, now {bound:g} s)"
        )
    if not hints and not peers:
        hints.append(
            f"the peers' addresses are unknown here (the job has no torchrun agent store): make sure this rank's "
            f"address is one the other machines reach (set {fix_variables} to the interface of the network the "
            f"machines share; here: {shared}), that the machines reach each other on every TCP port, and, if "
            f"ranks only start slowly, raise the bound ({CONNECT_TIMEOUT_VARIABLE}, now {bound:g} s)"
        )
    if not hints:
        hints.append(
            "every rank arrived with an address that is not loopback, so those addresses do not reach each "
            "other: TensorPipe and Gloo listen on random ports of them, so the machines must reach each other "
            f"on every TCP port, not only MASTER_PORT (open them in the firewall), or set {fix_variables} on "
            f"every machine to the interface of a network they share (here: {shared})"
        )
    return hints


def candidate_interfaces(table: Iterable[tuple[str, str]]) -> str:
    """The interfaces a job across machines could use, for a report: ``"eth0 10.42.0.1, ib0 ..."``
    (loopback and IPv6 link-local addresses left out, IPv4 first)."""
    seen: dict[str, str] = {}
    for name, address in sorted(table, key=lambda entry: ":" in entry[1]):
        try:
            parsed = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            continue
        if not (parsed.is_loopback or parsed.is_link_local) and name not in seen:
            seen[name] = address
    return ", ".join(f"{name} {address}" for name, address in seen.items())


def is_loopback_address(address: str) -> bool:
    """True for a loopback address; False for anything that is not an address at all."""
    try:
        return is_loopback(address)
    except ValueError:
        return False


def explain(*, what: str, me: Endpoint | None, rank: int, names: Sequence[str], phase: str,
            error: BaseException | None, elapsed: float, bound: float, bound_name: str,
            peers: Mapping[int, Endpoint | str] | None, store: str = "MASTER_ADDR:MASTER_PORT",
            spans: bool = False, table: Iterable[tuple[str, str]] | None = None) -> str:
    """The message of a :class:`ConnectError` (a pure function of what the join saw). ``peers``
    maps each other rank to its :class:`Endpoint` or its state (:data:`NEVER_ARRIVED`, ...), and
    is ``None`` when the job's store no longer answers; ``spans``: the job runs on several machines.

    Example::

        explain(what="the RPC world", me=me, rank=2, names=["ps0", "trainer0", "trainer1"],
                phase="starting RPC", error=None, elapsed=300.0, bound=300.0,
                bound_name="connect_timeout", peers={0: ps0, 1: NEVER_ARRIVED}, store="node0:29500")
        # "rank 2 (trainer1) on machine1 could not join the RPC world: still starting RPC after
        #  300 s (the bound: connect_timeout). This rank: ... Its peers: ... To fix: ..."
    """
    table = list(interface_addresses() if table is None else table)
    host = me.host if me is not None else socket.gethostname()
    if error is None:
        cause = f"still {phase} after {elapsed:.0f} s (the bound: {bound_name}={bound:g} s)"
    else:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        cause = f"{phase} failed after {elapsed:.0f} s with {type(error).__name__}: {first}"
    mine = (f"this rank listens on {me.address} ({me.interface}, {me.how})" if me is not None
            else "this rank had not chosen its address yet")
    if peers is None:
        listed = f"unknown (the job's store at {store} does not answer)"
        hints = [f"the job's store at {store} does not answer: torchrun's agent on the master's machine hosts "
                 "it, so that torchrun has exited (see its output for the rank that failed first), or "
                 f"{store} does not reach it from {host}"]
        hints += _own_loopback_hint(me, ["other machines"] if spans else [], candidate_interfaces(table))
    else:
        listed = "; ".join(p.describe() if isinstance(p, Endpoint) else f"rank {r} ({names[r]}): {p}"
                           for r, p in sorted(peers.items())) or "unknown"
        hints = _hints(me, peers, names, bound, table, spans)
    return (f"rank {rank} ({names[rank]}) on {host} could not join {what}: {cause}. "
            f"{mine[0].upper()}{mine[1:]}; it tried its peers at: {listed}. "
            f"To fix: {'; '.join(hints)}.")


# -- joining -------------------------------------------------------------------------------------


def join_world(name: str, rank: int, world_size: int, names: Sequence[str], master: tuple[str, int],
               options: rpc.TensorPipeRpcBackendOptions, *, agent_store: bool,
               timeout: float | None = None, env: Any = None) -> None:
    """``rpc.init_rpc`` for one rank of a torchrun job, within ``timeout`` seconds (default:
    :func:`~rpc_backend.options.connect_timeout`), in a fresh store prefix per attempt when the
    job has torchrun's agent store; raises :class:`ConnectError` naming what to fix.

    Example (what ``init_from_env`` does)::

        join_world("trainer0", 1, 3, ["ps0", "trainer0", "trainer1"], ("node0", 29500),
                   make_options(worker_names=names), agent_store=True)
    """
    env = os.environ if env is None else env
    bound = connect_timeout(timeout, env)
    if is_rpc_initialized():  # before the store: a refused join changes nothing
        raise RuntimeError(f"{name!r} (rank {rank}) is already in an RPC world: shut it down (rpc.shutdown() "
                           "or Worker.shutdown()) before joining another")
    started = time.monotonic()
    deadline = started + bound
    progress = _Progress(f"{STORE_PHASE} at {master[0]}:{master[1]}")

    def work(progress: _Progress) -> None:
        prefix = ""
        store = None
        if agent_store:
            store = dist.TCPStore(master[0], master[1], is_master=False, timeout=timedelta(seconds=bound))
            progress.phase = ARRIVAL_PHASE

            def chosen(generation: int) -> None:
                progress.prefix = WORLD_PREFIX.format(generation=generation)

            prefix = WORLD_PREFIX.format(generation=agree_on_world(store, rank, world_size, deadline, chosen))
            progress.prefix = prefix
        progress.phase = "choosing this machine's network interface"
        choice = configure_network(env, timeout=_remaining(deadline), store_prefix=prefix or None)
        progress.me = own_endpoint(rank, name, env, choice)
        if store is not None:
            store.set(ENDPOINT_KEY.format(prefix=prefix, rank=rank), progress.me.encode())
            _register_handler()
            options.init_method = f"{SCHEME}://{_url_host(master[0])}:{master[1]}?prefix={prefix}/rpc"
        progress.phase = "connecting to the other ranks (rpc.init_rpc: TensorPipe and Gloo)"
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
        progress.phase = BUILDS_PHASE
        check_world_builds(store, prefix, master, rank, world_size, names,
                           max(0.001, _remaining(deadline) - min(BUILDS_MARGIN_S, bound / 10)))

    _bounded(work, deadline, progress)
    if progress.done:
        _world[:] = [progress.prefix]
        return
    if progress.phase == BUILDS_PHASE:  # RPC formed: not a network failure, its own report
        if progress.error is not None:
            raise progress.error
        raise BuildMismatch(f"rank {rank} ({name}) cannot join: the comparison of the ranks' builds did not end "
                            f"within the bound (connect_timeout={bound:g} s), nor did RPC's shutdown after it")
    raise _report("the RPC world", progress, rank, names, list(range(world_size)), master, started, bound,
                  f"connect_timeout or {CONNECT_TIMEOUT_VARIABLE}", env)


def _report(what: str, progress: _Progress, rank: int, names: Sequence[str], ranks: Sequence[int],
            master: tuple[str, int], started: float, bound: float, bound_name: str,
            env: Mapping[str, str]) -> ConnectError:
    error, phase = progress.error, progress.phase
    if isinstance(error, _Waiting):
        phase, error = f"{phase} ({error})", None
    peers: dict[int, Endpoint | str] | None
    if not progress.prefix and rank != 0 and progress.phase.startswith(ARRIVAL_PHASE):
        peers = {0: NEVER_ARRIVED}  # rank 0 never welcomed this rank
    elif progress.phase.startswith(STORE_PHASE):
        peers = None  # the job's store never answered
    else:
        peers = _peers(master, progress.prefix, [r for r in ranks if r != rank])
    message = explain(what=what, me=progress.me, rank=rank, names=names, phase=phase, error=error,
                      elapsed=time.monotonic() - started, bound=bound, bound_name=bound_name, peers=peers,
                      store=f"{master[0]}:{master[1]}", spans=spans_machines(env))
    failure = ConnectError(message)
    failure.__cause__ = error
    return failure


def check_world_builds(store: Any, prefix: str, master: tuple[str, int], rank: int, world_size: int,
                       names: Sequence[str], timeout: float) -> None:
    """Right after ``init_rpc``: every rank runs one build (:func:`rpc_backend.builds.check_world`,
    on the job's store under this attempt's prefix, else on the store ``init_rpc`` started at
    the master) within ``timeout`` seconds. On a mismatch, a rank that never says or is gone,
    or a store that no longer answers, this rank leaves RPC at once (``rpc.shutdown(graceful=
    False)``) and raises :class:`~rpc_backend.builds.BuildMismatch`."""
    try:
        if store is None:
            store = dist.TCPStore(master[0], master[1], is_master=False, timeout=timedelta(seconds=timeout))
        compared = check_world(dist.PrefixStore(prefix or "rpc_backend", store), rank, world_size, names, timeout)
    except BaseException as exc:
        if is_rpc_initialized():
            rpc.shutdown(graceful=False)
        if isinstance(exc, Exception) and not isinstance(exc, BuildMismatch):
            raise BuildMismatch(
                f"rank {rank} ({names[rank]}) cannot join: the ranks' builds could not be compared "
                f"({type(exc).__name__}: {str(exc).strip()[:300]}): the job's store or another rank is gone "
                "(see the other ranks' output)") from exc
        raise
    world_checked(compared)


def join_role_group(role: str, role_rank: int, role_size: int, role_ranks: Sequence[int], names: Sequence[str],
                    master: tuple[str, int], backend: str, timeout: float, env: Any = None) -> None:
    """``init_process_group`` among one role's ranks on the job's store (under this attempt's
    prefix when the world was joined with :func:`join_world`), failing with
    :class:`ConnectError` past ``timeout`` (torch's own timeout for the group, plus
    :data:`ROLE_GROUP_SLACK`). ``role_ranks`` are the role's global ranks, in role-rank order.
    """
    env = os.environ if env is None else env
    prefix = world_prefix()
    started = time.monotonic()
    progress = _Progress("choosing this machine's network interface")
    progress.prefix = prefix
    rank = role_ranks[role_rank]

    def work(progress: _Progress) -> None:
        progress.phase = "choosing this machine's network interface"
        choice = configure_network(env, timeout=timeout, store_prefix=prefix or None)
        progress.me = own_endpoint(rank, names[rank], env, choice)
        progress.phase = f"connecting to the other {role} ranks (init_process_group, {backend})"
        store = dist.TCPStore(master[0], master[1], is_master=False, timeout=timedelta(seconds=timeout))
        group_prefix = f"{prefix}/role_group/{role}" if prefix else f"rpc_backend/role_group/{role}"
        dist.init_process_group(backend, store=dist.PrefixStore(group_prefix, store), rank=role_rank,
                                world_size=role_size, timeout=timedelta(seconds=timeout))

    _bounded(work, started + timeout + ROLE_GROUP_SLACK, progress)
    if progress.done:
        return
    raise _report(f"the process group of role {role!r}", progress, rank, names, role_ranks, master, started,
                  timeout, "init_role_process_group's timeout", env)
