"""Joining and leaving an RPC world: ``init_from_env`` (torchrun), ``Worker`` (owns shutdown)
and ``init_role_process_group`` (a process group among the ranks of one role, e.g. DDP among
trainers, on the job's own store: no second port)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch.distributed.rpc as rpc

from rpc_backend._quiet import hide_functional_optimizer_deprecation, no_backend_as_process_group_warning
from rpc_backend._torch_private import UNBOUNDED_SHUTDOWN_TIMEOUT, is_rpc_initialized
from rpc_backend.connect import join_role_group, join_world
from rpc_backend.options import (
    DEFAULT_RPC_TIMEOUT,
    DEFAULT_TRANSPORT,
    DEFAULT_WORKER_THREADS,
    make_options,
    positive_seconds,
)
from rpc_backend.roles import RankPlacement, placements
from rpc_backend.watch import (
    WorkerLost,
    current_watcher,
    shutdown_with_survivors,
    start_watching,
    stop_watching,
    watch_settings,
)

TORCHRUN_HINT = "torchrun --standalone --nproc-per-node=3 your_script.py"
_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Worker:
    """This process's place in an initialized RPC world; a context manager that shuts it down.

    On a clean exit from the ``with`` block the shutdown is graceful: this worker keeps serving
    until every other worker has finished and called shutdown too, however long that takes
    (``shutdown_timeout=None``, the default; a number of seconds bounds the wait, after which
    it shuts down immediately and raises). When the block raised, the shutdown is immediate,
    so a failing worker never waits on the others. A worker that dies, or goes silent (its
    machine or link down), is noticed by every other through heartbeats: each ends with
    :class:`~rpc_backend.watch.WorkerLost` naming it (a graceful shutdown never waits for a lost
    peer), unless its role is expendable (see ``rpc_backend/watch.py``); ``run_local`` and
    torchrun's agent then stop the rest of the world as for any failing rank.

    Example::

        with rpc_backend.init_from_env(roles={"ps": 1, "trainer": 2}) as me:
            if me.role == "trainer":
                train(me.role_rank)
    """

    name: str
    rank: int
    world_size: int
    local_rank: int
    role: str
    role_rank: int
    role_size: int
    names: list[str] = field(default_factory=list)
    shutdown_timeout: float | None = None
    #: one :class:`RankPlacement` per rank, in rank order: the roles :meth:`workers` looks up
    layout: list[RankPlacement] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.shutdown_timeout is not None:
            self.shutdown_timeout = positive_seconds(self.shutdown_timeout, "shutdown_timeout")
        if self.layout and not self.names:
            self.names = [p.name for p in self.layout]
        if self.layout and [p.name for p in self.layout] != list(self.names):
            raise ValueError(
                f"Worker names {self.names!r} do not match its layout {[p.name for p in self.layout]!r}; "
                "pass the layout only (names are taken from it)"
            )

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.shutdown(graceful=exc_type is None)

    def workers(self, role: str) -> list[str]:
        """The worker names of ``role`` exactly, in rank order; ``[]`` for a role not in the world.

        Roles are looked up in the layout, not guessed from names: with roles
        ``{"ps": 1, "ps1": 1}`` (workers ps0 and ps10), ``workers("ps") == ["ps0"]``.

        Example::

            me = current_worker()                 # roles={"ps": 2, "trainer": 2}
            me.workers("ps")                      # ["ps0", "ps1"]
        """
        if not self.layout:
            raise RuntimeError(
                f"Worker {self.name!r} was built without its layout, so its peers' roles are unknown; "
                "build it with layout=placements(world_size, roles) (init_from_env and run_local do)"
            )
        return [p.name for p in self.layout if p.role == role]

    def shutdown(self, graceful: bool = True) -> None:
        """Leave the world: graceful (serve until every worker is done, within
        ``shutdown_timeout`` when one is set), else immediate.

        Example::

            me = init_from_env(roles={"ps": 1, "trainer": 2})
            try:
                work(me)
            finally:
                me.shutdown()        # the ps keeps serving until both trainers are done
        """
        shutdown_rpc(graceful=graceful, timeout=self.shutdown_timeout)


_current: list[Worker] = []


def current_worker() -> Worker:
    """The :class:`Worker` of this process (set by :func:`init_from_env` and ``run_local``).

    Example (inside a function run by ``run_local(fn, 3, roles={"ps": 1, "trainer": 2})``)::

        me = current_worker()
        if me.role == "trainer":
            peers = me.workers("trainer")     # ["trainer0", "trainer1"]
    """
    if not _current or not is_rpc_initialized():
        raise RuntimeError(
            "this process has not joined an RPC world through rpc_backend: call "
            "rpc_backend.init_from_env() (torchrun) or run it under rpc_backend.run_local()"
        )
    return _current[-1]


def _set_current(worker: Worker) -> Worker:
    _current[:] = [worker]
    return worker


#: Seconds a bounded graceful shutdown may overrun its ``timeout`` before it is abandoned
#: (torch's own deadline should fire first; this only catches a shutdown stuck past it).
SHUTDOWN_SLACK = 2.0


def shutdown_rpc(graceful: bool = True, timeout: float | None = None) -> None:
    """``rpc.shutdown``: graceful waits for every worker; ``timeout`` seconds bound the wait.

    With ``timeout=None`` (the default) a graceful shutdown serves other workers' calls until
    every worker has called shutdown, however long that takes. With a number, a graceful
    shutdown that has not finished ``timeout`` seconds (plus :data:`SHUTDOWN_SLACK`) later is
    abandoned for an immediate one, and a ``RuntimeError`` says so. ``graceful=False`` leaves
    at once. Does nothing when RPC is not initialized. In a world whose ranks watch each other
    (``init_from_env``, ``run_local``), a peer lost while this rank waits ends the wait with
    :class:`~rpc_backend.watch.WorkerLost`, and once a peer of an expendable role is lost the
    wait is for the surviving workers only (``rpc_backend/watch.py``).

    Example (on every worker)::

        try:
            train()
        finally:
            shutdown_rpc(graceful=True)              # or timeout=30 to bound the wait
    """
    if timeout is not None:
        timeout = positive_seconds(timeout, "timeout")
    watcher = current_watcher()
    if not is_rpc_initialized():
        stop_watching()
        return
    if not graceful or watcher is None:
        stop_watching()
        _torch_shutdown(graceful, timeout)
        return
    # the heartbeats go on while this rank waits for the others: a peer lost meanwhile ends it
    # (rpc_backend/watch.py), and once an expendable one is lost torch's barrier cannot complete
    watcher.leave()
    immediate = lambda: rpc.shutdown(graceful=False)  # noqa: E731
    try:
        if watcher.spared():
            shutdown_with_survivors(watcher, timeout, immediate)
        else:
            _torch_shutdown(True, timeout, switch=lambda: bool(watcher.spared()))
            if watcher.spared() and is_rpc_initialized():
                shutdown_with_survivors(watcher, timeout, immediate)
    except WorkerLost:
        stop_watching()
        if is_rpc_initialized():
            try:
                rpc.shutdown(graceful=False)
            except Exception:
                pass
        raise
    finally:
        stop_watching()


def _torch_shutdown(graceful: bool, timeout: float | None, switch: Callable[[], bool] = lambda: False) -> None:
    """``rpc.shutdown``, with ``timeout`` as :func:`shutdown_rpc` takes it; a graceful one
    returns early, leaving torch's wait behind, once ``switch()`` is true."""
    if not graceful:
        rpc.shutdown(graceful=False)
        return
    errors: list[BaseException] = []

    def run() -> None:
        try:
            # torch applies a number to each step of its shutdown gather (a missed step is
            # skipped, not reported, and the agent's join then waits forever), so only its
            # "no timeout" value really waits: UNBOUNDED_SHUTDOWN_TIMEOUT.
            rpc.shutdown(graceful=True, timeout=UNBOUNDED_SHUTDOWN_TIMEOUT if timeout is None else timeout)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name="rpc-graceful-shutdown", daemon=True)
    thread.start()
    deadline = None if timeout is None else time.monotonic() + timeout + SHUTDOWN_SLACK
    while thread.is_alive() and (deadline is None or time.monotonic() < deadline):
        if switch():
            return
        # in steps, so Ctrl-C still reaches this thread and switch() is looked at
        thread.join(1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic())))
    if timeout is None:
        if errors:
            raise RuntimeError(f"graceful RPC shutdown failed: {errors[0]}") from errors[0]
        return
    if thread.is_alive() or errors:
        if is_rpc_initialized():
            try:
                rpc.shutdown(graceful=False)
            except Exception:
                pass
        raise RuntimeError(
            f"graceful RPC shutdown did not complete within {timeout} s "
            f"({errors[0] if errors else 'still waiting for other workers'}); shut down immediately instead. "
            "Pass timeout=None to wait for every worker however long it takes"
        )


def _env_int(name: str, env: Mapping[str, str]) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"{name}={value!r} is not an integer; start the job with torchrun, e.g. {TORCHRUN_HINT}"
        ) from None


def read_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The torchrun variables this process needs, checked: names what is missing or wrong.

    Example::

        info = read_env()          # under torchrun
        info["rank"], info["world_size"], info["master_addr"]
    """
    env = os.environ if env is None else env
    missing = [name for name in _REQUIRED if not env.get(name)]
    if missing:
        raise RuntimeError(
            f"init_from_env needs the variables torchrun sets; missing: {', '.join(missing)}. "
            f"Start the job with torchrun, e.g.: {TORCHRUN_HINT}"
        )
    rank, world_size, local_rank, port = (_env_int(n, env) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))
    problems = []
    if world_size < 1:
        problems.append(f"WORLD_SIZE={world_size} must be at least 1")
    if not 0 <= rank < max(world_size, 1):
        problems.append(f"RANK={rank} must be in [0, WORLD_SIZE={world_size})")
    if not 0 <= local_rank <= rank:
        problems.append(f"LOCAL_RANK={local_rank} must be in [0, RANK={rank}]")
    if not 0 < port < 65536:
        problems.append(f"MASTER_PORT={port} is not a TCP port")
    if problems:
        raise ValueError(
            "inconsistent torchrun variables: " + "; ".join(problems) + f". Expected a launch like: {TORCHRUN_HINT}"
        )
    return {
        "rank": rank,
        "world_size": world_size,
        "local_rank": local_rank,
        "master_addr": env["MASTER_ADDR"],
        "master_port": port,
        "agent_store": env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    }


def init_from_env(
    roles: Mapping[str, int] | None = None,
    *,
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
    num_worker_threads: int = DEFAULT_WORKER_THREADS,
    device_maps: Mapping[str, Mapping[Any, Any]] | None = None,
    devices: Iterable[Any] | None = None,
    shutdown_timeout: float | None = None,
    transport: str = DEFAULT_TRANSPORT,
    connect_timeout: float | None = None,
    heartbeat: float | None = None,
    lost_after: float | None = None,
    expendable: Iterable[str] = (),
) -> Worker:
    """Initialize RPC inside a torchrun job; return this process's :class:`Worker`.

    Worker names come from ``roles`` (``{"ps": 2, "trainer": 2}`` -> ps0, ps1, trainer0,
    trainer1 by rank), default ``worker<rank>``. The worker's graceful shutdown waits for
    every other worker however long it takes; ``shutdown_timeout`` seconds bound it. The
    rendezvous is torchrun's own store (MASTER_ADDR:MASTER_PORT; the agent's store when torchrun
    provides one), so a process group for DDP among some ranks (:func:`init_role_process_group`)
    needs no second port. ``transport`` is ``"uv"`` (default; idle ranks use no CPU) or
    ``"shm"`` (torch's defaults, which busy-poll), as in :func:`make_options`.
    Across machines, with neither ``TP_SOCKET_IFNAME`` nor ``GLOO_SOCKET_IFNAME`` set, it
    sets both to the interface that reaches the master (:func:`~rpc_backend.configure_network`),
    so that no rank advertises a hostname that resolves to loopback; set them to choose.
    Joining is bounded: within ``connect_timeout`` seconds (default ``RPC_BACKEND_CONNECT_TIMEOUT``,
    else 300 s) this rank is in the world or raises :class:`~rpc_backend.connect.ConnectError`
    naming its address, its peers' and what to set; each torchrun restart joins a fresh world
    (see rpc_backend/connect.py).
    Two torch warnings nobody can act on stay off the console: gloo's "Backend ... as a
    ProcessGroup" during ``init_rpc``, and TorchScript's functional optimizer deprecation that
    torch's ``DistributedOptimizer`` emits on the workers (see ``rpc_backend/_quiet.py``).
    Every rank sends every other a heartbeat each ``heartbeat`` seconds (default 1,
    ``RPC_BACKEND_HEARTBEAT_S``); a peer not heard from for ``lost_after`` seconds (default 10,
    ``RPC_BACKEND_LOST_AFTER_S``; ``math.inf`` or ``off``: never) is lost, and every rank that
    notices it logs the lost workers with their machine and raises
    :class:`~rpc_backend.watch.WorkerLost` in its main thread (exiting anyway 5 s later), so the
    job ends, unless the peer's role is in ``expendable``: then it is reported and the job goes
    on (see ``rpc_backend/watch.py``).

    Example (every rank runs the same script)::

        # torchrun --standalone --nproc-per-node=3 job.py
        me = rpc_backend.init_from_env(roles={"ps": 1, "trainer": 2})
        with me:
            if me.role == "trainer":
                emb = RemoteModule("ps0/cpu", torch.nn.EmbeddingBag, (1000, 16))
                ...
    """
    info = read_env()
    layout = placements(info["world_size"], roles)
    names = [p.name for p in layout]
    watching = watch_settings(heartbeat, lost_after, expendable, roles=[p.role for p in layout])
    options = make_options(
        init_method=f"tcp://{info['master_addr']}:{info['master_port']}",
        rpc_timeout=rpc_timeout,
        num_worker_threads=num_worker_threads,
        device_maps=device_maps,
        devices=devices,
        worker_names=names,
        transport=transport,
    )
    me: RankPlacement = layout[info["rank"]]
    hide_functional_optimizer_deprecation()
    with no_backend_as_process_group_warning():  # sets the interface variables too (configure_network)
        join_world(me.name, info["rank"], info["world_size"], names, (info["master_addr"], info["master_port"]),
                   options, agent_store=info["agent_store"], timeout=connect_timeout)
    start_watching(me.name, layout, watching)
    return _set_current(Worker(
        name=me.name,
        rank=info["rank"],
        world_size=info["world_size"],
        local_rank=info["local_rank"],
        role=me.role,
        role_rank=me.role_rank,
        role_size=me.role_size,
        names=names,
        shutdown_timeout=shutdown_timeout,
        layout=layout,
    ))


def init_role_process_group(worker: Worker, backend: str = "gloo", timeout: float = 60.0) -> None:
    """``init_process_group`` among the ranks of ``worker.role`` only (rank = role rank).

    Uses the job's existing store (torchrun's agent store, the one the RPC rendezvous started
    on rank 0, or the one ``run_local``'s launcher hosts on 127.0.0.1) under a role-specific
    prefix: no new port, no clash with other roles' groups. The same code therefore runs
    under torchrun and under :func:`~rpc_backend.run_local`.

    Example (torchrun, or ``run_local(main, 3, roles={"ps": 1, "trainer": 2})``)::

        from torch.nn.parallel import DistributedDataParallel

        def main():
            me = current_worker()                     # or init_from_env(roles=...) under torchrun
            if me.role == "trainer":
                init_role_process_group(me)          # DDP among trainer0 and trainer1
                model = DistributedDataParallel(local_part)
    """
    timeout = positive_seconds(timeout, "timeout")
    info = read_env()
    names = worker.names or [f"worker{r}" for r in range(worker.world_size)]
    role_ranks = ([r for r, p in enumerate(worker.layout) if p.role == worker.role] if worker.layout
                  else [worker.rank - worker.role_rank + i for i in range(worker.role_size)])
    # on the job's store, under this attempt's prefix; fails with ConnectError past timeout
    join_role_group(worker.role, worker.role_rank, worker.role_size, role_ranks, names,
                    (info["master_addr"], info["master_port"]), backend, timeout)
