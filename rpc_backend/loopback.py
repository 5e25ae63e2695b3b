"""Keeping a local RPC world on the loopback interface.

TensorPipe and Gloo pick the interface to listen on from ``TP_SOCKET_IFNAME`` and
``GLOO_SOCKET_IFNAME``; with both set to the loopback interface, and a rendezvous that is
either a ``file://`` path or a TCP store listening on 127.0.0.1 only
(:func:`loopback_store`), nothing a local world opens is reachable from another host.
"""

from __future__ import annotations

import os
import socket
import tempfile
from datetime import timedelta

import torch.distributed as dist


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
        options = make_options(init_method=init_method)   # rpc_backend.make_options
    """
    fd, path = tempfile.mkstemp(prefix="rpc_rendezvous_")
    os.close(fd)
    os.unlink(path)  # the store creates it; a stale file from another world would confuse it
    return f"file://{path}", path


def loopback_store(timeout: float = 300.0) -> dist.TCPStore:
    """A TCP store server that listens on ``127.0.0.1`` only, on a port the OS picks.

    ``TCPStore(is_master=True)`` on its own listens on every interface; this one is handed a
    socket already bound to loopback, so no other host can reach it, and the port cannot be
    taken by someone else between choosing and binding it. Its port is ``store.port``;
    processes on this machine join as clients (``is_master=False``). Keep the object alive as
    long as the world needs it.

    Example (the launcher hosts it, as torchrun's agent does; each rank connects)::

        store = loopback_store()
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
               "TORCHELASTIC_USE_AGENT_STORE": "True"}
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the listening socket from here on
    try:
        return dist.TCPStore(
            "127.0.0.1", port, is_master=True, master_listen_fd=fd, wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
        )
    except Exception:
        try:
            os.close(fd)
        except OSError:
            pass
        raise
