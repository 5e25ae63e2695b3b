"""Rank functions for tests/test_local_launcher.py."""

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
