"""Rank functions for tests/backend/test_launcher.py."""

import os
import time

import torch.distributed.rpc as rpc


def rank_and_sum(base: int) -> tuple:
    me = rpc.get_worker_info()
    return me.name, base + me.id, os.environ["RANK"], os.environ["WORLD_SIZE"]


def second_rank_fails() -> None:
    if rpc.get_worker_info().id == 1:
        raise ValueError("rank 1 fails on purpose")
    time.sleep(3600)  # would hang forever without the launcher stopping it


def tensors_of_rank(seed: int) -> dict:
    """Tensors of several kinds: a view into a larger storage, a leaf that requires grad, ints,
    and a tensor a remote worker computed."""
    import torch

    me = rpc.get_worker_info()
    g = torch.Generator().manual_seed(seed + me.id)
    base = torch.randn(6, 4, generator=g)
    other = "worker1" if me.id == 0 else "worker0"
    return {
        "rank": me.id,
        "view": base[1:4, ::2],
        "leaf": torch.nn.Parameter(torch.randn(3, generator=g)),
        "ints": torch.arange(5, dtype=torch.int64) * (me.id + 1),
        "remote": rpc.rpc_sync(other, torch.add, (base, 1.0)),
    }


def rank_returns_a_lock_inside() -> object:
    import threading

    if rpc.get_worker_info().id == 1:
        return {"ok": 1, "lock": threading.Lock()}
    return "fine"


def what_a_rank_sees(mark_name: str) -> dict:
    """What a rank inherits from the caller of run_local, and who started it (its launcher and parent)."""
    import multiprocessing

    import torch

    from tests.backend._sockets import parent_of

    me = rpc.get_worker_info().id
    print(f"rank {me} prints", flush=True)
    rpc.rpc_sync(f"worker{1 - me}", os.getpid)  # a message each way: the transports are in use
    return {
        # TensorPipe names its threads: TP_UV_loop (uv), TP_SHM_reactor (shm, the busy-polling one)
        "thread_names": {open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")}
        if os.path.isdir("/proc/self/task") else None,
        "mark": os.environ.get(mark_name),
        "cwd": os.getcwd(),
        # a rank is forked by the world's zygote, which the launcher spawned
        "parent": os.getppid(),
        "mp_parent": multiprocessing.parent_process().pid,
        "launcher": parent_of(os.getppid()),
        "threads": torch.get_num_threads(),
        "omp_env": os.environ.get("OMP_NUM_THREADS"),
        "arenas_env": os.environ.get("MALLOC_ARENA_MAX"),
    }



def draws(seed: int | None) -> dict:
    """The rank's first draws from each global generator, after ``torch.manual_seed(seed)``
    when ``seed`` is given (else as the rank starts): torch's initial seed, a randn, a randperm,
    a dropout mask, a shuffled DataLoader's order, and Python's and NumPy's generators."""
    import random

    import numpy
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    return {
        "initial_seed": torch.initial_seed(),
        "randn": torch.randn(8),
        "randperm": torch.randperm(64),
        "dropout": torch.nn.functional.dropout(torch.ones(64), 0.5) == 0,
        "loader": torch.cat(list(torch.utils.data.DataLoader(torch.arange(64), batch_size=16, shuffle=True))),
        "python": random.random(),
        "numpy": float(numpy.random.random()),
    }


def second_rank_interrupted() -> None:
    """Rank 1 gets SIGINT (only it: the caller does not); the others wait for it."""
    import signal

    if rpc.get_worker_info().id == 1:
        os.kill(os.getpid(), signal.SIGINT)
    time.sleep(3600)  # rank 1: KeyboardInterrupt here; the others until the launcher stops them
