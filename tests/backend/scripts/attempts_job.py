"""A torchrun job that can lose a rank on its first attempt (run by tests/test_machines.py and
tests/backend/test_connect.py).

Roles ``{"ps": 1, "trainer": N - 1}``. Each trainer joins a process group of the trainers, then
runs a few steps: a call to ps0 and an all-reduce among the trainers. ``ATTEMPTS_JOB_DIE``
(``RANK:WHEN``) makes that rank kill itself with SIGKILL on the job's first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0 on its machine): ``before_init`` right before
``init_from_env`` (its peers are forming the world), ``after_init`` after its first step (the
world had formed); ``hang_before_init`` makes it wait forever instead of joining. Every rank
prints one line when it is done, naming its attempt (torchrun's restart count on its machine)
and the world it joined (rpc_backend.connect.world_prefix())::

    torchrun --standalone --nproc-per-node=3 --max-restarts=1 tests/backend/scripts/attempts_job.py
"""

import os
import signal
import sys
import threading

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from rpc_backend import init_from_env, init_role_process_group, read_env
from rpc_backend.connect import world_prefix

STEPS = 5


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


def _die_here(when: str) -> None:
    spec = os.environ.get("ATTEMPTS_JOB_DIE", "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    rank, _, where = spec.partition(":")
    if int(rank) != int(os.environ["RANK"]):
        return
    if where == when:
        say(f"rank {rank}: killing itself ({when})")
        os.kill(os.getpid(), signal.SIGKILL)
    if where == f"hang_{when}":
        say(f"rank {rank}: waiting forever ({when})")
        threading.Event().wait()


def main() -> None:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    world_size = read_env()["world_size"]
    _die_here("before_init")
    with init_from_env(roles={"ps": 1, "trainer": world_size - 1}) as me:
        if me.role == "trainer":
            init_role_process_group(me)
            total = torch.zeros(1)
            for step in range(STEPS):
                out = rpc.rpc_sync("ps0", double, args=(torch.ones(1),))
                dist.all_reduce(out)
                total += out
                if step == 0:
                    _die_here("after_init")
            dist.destroy_process_group()
            say(f"{me.name}: attempt {attempt} done in {world_prefix()}, total {total.item():.0f}")
    if me.role == "ps":  # it served every trainer (its graceful shutdown waited for them)
        say(f"{me.name}: attempt {attempt} done in {world_prefix()}")


if __name__ == "__main__":
    main()
