"""Run by tests/core/test_fanout_worlds.py in a process of its own (it starts and ends its own
RPC worlds): calls by worker name across worlds, the case its argument names. Prints one JSON
line: each call's outcome, ``[error type, message]`` or ``["ok", results]``.

- ``reinit``: a call before ``init_rpc`` (with a timeout, and with the agent's default); a
  world of one, ``a``; shut down; a call; a world of one, ``b``: a call to ``a``, then to ``b``;
- ``leave``: a dynamic world (``init_rpc`` without ``world_size``): ``w`` joins, is called, and
  leaves; a call to ``w`` then."""

from __future__ import annotations

import json
import operator
import socket
import sys
import time

import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

from rpc_backend import make_options
from tests._deadlines import HANG_S


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _options(port: int) -> rpc.TensorPipeRpcBackendOptions:
    return make_options(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=HANG_S)


def _outcome(calls: list, timeout: float | None = HANG_S) -> list:
    from remote_module._core.fanout import call_all

    try:
        return ["ok", call_all(calls, timeout=timeout)]
    except Exception as exc:
        return [type(exc).__name__, str(exc)]


def _join_and_leave(port: int, left) -> None:
    rpc.init_rpc("w", rank=1, rpc_backend_options=_options(port))
    left.wait(HANG_S)
    rpc.shutdown()


def reinit() -> dict:
    got = {"before_init": _outcome([("a", operator.add, (1, 2))]),
           "before_init_default_timeout": _outcome([("a", operator.add, (1, 2))], None)}
    port = _port()
    rpc.init_rpc("a", rank=0, world_size=1, rpc_backend_options=_options(port))
    got["first_world"] = _outcome([("a", operator.add, (1, 2))])
    rpc.shutdown()
    got["after_shutdown"] = _outcome([("a", operator.add, (1, 2))])
    rpc.init_rpc("b", rank=0, world_size=1, rpc_backend_options=_options(_port()))
    got["after_reinit"] = [_outcome([("a", operator.add, (1, 2))]), _outcome([("b", operator.add, (1, 2))])]
    rpc.shutdown()
    return got


def leave() -> dict:
    got = {}
    port = _port()
    rpc.init_rpc("srv", rank=0, rpc_backend_options=_options(port))
    ctx = mp.get_context("spawn")
    left = ctx.Event()
    proc = ctx.Process(target=_join_and_leave, args=(port, left))
    proc.start()
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        try:
            rpc.get_worker_info("w")
            break
        except RuntimeError:
            time.sleep(0.1)
    got["before_leave"] = _outcome([("w", operator.add, (1, 2))])
    left.set()
    proc.join(HANG_S)
    got["after_leave"] = _outcome([("w", operator.add, (1, 2))])
    rpc.shutdown()
    return got


if __name__ == "__main__":
    print(json.dumps({"reinit": reinit, "leave": leave}[sys.argv[1]]()))
