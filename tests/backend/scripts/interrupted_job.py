"""A user's script whose local world is stopped by Ctrl-C (run by
tests/backend/test_interrupt.py, which sends SIGINT to the script's process group, as a
terminal does, once every rank has written its ``ready<rank>`` file into the gate folder).

Rank 0 returns at once and serves the others in its shutdown (as a parameter server does),
rank 1 runs Python code, rank 2 waits inside an RPC to rank 1 (in C++, where no
KeyboardInterrupt reaches it).

    python tests/backend/scripts/interrupted_job.py GATE_DIR
"""

import os
import sys
import time

import torch.distributed.rpc as rpc

from rpc_backend import run_local


def ready(gate_dir: str, rank: int) -> None:
    with open(os.path.join(gate_dir, f"ready{rank}.tmp"), "w"):
        pass
    os.rename(os.path.join(gate_dir, f"ready{rank}.tmp"), os.path.join(gate_dir, f"ready{rank}"))


def run_until_stopped(gate_dir: str) -> None:
    me = rpc.get_worker_info().id
    ready(gate_dir, me)
    if me == 1:
        while True:  # the rank's own work, until Ctrl-C stops it
            time.sleep(0.05)
    if me == 2:
        rpc.rpc_sync("worker1", time.sleep, (3600,), timeout=0)


if __name__ == "__main__":
    print("STARTED", flush=True)
    # SETUP_S + HANG_S, SETUP_S (tests/_deadlines.py): the test interrupts it once started
    print("RESULT", run_local(run_until_stopped, 3, args=(sys.argv[1],), timeout=900, rpc_timeout=600), flush=True)
