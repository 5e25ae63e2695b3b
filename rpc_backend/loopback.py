"""Keeping a local RPC world on the loopback interface.

TensorPipe and Gloo pick the interface to listen on from ``TP_SOCKET_IFNAME`` and
``GLOO_SOCKET_IFNAME``; with both set to the loopback interface and a ``file://``
rendezvous (no TCP store), nothing a local world opens is reachable from another host.
"""

from __future__ import annotations

import os
import socket
import tempfile


def loopback_interface() -> str:
    """The name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    raise RuntimeError(f"no loopback interface among {names}; set TP_SOCKET_IFNAME yourself")


def loopback_env() -> dict[str, str]:
    """Environment variables that make TensorPipe and Gloo listen on loopback only.

    Example (before ``rpc.init_rpc`` in each local process)::

        os.environ.update(loopback_env())
    """
    lo = loopback_interface()
    return {"TP_SOCKET_IFNAME": lo, "GLOO_SOCKET_IFNAME": lo, "MASTER_ADDR": "127.0.0.1"}


def fresh_file_rendezvous() -> tuple[str, str]:
    """A new ``file://`` init method and the path behind it (remove it when done).

    Each world needs a file no earlier world has used.

    Example (choose once, pass to every rank)::

        init_method, path = fresh_file_rendezvous()
        options = rpc.TensorPipeRpcBackendOptions(init_method=init_method)
    """
    fd, path = tempfile.mkstemp(prefix="rpc_rendezvous_")
    os.close(fd)
    os.unlink(path)  # the store creates it; a stale file from another world would confuse it
    return f"file://{path}", path
