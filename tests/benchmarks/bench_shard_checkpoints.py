"""Shard checkpoints benchmark (issue 44's acceptance): what passes through the trainer when a
lazy table of 10^8 rows holding 10^6 (dim 16, Adagrad) is saved with ``save_shards`` and loaded
with ``load_shards`` (each server writing and reading its own blocks), beside the trainer-side
checkpoint of the same table (``state_dict()`` + ``optimizer_state_dict()``, every row through
the trainer).

    python -m tests.benchmarks.bench_shard_checkpoints            # full size (about a minute)
    python -m tests.benchmarks.bench_shard_checkpoints --quick    # 10^4 rows held

Four local processes on loopback (OMP_NUM_THREADS=1): "trainer0" runs everything, "ps0",
"ps1" hold the saved table, "ps0"-"ps2" the loaded one. Bytes are counted in the trainer by
tests/benchmarks/_caller_bytes.py (every RPC argument sent and answer received, tensors by the
bytes RPC sends; rpc_backend's heartbeats left out); the target is at most 1 MB received by the
trainer for a save and for a load.
Wall seconds of each beside them, and the bytes the servers wrote. Checked (the run raises
otherwise): the loaded table holds the saved rows, bit for bit (its ``state_dict()``).

Writes JSON (bench-shard-checkpoints-results.json by default).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import torch

from rpc_backend import current_worker
from tests.benchmarks._caller_bytes import CallerBytes
from tests.benchmarks._common import publish, run_world

MB = 1e6
FULL = {"rows": 10**8, "held": 10**6, "dim": 16, "target_MB": 1.0}
QUICK = {**FULL, "held": 10**4}


def _table(name: str, servers: list[str], cfg: dict) -> Any:
    from remote_module.ps import ShardedEmbeddingBag

    return ShardedEmbeddingBag(cfg["rows"], cfg["dim"], servers, name=name, init="lazy",
                               optimizer=(torch.optim.Adagrad, {"lr": 0.1}), timeout=600)


def _counted(fn: Any) -> dict:
    from rpc_backend import watch

    # (rpc_backend's heartbeats, a few hundred bytes per peer a second whatever the job does, are
    # not the checkpoint's: rpc_backend.Traffic leaves them out too)
    with CallerBytes(ignore=(watch._beat,)) as counted:
        start = time.perf_counter()
        fn()
        wall = time.perf_counter() - start
    return {"received_bytes": counted.other["received"] + counted.tensor_bytes("received"),
            "sent_bytes": counted.other["sent"] + counted.tensor_bytes("sent"),
            "messages": sum(counted.messages.values()), "by_handler": dict(counted.messages), "wall_s": wall}


def trainer_main(cfg: dict) -> dict:
    from remote_module.ps import load_shards, save_shards

    emb = _table("bench-shards", ["ps0", "ps1"], cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.unique(torch.randint(0, cfg["rows"], (2 * cfg["held"],), generator=g))
    ids = ids[torch.randperm(ids.numel(), generator=g)[:cfg["held"]]]
    emb(ids, torch.arange(ids.numel())).sum().backward()
    emb.step()
    directory = tempfile.mkdtemp(prefix="bench-shards-")
    loaded = _table("bench-shards-loaded", ["ps0", "ps1", "ps2"], cfg)
    try:
        save = _counted(lambda: save_shards(directory, {"emb": emb}))
        on_disk = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        load = _counted(lambda: load_shards(directory, {"emb": loaded}))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    trainer_side = _counted(lambda: (emb.state_dict(), emb.optimizer_state_dict()))
    saved, got = emb.state_dict(), loaded.state_dict()
    if not (torch.equal(saved["weight.ids"], got["weight.ids"]) and torch.equal(saved["weight.rows"],
                                                                              got["weight.rows"])):
        raise AssertionError("the loaded table does not hold the saved rows")
    return {"config": cfg, "held": int(saved["weight.ids"].numel()), "save": save, "load": load,
            "on_disk_bytes": on_disk, "trainer_side_checkpoint": trainer_side}


def rank_main(cfg: dict) -> dict | None:
    if current_worker().role != "trainer":
        return None  # the servers only serve
    return trainer_main(cfg)


def report(r: dict) -> str:
    cfg = r["config"]
    lines = [f"lazy {cfg['rows']:,} x {cfg['dim']} table holding {r['held']:,} rows (Adagrad); saved from 2 "
             f"servers, loaded onto 3; {r['on_disk_bytes'] / MB:.1f} MB written by the servers",
             f"{'':32} {'received by trainer':>20} {'sent by trainer':>16} {'messages':>9} {'wall s':>8}"]
    for label, key in (("save_shards", "save"), ("load_shards", "load"),
                       ("state_dict + optimizer_state", "trainer_side_checkpoint")):
        row = r[key]
        lines.append(f"{label:32} {row['received_bytes']:>20,} {row['sent_bytes']:>16,} {row['messages']:>9} "
                     f"{row['wall_s']:>8.2f}")
    for key in ("save", "load"):
        got = r[key]["received_bytes"] / MB
        verdict = "met" if got <= cfg["target_MB"] else "NOT MET"
        lines.append(f"{key}: {got:.4f} MB received by the trainer (target <= {cfg['target_MB']} MB): {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    results, path = run_world(argv, "remote_module shard checkpoints benchmark",
                              "bench-shard-checkpoints-results.json", QUICK, FULL, rank_main,
                              {"trainer": 1, "ps": 3}, timeout=1800)
    results["ratios"] = {f"{k} received MB / target": results[k]["received_bytes"] / MB / results["config"]["target_MB"]
                         for k in ("save", "load")}
    return publish(results, report(results), path)


if __name__ == "__main__":
    main()
