"""Rank functions for tests/backend/test_worlds.py."""

import os
import time

import torch.distributed.rpc as rpc

from rpc_backend import current_worker


def describe() -> dict:
    me = current_worker()
    return {
        "name": me.name, "role": me.role, "role_rank": me.role_rank, "role_size": me.role_size,
        "env": [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ROLE_NAME")],
        "peers": me.workers("trainer"),
        "rpc_name": rpc.get_worker_info().name,
    }


def raise_inside_worker_context() -> None:
    """Rank 1 raises inside ``with current_worker():``; rank 0 never calls shutdown (it sleeps
    until the launcher stops it), so a graceful shutdown of rank 1 would wait for it forever."""
    me = current_worker()
    if me.rank == 1:
        with me:
            raise KeyError("failed inside the with block")
    time.sleep(3600)


def role_peers() -> dict:
    me = current_worker()
    return {role: me.workers(role) for role in ("ps", "ps1", "trainer")}
