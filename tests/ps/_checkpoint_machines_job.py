"""A torchrun job for tests/ps/test_checkpointer_machines.py (every rank runs it; not a test
module): tests/ps/_checkpoint_job.py's job (ps0 serves one table, trainer0 and trainer1 each
train a small local model on it with a :class:`remote_module.ps.Checkpointer`, batches chosen by
the step index, sync mode), where the test, not the job, breaks the world: it kills every process
of a machine.

``--pause-at K``: in a run that starts from scratch (no checkpoint yet), each trainer prints
``<name> paused before step K`` and waits there, so that the test kills a machine at a step it
knows at any speed. The machine's loss ends the waiting ranks (``rpc_backend``'s heartbeats), and
a run that resumed from a checkpoint does not pause. Each trainer prints ``<name> resumed from
step <k> (attempt <n>)`` and, at the end, writes its local model and (trainer0) the table's state
to ``OUT/<name>.pt``, as tests/ps/_checkpoint_job.py does.

    torchrun --nnodes=2 --nproc-per-node=N --max-restarts=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \\
        --rdzv-id=ID -m tests.ps._checkpoint_machines_job --dir DIR --out OUT [--pause-at 5]
"""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path

from rpc_backend import init_from_env
from tests._deadlines import HANG_S
from tests.ps._checkpoint_job import finish, say, set_up, train_step, wait_for_a_checkpoint


def train(me, args: argparse.Namespace) -> None:
    attempt, start, (head, table, opt, sched, table_sched, ckpt) = set_up(me, args)
    say(f"{me.name} resumed from step {start} (attempt {attempt}) on {os.uname().nodename}")
    for k in range(start, args.steps):
        if start == 0 and k == args.pause_at:
            wait_for_a_checkpoint(Path(args.dir))  # (saves complete in the background)
            say(f"{me.name} paused before step {k}")
            # held until a machine's loss ends this rank (WorkerLost, raised here); HANG_S: a guard
            threading.Event().wait(HANG_S)
            raise SystemExit(f"{me.name}: no machine was lost within {HANG_S} s of the pause")
        train_step(me, k, head, table, opt, sched, table_sched, ckpt)
    finish(me, head, opt, sched, table, ckpt, Path(args.out))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--pause-at", type=int, default=-1)
    args = parser.parse_args()
    with init_from_env(roles={"ps": 1, "trainer": 2}) as me:
        say(f"{me.name} joined on {os.uname().nodename}")
        if me.role == "trainer":
            train(me, args)


if __name__ == "__main__":
    main()
