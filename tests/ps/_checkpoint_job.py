"""A torchrun job for tests/ps/test_checkpointer_torchrun.py (every rank runs it; not a test
module): ps0 serves one table, trainer0 and trainer1 each train a small local model on it with
a :class:`remote_module.ps.Checkpointer`, batches chosen by the step index (plus draws from the
global RNGs, which the checkpoint restores).

``--kill ps0|trainer0|trainer1 --at K``: in torchrun's first attempt only, that process is
SIGKILLed before step K (ps0 by trainer0, over RPC; a trainer by itself); torchrun restarts the world and
the job resumes. Each trainer prints ``<name> resumed from step <k> (attempt <n>)`` and, at the
end, writes its local model and (trainer0) the table's state to ``OUT/<name>.pt``. With
``--hold``, trainer0 writes the table as resumed to ``OUT/resumed-<attempt>.pt`` before any
trainer trains (trainer1 waits for that file) and, having resumed from a checkpoint, what that
checkpoint's files hold of the table to ``OUT/checkpoint-<attempt>.pt`` (read into a fresh table
of the same settings on the same server).

    torchrun --standalone --nproc-per-node=3 --max-restarts=1 -m tests.ps._checkpoint_job \\
        --dir DIR --out OUT --mode sync --steps 6 --every 2 [--keep 3] [--full-every K] [--kill ps0 --at 5] [--hold]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed.rpc as rpc
from torch import nn

from remote_module.ps import Checkpointer, ShardedEmbeddingBag
from remote_module.ps.checkpoint._job_files import STEP_DIR, complete_checkpoints
from remote_module.ps.checkpoint._job_state import _read_ps
from rpc_backend import init_from_env
from tests._deadlines import HANG_S

ROWS, DIM = 12, 3


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def wait_for_a_checkpoint(path: Path) -> None:
    """Until a checkpoint under ``path`` is complete (saves complete in the background: a kill
    before one has would restart from scratch, and the test would prove nothing)."""
    deadline = time.monotonic() + HANG_S
    while not complete_checkpoints(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"no checkpoint under {path} completed within {HANG_S} s")
        time.sleep(0.05)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + HANG_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear within {HANG_S} s")
        time.sleep(0.05)


def _table(me, args: argparse.Namespace, name: str) -> ShardedEmbeddingBag:
    # (with --full-every, lazy: an eager table of 12 rows, most of them stepped between saves, has
    # its server write its blocks whole rather than by id, and no save would be incremental)
    init = "lazy" if getattr(args, "full_every", 1) > 1 else "eager"
    return ShardedEmbeddingBag(ROWS, DIM, me.workers("ps"), name=name, mode="sum", ps_mode=args.mode, init=init,
                               num_trainers=me.role_size, optimizer=(torch.optim.Adagrad, {"lr": 0.3}), timeout=60)


def _write(path: Path, obj) -> None:
    torch.save(obj, path.with_suffix(".part"))
    os.replace(path.with_suffix(".part"), path)


def train(me, args: argparse.Namespace) -> None:
    attempt, start, (head, table, opt, sched, table_sched, ckpt) = set_up(me, args)
    say(f"{me.name} resumed from step {start} (attempt {attempt})")
    out = Path(args.out)
    if args.hold:
        if me.role_rank == 0:
            if start > 0:  # (the checkpoint's files, read into a fresh table; the job's RNGs untouched)
                with torch.random.fork_rng():
                    held = _read_ps(Path(args.dir) / STEP_DIR.format(start), {"table": _table(me, args, "ckpt.read")})
                _write(out / f"checkpoint-{attempt}.pt", held["table"])
            _write(out / f"resumed-{attempt}.pt", {"state": table.state_dict(), "optim": table.optimizer_state_dict()})
        else:
            _wait_for(out / f"resumed-{attempt}.pt")
    for k in range(start, args.steps):
        if attempt == 0 and k == args.at:
            if args.kill == me.name or (args.kill == "ps0" and me.name == "trainer0"):
                wait_for_a_checkpoint(Path(args.dir))
            if args.kill == me.name:
                say(f"{me.name} kills itself before step {k}")
                os.kill(os.getpid(), signal.SIGKILL)
            if args.kill == "ps0" and me.name == "trainer0":
                say(f"{me.name} kills ps0 before step {k}")
                pid = rpc.rpc_sync("ps0", os.getpid)
                rpc.rpc_async("ps0", os.kill, args=(pid, signal.SIGKILL))
        train_step(me, k, head, table, opt, sched, table_sched, ckpt)
    finish(me, head, opt, sched, table, ckpt, out)


def set_up(me, args: argparse.Namespace) -> tuple[int, int, tuple]:
    """Trainer ``me``'s attempt (torchrun's restart count), the step it resumed from, and its
    objects: ``(head, table, opt, sched, table_sched, ckpt)``, the checkpoint loaded."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    table = _table(me, args, "ckpt.table")
    head = nn.Linear(DIM, 1)
    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    # the table's lr, set on every trainer by its own scheduler (sync: the servers refuse a step
    # whose trainers' lrs differ, so each resumed trainer must push the lr its scheduler left)
    table_sched = torch.optim.lr_scheduler.StepLR(table.ps_optimizer, step_size=3, gamma=0.5)
    ckpt = Checkpointer(args.dir, every_steps=args.every, keep=args.keep, ps={"table": table},
                        local={"head": head, "opt": opt, "sched": sched, "table_sched": table_sched},
                        full_every=getattr(args, "full_every", 1))
    torch.manual_seed(1000 + attempt)  # a restarted process's RNGs differ: the resume restores them
    random.seed(1000 + attempt)
    return attempt, ckpt.resume(), (head, table, opt, sched, table_sched, ckpt)


def train_step(me, k: int, head: nn.Module, table, opt, sched, table_sched, ckpt: Checkpointer) -> None:
    """Step ``k`` of trainer ``me`` (its batch chosen by ``k``; the noise drawn from the RNGs the
    checkpoint restores), then the checkpointer's step."""
    g = torch.Generator().manual_seed(100 * me.role_rank + k)
    ids = torch.randint(0, ROWS, (6,), generator=g)
    target = torch.randn(3, generator=g) + 0.1 * torch.randn(3) + random.random()
    loss = (head(table(ids, torch.arange(3) * 2)).squeeze(1) - target).pow(2).mean()
    opt.zero_grad()
    table.zero_grad()
    loss.backward()
    opt.step()
    table.step()
    sched.step()
    table_sched.step()
    ckpt.step()
    say(f"{me.name} step {k + 1}")


def finish(me, head: nn.Module, opt, sched, table, ckpt: Checkpointer, out: Path) -> None:
    """Close the checkpointer and write what the trainer ends with to ``out/<name>.pt``."""
    ckpt.close()
    table.flush()
    mine = {"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
            "table_lr": table.ps_optimizer.param_groups[0]["lr"]}
    if me.role_rank == 0:
        mine["table"] = table.state_dict()
        mine["table_optim"] = table.optimizer_state_dict()
    torch.save(mine, out / f"{me.name}.pt")
    say(f"{me.name} done")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--full-every", type=int, default=1)
    parser.add_argument("--kill", choices=("", "ps0", "trainer0", "trainer1"), default="")
    parser.add_argument("--at", type=int, default=-1)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args()
    with init_from_env(roles={"ps": 1, "trainer": 2}) as me:
        if me.role == "trainer":
            train(me, args)


if __name__ == "__main__":
    main()
