"""Rank functions for tests/backend/test_worlds.py."""

import os

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
    me = current_worker()
    if me.rank == 1:
        with me:
            raise KeyError("failed inside the with block")


def role_peers() -> dict:
    me = current_worker()
    return {role: me.workers(role) for role in ("ps", "ps1", "trainer")}
