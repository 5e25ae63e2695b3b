"""rpc_backend: start, configure and stop ``torch.distributed.rpc`` worlds.

* :func:`init_from_env` joins a torchrun job (names from a role spec) and returns a
  :class:`Worker`, a context manager that owns shutdown; it joins within a bound
  (``RPC_BACKEND_CONNECT_TIMEOUT``, 300 s) or raises :class:`ConnectError` naming what to set,
  and joins a fresh world on each torchrun restart (rpc_backend/connect.py);
* :func:`init_role_process_group` makes a process group among one role's ranks (DDP among
  trainers) on the job's own store;
* :func:`run_local` runs a function on N local processes on loopback (the embedded default),
  with a torchrun-like store, so role process groups work there too;
* :func:`configure_network` picks the network interface of a job across machines (the one
  that reaches the master) when ``TP_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` are unset;
  :func:`init_from_env` and :func:`init_role_process_group` call it;
* every rank of a world started by :func:`init_from_env` or :func:`run_local` hears from every
  other (``rpc_backend/watch.py``): a peer silent for ``lost_after`` seconds is lost, named with
  its machine, and ends the job (:class:`WorkerLost`) unless its role is ``expendable``;
  :func:`add_status` lets a layer above put its step in what a lost peer is named with;
* :class:`Traffic` counts the bytes this process's calls carry to each peer and back (their
  payload, measured on what is sent and answered; off until used);
* every rank of a world that :func:`init_from_env` forms runs one build of the packages whose
  functions travel by name (``rpc_backend/builds.py``): a rank of another build fails the world
  with :class:`BuildMismatch` naming both; a package of one's own joins with :func:`declare_build`;
* :func:`make_options` validates RPC options (timeout, threads, device maps, devices) and picks
  the transport (:data:`TRANSPORTS`; ``"uv"`` by default, which does not spin when idle).

Knows nothing of ``remote_module``; everything above builds on it.
"""

from rpc_backend.builds import BuildMismatch, declare_build
from rpc_backend.connect import ConnectError
from rpc_backend.local import LocalWorldError, run_local
from rpc_backend.loopback import fresh_file_rendezvous, loopback_env, loopback_interface, loopback_store
from rpc_backend.network import NetworkChoice, configure_network
from rpc_backend.options import DEFAULT_TRANSPORT, TRANSPORTS, make_options
from rpc_backend.roles import Placement, RankPlacement, placements
from rpc_backend.traffic import Traffic
from rpc_backend.watch import LostWorker, WorkerLost, add_status, lost_workers, on_lost
from rpc_backend.world import Worker, current_worker, init_from_env, init_role_process_group, read_env, shutdown_rpc

__all__ = [
    "init_from_env",
    "init_role_process_group",
    "read_env",
    "Worker",
    "current_worker",
    "shutdown_rpc",
    "ConnectError",
    "BuildMismatch",
    "declare_build",
    "run_local",
    "LocalWorldError",
    "configure_network",
    "NetworkChoice",
    "make_options",
    "TRANSPORTS",
    "DEFAULT_TRANSPORT",
    "placements",
    "RankPlacement",
    "Placement",  # the old name of RankPlacement
    "loopback_env",
    "loopback_interface",
    "fresh_file_rendezvous",
    "loopback_store",
    "WorkerLost",
    "LostWorker",
    "add_status",
    "on_lost",
    "lost_workers",
    "Traffic",
]
