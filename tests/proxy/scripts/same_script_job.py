"""Same-script worlds keep the identity of __main__ classes and factories (run by
tests/proxy/test_same_script.py). Every rank runs this script; worker0 is the caller, worker1 the host:

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/proxy/scripts/same_script_job.py torchrun
    python tests/proxy/scripts/same_script_job.py spawn     # mp.spawn: host is __mp_main__
    python tests/proxy/scripts/same_script_job.py local     # rpc_backend.run_local: both __mp_main__
    python tests/proxy/scripts/same_script_job.py caller INIT_METHOD   # rank 0 only; the host runs
                                                      # tests/proxy/scripts/other_code_host.py

The caller prints one ``RESULT <json>`` line; each check records an error string instead of
raising, so one failure does not hide the others.
"""

import collections
import dataclasses
import json
import sys
import threading

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch import nn

from remote_module import RemoteModule
from rpc_backend import fresh_file_rendezvous, init_from_env, loopback_env, make_options, run_local
from tests._deadlines import HANG_S, SETUP_S
from tests.proxy._shipping_remote import Holder, host_view

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Config:
    scale: float = 1.0


class Net(nn.Module):
    """Counts its instances in class-level state; returns a __main__ namedtuple."""

    instances = 0

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        Net.instances += 1
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> Point:
        return Point(x * self.cfg.scale, Net.instances)


class Summary(nn.Module):
    """Returns a __main__ dataclass."""

    def forward(self, x: torch.Tensor) -> Config:
        return Config(float(x.sum()))


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def forward(self, k: int) -> int:
        self.n += k
        return self.n


# The parameter-server example's pattern: one module per process, created under a lock.
_LOCK = threading.Lock()
_SHARED: list = []


def shared_counter() -> Counter:
    with _LOCK:
        if not _SHARED:
            _SHARED.append(Counter())
        return _SHARED[0]


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _attempt(result: dict, key: str, fn) -> None:
    try:
        result[key] = fn()
    except Exception as exc:
        result[key] = f"ERROR {type(exc).__name__}: {str(exc)[:400]}"


def same_script_checks(host: str) -> dict:
    result: dict = {}

    def lock_factory_singleton():
        a = RemoteModule(f"{host}/cpu", shared_counter)
        b = RemoteModule(f"{host}/cpu", shared_counter)
        a(1)
        return b(1)  # 2 when both proxies hold the host's one Counter

    def own_class():
        net = RemoteModule(f"{host}/cpu", Net, (Config(3.0),))
        view = rpc.rpc_sync(host, host_view, (net.module_rref,))
        out = net(torch.ones(2))
        view["out_is_callers_point"] = type(out) is Point
        view["out"] = [out.x.tolist(), out.y]
        return view

    def nested():
        h = RemoteModule(f"{host}/cpu", Holder, ([Config(2.0)],), {"extra": {"cfg": Config(5.0)}})
        return rpc.rpc_sync(host, host_view, (h.module_rref,))

    _attempt(result, "singleton", lock_factory_singleton)
    _attempt(result, "net", own_class)
    _attempt(result, "nested", nested)
    return result


def different_code_checks(host: str) -> dict:
    """The host's __main__ is tests/proxy/scripts/other_code_host.py: same names, other code."""
    result: dict = {}

    def copied_class():
        net = RemoteModule(f"{host}/cpu", Net, (Config(3.0),))
        return rpc.rpc_sync(host, host_view, (net.module_rref,))

    def output():
        net = RemoteModule(f"{host}/cpu", Net, (Config(3.0),))
        out = net(torch.ones(2))
        return {"callers_point": type(out) is Point, "out": [out.x.tolist(), out.y]}

    def dataclass_output():
        summary = RemoteModule(f"{host}/cpu", Summary)
        sync, later = summary(torch.ones(3)), summary.forward_async(torch.ones(2)).wait()
        return {"callers_config": [type(sync) is Config, type(later) is Config], "scales": [sync.scale, later.scale]}

    def nested():
        h = RemoteModule(f"{host}/cpu", Holder, ([Config(2.0)],), {"extra": {"cfg": Config(5.0)}})
        view = rpc.rpc_sync(host, host_view, (h.module_rref,))
        view["forward"] = h(torch.ones(1)).tolist()
        return view

    def lock_factory():
        RemoteModule(f"{host}/cpu", shared_counter)
        return "constructed"

    _attempt(result, "net", copied_class)
    _attempt(result, "output", output)
    _attempt(result, "dataclass_output", dataclass_output)
    _attempt(result, "nested", nested)
    _attempt(result, "lock_factory", lock_factory)
    return result


def _init(rank: int, init_method: str) -> None:
    names = ["worker0", "worker1"]
    options = make_options(init_method=init_method, worker_names=names, rpc_timeout=SETUP_S)
    rpc.init_rpc(names[rank], rank=rank, world_size=2, rpc_backend_options=options)


def _spawned_host(_index: int, init_method: str) -> None:
    _init(1, init_method)
    rpc.shutdown()


def _local_main() -> dict | None:
    return same_script_checks("worker1") if rpc.get_worker_info().id == 0 else None


def main(mode: str) -> None:
    import os

    os.environ.update(loopback_env())
    if mode == "torchrun":
        with init_from_env(rpc_timeout=SETUP_S) as me:
            if me.rank == 0:
                say("RESULT " + json.dumps(same_script_checks("worker1")))
    elif mode == "spawn":
        init_method, _ = fresh_file_rendezvous()
        ctx = mp.spawn(_spawned_host, args=(init_method,), nprocs=1, join=False)
        _init(0, init_method)
        say("RESULT " + json.dumps(same_script_checks("worker1")))
        rpc.shutdown()
        ctx.join(HANG_S)
    elif mode == "local":
        say("RESULT " + json.dumps(run_local(_local_main, 2, rpc_timeout=SETUP_S, timeout=SETUP_S)[0]))
    elif mode == "caller":
        _init(0, sys.argv[2])
        say("RESULT " + json.dumps(different_code_checks("worker1")))
        rpc.shutdown()
    else:
        raise SystemExit(f"unknown mode {mode!r}: torchrun, spawn, local or caller")


if __name__ == "__main__":
    main(sys.argv[1])
