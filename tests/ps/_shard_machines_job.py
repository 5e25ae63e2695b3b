"""A torchrun job for tests/ps/test_shard_checkpoints_machines.py (every rank runs it; not a test
module): ps0 and ps1 serve, trainer0 trains an eager and a lazy table on them, saves them with
``save_shards`` under ``--disk`` (each machine has its own directory mounted there: its local
disk), then trains on and saves them incrementally on that save, and loads each into fresh
tables with ``load_shards``.

What trainer0 writes to ``--out`` (a directory every machine sees, outside the disks):
``local.pt``, the tables' checkpoints before the local-layout save and after the load into fresh
tables on the same servers, and the manifest; ``local-inc.pt``, the same of the incremental
save; ``shared.pt``, how the shared layout fared there
(each step's error, or None, and the checkpoints of the tables it loaded into, before and after).

    torchrun --nnodes=3 --nproc-per-node=1 --node-rank=I --master-addr=machine0 --master-port=P \\
        -m tests.ps._shard_machines_job --disk DISK --out OUT
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from remote_module.ps import load_shards, save_shards
from rpc_backend import init_from_env
from tests.ps._shard_checkpoints_remote import bag, checkpoint, train

#: the tables: an eager one and a lazy one (rows stored as first touched), by case of
#: tests/ps/_shard_checkpoints_remote.py
TABLES = {"eager": "eager-sgd", "lazy": "lazy-adagrad-admission-eviction"}
SERVERS = ["ps0", "ps1"]


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def tables(prefix: str, servers: list[str] = SERVERS, steps: range = range(0)) -> dict:
    made = {key: bag(f"{prefix}.{key}", servers, case) for key, case in TABLES.items()}
    for table in made.values():
        train(table, steps)
    return made


def shared_tables(prefix: str, servers: list[str] = SERVERS, steps: range = range(6)) -> dict:
    """An eager and a lazy table without admission sketches, trained ``steps``."""
    made = {key: bag(f"{prefix}.{key}", servers, "eager-sgd", init=key) for key in TABLES}
    for table in made.values():
        train(table, steps)
    return made


def checkpoints(made: dict) -> dict:
    """Each table's checkpoint (as tests/ps/_shard_checkpoints_remote.py's, without a lazy
    table's looked-up rows: rows not stored read as the table name's first values)."""
    got = {key: checkpoint(table) for key, table in made.items()}
    got["lazy"].pop("rows")
    return got


def attempt(what, *args, **kwargs) -> str | None:
    """``what(*args, **kwargs)``: the error it raised (type and message), or None."""
    try:
        what(*args, **kwargs)
    except Exception as exc:  # (the test asserts which)
        return f"{type(exc).__name__}: {exc}"
    return None


def trainer(disk: Path, out: Path) -> None:
    # the local layout: each server under DISK/local/<server>/ on its own machine
    saved = tables("local", steps=range(6))
    before = checkpoints(saved)
    manifest = save_shards(disk / "local", saved, layout="local", token="machines")
    say("trainer0 saved the local layout")
    fresh = tables("local-fresh", steps=range(100, 102))  # (rows and state of their own first)
    load_shards(disk / "local", fresh)
    say("trainer0 loaded the local layout")
    torch.save({"before": before, "after": checkpoints(fresh), "manifest": manifest}, out / "local.pt")

    # an incremental save on it, in the local layout: each server's changes on its own disk
    for table in saved.values():
        train(table, range(6, 9))
    before = checkpoints(saved)
    manifest = save_shards(disk / "local-inc", saved, layout="local", token="machines", base=disk / "local")
    fresh = tables("local-inc-fresh", steps=range(100, 102))
    load_shards(disk / "local-inc", fresh)
    say("trainer0 loaded the incremental save")
    torch.save({"before": before, "after": checkpoints(fresh), "manifest": manifest}, out / "local-inc.pt")

    # the shared layout where DISK is no shared filesystem: each server writes on its own disk.
    # Tables without admission sketches (each server then reads only its own blocks' files,
    # onto the same servers), and the tables above, with sketches (every server reads every one)
    plain, sketched = shared_tables("shared", steps=range(6)), tables("sketched", steps=range(6))
    shared = {"saved": checkpoints(plain)}
    shared["save"] = attempt(save_shards, disk / "shared", plain, layout="shared")
    shared["save-sketched"] = attempt(save_shards, disk / "shared-sketched", sketched, layout="shared")
    loads = {"same": (disk / "shared", shared_tables("shared-same", steps=range(100, 102))),
             "swapped": (disk / "shared", shared_tables("shared-swapped", SERVERS[::-1], range(100, 102))),
             "sketched": (disk / "shared-sketched", tables("shared-sketched", steps=range(100, 102)))}
    for what, (path, into) in loads.items():
        shared[f"{what}-before"] = checkpoints(into)
        shared[what] = attempt(load_shards, path, into)
        shared[f"{what}-after"] = checkpoints(into)
        say(f"trainer0 loaded the shared layout ({what}): {shared[what]}")
    torch.save(shared, out / "shared.pt")
    say("trainer0 done")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--disk", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with init_from_env(roles={"ps": 2, "trainer": 1}) as me:
        say(f"{me.name} on {os.uname().nodename}")
        if me.role == "trainer":
            trainer(Path(args.disk), Path(args.out))


if __name__ == "__main__":
    main()
