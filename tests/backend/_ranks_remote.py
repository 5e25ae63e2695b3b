"""Rank functions for the tests in tests/backend/ (run by run_local on every rank)."""

from __future__ import annotations

import functools
import operator
import time

import torch.distributed.rpc as rpc

from tests._deadlines import HANG_S

_shutdown_began: list[float] = []


def _record_shutdown_start() -> None:
    """On this rank: note when its ``rpc.shutdown()`` begins (``time.monotonic``: one clock for
    the processes of a machine), for :func:`shutdown_began`."""
    original = rpc.shutdown

    @functools.wraps(original)
    def shutdown(*args, **kwargs):
        _shutdown_began.append(time.monotonic())
        return original(*args, **kwargs)

    rpc.shutdown = shutdown


def shutdown_began() -> float | None:
    """When this rank's ``rpc.shutdown()`` began; None before it did."""
    return _shutdown_began[0] if _shutdown_began else None


def keep_calling_worker1(serve_for: float | None, min_calls: int = 0) -> dict | None:
    """Rank 0 calls worker1 while worker1 has already returned (and waits in its graceful
    shutdown). With ``serve_for``: until worker1's shutdown began at least ``serve_for``
    seconds ago and ``min_calls`` calls were made since (``served``: seconds from that start to
    the last answer); with None: until a call fails. Stops at the first failed call and says
    when it happened; HANG_S is a hang guard."""
    if rpc.get_worker_info().id != 0:
        _record_shutdown_start()
        return None
    start = time.monotonic()
    calls = since = 0
    began = failure = None
    while True:
        try:
            if serve_for is not None and began is None:
                began = rpc.rpc_sync("worker1", shutdown_began, timeout=HANG_S)
                since = 0
            calls = rpc.rpc_sync("worker1", operator.add, (calls, 1), timeout=HANG_S)
        except RuntimeError as exc:
            failure = f"{time.monotonic() - start:.1f} s: {exc}"
            break
        now = time.monotonic()
        since += began is not None
        if began is not None and now - began >= serve_for and since >= min_calls:
            break
        if now - start > HANG_S:
            failure = f"hang guard: {HANG_S:g} s of calls, worker1's shutdown began at {began}"
            break
        time.sleep(0.02)
    return {"calls": calls, "seconds": time.monotonic() - start, "failure": failure, "calls_since": since,
            "served": None if began is None else time.monotonic() - began}


def trainers_in_a_role_group() -> dict | None:
    """A torchrun-style job body: trainers form a gloo group of their own (all_reduce, one DDP
    step on different data) and call the ps over RPC; the ps only serves."""
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from rpc_backend import current_worker, init_role_process_group
    from tests.backend._sockets import listening_addresses, parent_of

    me = current_worker()
    if me.role != "trainer":
        return None
    init_role_process_group(me)
    total = torch.tensor([float(me.role_rank + 1)])
    dist.all_reduce(total)
    torch.manual_seed(100 + me.role_rank)  # different initial weights: DDP must broadcast rank 0's
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(me.role_rank))  # different data
    model(x).pow(2).mean().backward()
    opt.step()
    from_ps = rpc.rpc_sync("ps0", operator.mul, (me.role_rank, 10))
    report = {
        "group": (dist.get_rank(), dist.get_world_size()),
        "all_reduce": total.item(),
        # plain lists: tensors would travel as shared memory
        "params": [p.detach().tolist() for p in model.parameters()],
        "from_ps": from_ps,
        "master": (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
        "listening": listening_addresses(),
        # the launcher: the parent of this rank's parent (the zygote that forked it)
        "launcher_listening": listening_addresses(parent_of(os.getppid())),
    }
    dist.barrier()
    dist.destroy_process_group()
    return report


def write_pid_and_wait(pid_dir: str) -> None:
    """Every rank writes ``rank<N>.pid`` into ``pid_dir`` (atomically) and then waits forever."""
    import os

    rank = rpc.get_worker_info().id
    tmp = os.path.join(pid_dir, f".rank{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(pid_dir, f"rank{rank}.pid"))
    while True:
        time.sleep(1.0)
