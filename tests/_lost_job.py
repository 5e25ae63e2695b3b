"""A torchrun job for tests/test_lost_machines.py (every rank runs it; not a test module).

``--roles ps:1,trainer:2[,replica:1]``: ps0 holds the blocks of a small ``PSModel`` that each
trainer steps asynchronously (so that trainers never wait for each other, and a peer's loss
is learnt from the heartbeats alone), printing ``<name> step <n>`` after each step; other
roles only serve. A trainer steps until ``--steps`` steps are done (0: until the job ends it),
or, with ``--after-loss N``, until N steps after a peer of an expendable role was lost. Logs
carry wall-clock timestamps (``%(created)``), which the test compares with the moment it
broke a machine.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch
from torch import nn

from remote_module.ps import PSModel
from rpc_backend import init_from_env, lost_workers
from tests._deadlines import HANG_S

#: seconds between a trainer's steps (a pace, so that the job leaves the shared cores alone)
PACE_S = 0.1


def say(line: str) -> None:
    sys.stdout.write(f"{time.time():.3f} {line}\n")
    sys.stdout.flush()


def train(me, steps: int, after_loss: int) -> None:
    torch.manual_seed(me.role_rank)
    model = PSModel(nn.Linear(4, 1), me.workers("ps"), name="lost", num_trainers=me.role_size, ps_mode="async")
    deadline = time.monotonic() + 2 * HANG_S  # a guard only: the test's own is shorter
    step, lost_at = 0, None
    while time.monotonic() < deadline:
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        model.step()
        step += 1
        say(f"{me.name} step {step}")
        if steps and step >= steps:
            return
        if after_loss and lost_at is None and lost_workers():
            lost_at = step
            say(f"{me.name} goes on without {', '.join(w.name for w in lost_workers())}")
        if lost_at is not None and step >= lost_at + after_loss:
            return
        time.sleep(PACE_S)
    raise SystemExit(f"{me.name}: still running after {2 * HANG_S} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--roles", required=True)
    parser.add_argument("--expendable", default="")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--after-loss", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(created).3f %(levelname)s %(name)s: %(message)s")
    roles = {role: int(count) for role, count in (item.split(":") for item in args.roles.split(","))}
    expendable = tuple(r for r in args.expendable.split(",") if r)
    with init_from_env(roles=roles, expendable=expendable) as me:
        say(f"{me.name} joined")
        if me.role == "trainer":
            train(me, args.steps, args.after_loss)
    say(f"{me.name} done")


if __name__ == "__main__":
    main()
