"""DLRM-style benchmark: a model with many sharded tables against the same model with local ones.

    make bench                                 # runs this after bench_embedding
    python -m tests.benchmarks.bench_dlrm      # full size (about 2 minutes on 2 cores)
    python -m tests.benchmarks.bench_dlrm --quick

The model (tests/benchmarks/_dlrm_model.py) follows facebookresearch/dlrm's ``DLRM_Net``:
tables 100000-40000-20000-10000-4000-2000-1000-100 x 16, bottom MLP 13-512-256-64-16, dot
interaction, top MLP 52-512-256-1, batch 128, SGD (lr 0.1) for the dense part and, on the
servers, for the tables. Three local processes: "ps0" and "ps1" serve, "trainer0" trains, each
with ``OMP_NUM_THREADS=1`` (the local reference too: it runs in the trainer's process).

1. **Equal losses.** In sync mode, a few steps of the three variants (local tables; the
   sharded tables in a ``ShardedEmbeddingBagCollection``; the same sharded tables one by
   one) from the same weights and data: the losses must agree (relative 1e-5) and the
   collection's must equal the one-by-one tables' exactly, or the run fails.
2. **Speed.** In async mode, samples per second of each variant, rounds of a few steps
   interleaved in an order that rotates every round (medians), with the CPU seconds per step
   summed over the three processes (every thread) over the same rounds, and each variant's
   mean training loss over those rounds (one trainer: every variant but "collection prefetch
   overlap" computes what the local model does; that one's lookups miss one push each).
3. **Messages and bytes per step**, counted at the trainer's calls over a few steps: messages
   per server, and the payload each way (``rpc_backend.Traffic``: pickles and tensor bytes, not
   TensorPipe's framing nor TCP/IP headers), with the rate it makes at the median speed.

Prints a table with the issue's targets and writes JSON (bench-dlrm-results.json by default).
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

import torch

from rpc_backend import current_worker
from tests.benchmarks import _dlrm_model as dlrm
from tests.benchmarks._common import (
    BYTES_COUNTED,
    cpu_cell,
    cpu_per_op,
    publish,
    rounds,
    run_world,
    traffic_per_call,
)
from tests.benchmarks._cpu import world_meter
from tests.benchmarks.bench_remote_module import _verdict

FULL = {"tables": [100000, 40000, 20000, 10000, 4000, 2000, 1000, 100], "dim": 16, "bottom": [13, 512, 256, 64, 16],
        "top": [512, 256, 1], "batch": 128, "ids_per_bag": 10, "lr": 0.1, "sync_steps": 5, "steps_per_round": 10,
        "rounds": 15, "warmup_steps": 5, "message_steps": 5, "seed": 123}
QUICK = {**FULL, "tables": [1000, 400, 200, 100], "bottom": [13, 64, 16], "top": [64, 1], "batch": 32,
         "sync_steps": 3, "steps_per_round": 2, "rounds": 2, "warmup_steps": 1, "message_steps": 2}


def _sync_check(cfg: dict, servers: list[str]) -> dict[str, list[float]]:
    data = dlrm.batches(cfg, cfg["sync_steps"], cfg["seed"])
    losses = {}
    for variant in dlrm.SYNC_VARIANTS:
        model, opt = dlrm.build(cfg, variant, servers, f"dlrm-sync-{variant}", "sync", cfg["seed"])
        losses[variant] = [dlrm.train_step(model, opt, batch) for batch in dlrm.feed(model, data)]
    ref = losses["local"]
    for variant in ("collection", "tables", "collection prefetch"):
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses[variant], ref))
        if worst > 1e-5:
            raise AssertionError(f"sync losses of {variant} differ from the local model's by up to {worst:.3g} "
                                 f"(relative; expected within 1e-5): {losses[variant]} against {ref}")
    if losses["collection prefetch"] != losses["collection"]:
        raise AssertionError(f"the collection's losses with prefetch {losses['collection prefetch']} are not its "
                             f"losses without {losses['collection']} exactly")
    if losses["collection"] != losses["tables"]:
        raise AssertionError(f"the collection's losses {losses['collection']} are not the one-by-one tables' "
                             f"{losses['tables']} exactly")
    return losses


def trainer_main(cfg: dict) -> dict:
    servers = current_worker().workers("ps")
    results: dict[str, Any] = {"config": cfg, "torch": torch.__version__}
    results["sync_losses"] = _sync_check(cfg, servers)
    data = dlrm.batches(cfg, cfg["steps_per_round"], cfg["seed"] + 1)
    built = {v: dlrm.build(cfg, v, servers, f"dlrm-async-{v}", "async", cfg["seed"]) for v in dlrm.VARIANTS}
    # each variant's batches: the cycle of ``data`` (the prefetch variant's through prefetching())
    feeds = {v: dlrm.feed(built[v][0], itertools.cycle(data)) for v in dlrm.VARIANTS}

    timed_losses: dict[str, list[float]] = {v: [] for v in dlrm.VARIANTS}
    timing = [False]

    def round_of(variant: str) -> Any:
        model, opt = built[variant]

        def run() -> None:
            for _ in data:
                loss = dlrm.train_step(model, opt, next(feeds[variant]))
                if timing[0]:
                    timed_losses[variant].append(loss)
        return run

    for variant in dlrm.VARIANTS:  # warm up every path
        model, opt = built[variant]
        for _ in range(cfg["warmup_steps"]):
            dlrm.train_step(model, opt, next(feeds[variant]))
    timing[0] = True
    samples, cpu = rounds({v: round_of(v) for v in dlrm.VARIANTS}, cfg["rounds"], 0, world_meter())
    results["mean_loss_timed"] = {v: statistics.fmean(x) for v, x in timed_losses.items()}
    steps = cfg["steps_per_round"]
    results["samples_per_s"] = {v: statistics.median(cfg["batch"] * steps / t for t in s) for v, s in samples.items()}
    results["samples_per_s_rounds"] = {v: [cfg["batch"] * steps / t for t in s] for v, s in samples.items()}
    results["cpu_s_per_step"] = cpu_per_op(cpu, steps)
    # the servers holding some table's rows (a small table is one block, on the first server)
    results["servers_with_rows"] = sorted({s for bag in built["collection"][0].tables.bags for _, _, s in bag._ranges})
    results["messages_per_step"], results["bytes_per_step"] = {}, {}
    for v in ("collection", "tables", "collection prefetch", "collection prefetch overlap"):
        counted = traffic_per_call(lambda v=v: dlrm.train_step(*built[v], next(feeds[v])), cfg["message_steps"],
                                   settle=built[v][0].tables.flush)
        results["messages_per_step"][v] = counted["messages"]
        results["bytes_per_step"][v] = {"to_servers": sum(counted["sent"].values()),
                                        "from_servers": sum(counted["received"].values())}
    return results


def rank_main(cfg: dict) -> dict | None:
    if current_worker().role == "trainer":
        return trainer_main(cfg)
    return None  # the servers only serve


def ratios(r: dict) -> dict[str, float]:
    rate = r["samples_per_s"]
    return {
        "collection / local tables, samples/s (target >= 0.4)": rate["collection"] / rate["local"],
        # (issue 45: the better prefetch form at least 0.7x the local model)
        "collection prefetch / local tables, samples/s (target >= 0.7)": rate["collection prefetch"] / rate["local"],
        "collection prefetch overlap / local tables, samples/s (target >= 0.7)":
            rate["collection prefetch overlap"] / rate["local"],
        "tables one by one / local tables, samples/s": rate["tables"] / rate["local"],
        "collection / tables one by one, samples/s": rate["collection"] / rate["tables"],
    }


def report(r: dict) -> str:
    cfg = r["config"]
    lines = ["", f"DLRM-style model: tables {'-'.join(map(str, cfg['tables']))} x {cfg['dim']}, batch {cfg['batch']}, "
             "2 servers, 1 trainer, async",
             "cpu: CPU seconds per training step summed over the 3 processes (every thread)",
             "loss: mean training loss over the timed rounds (the same batches for every variant)",
             f"{'variant':<34}{'samples/s':>11}{'cpu ms/step':>13}{'loss':>9}", "-" * 67]
    for v, rate in r["samples_per_s"].items():
        lines.append(f"  {v:<32}{rate:>11.0f}{cpu_cell(r['cpu_s_per_step'][v], 1e3, 13, 2)}"
                     f"{r['mean_loss_timed'][v]:>9.4f}")
    lines += ["", "messages per training step, by worker (lookups and pushes together)"]
    for v, per in r["messages_per_step"].items():
        lines.append(f"  {v:<32}{', '.join(f'{w}: {n:g}' for w, n in per.items())}")
    lines += ["", f"bytes per training step, each way ({BYTES_COUNTED}); MB/s: at the median samples/s above",
              f"{'variant':<34}{'to servers B':>14}{'from servers B':>16}{'to MB/s':>9}{'from MB/s':>11}"]
    for v, b in r["bytes_per_step"].items():
        steps_per_s = r["samples_per_s"][v] / cfg["batch"]
        lines.append(f"  {v:<32}{b['to_servers']:>14,.0f}{b['from_servers']:>16,.0f}"
                     f"{b['to_servers'] * steps_per_s / 1e6:>9.2f}{b['from_servers'] * steps_per_s / 1e6:>11.2f}")
    collection = r["messages_per_step"]["collection"]
    one_each = collection == {s: 2 for s in r["servers_with_rows"]}
    lines += ["", f"sync losses agree (local / collection / one by one): {r['sync_losses']['collection'][:3]} ...",
              "", "ratios of medians (same run)", "-" * 84]
    for name, v in r["ratios"].items():
        lines.append(f"  {name:<72}{v:>6.2f}{_verdict(name, v)}")
    lines.append(f"  {'collection: one lookup + one push per server per step':<72}"
                 f"{'  met' if one_each else '  NOT MET'}")
    for v in ("collection prefetch", "collection prefetch overlap"):
        ahead = r["messages_per_step"][v] == {s: 1 for s in r["servers_with_rows"]}
        lines.append(f"  {v + ': one message per server per step':<72}{'  met' if ahead else '  NOT MET'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    results, path = run_world(argv, "remote_module DLRM-style benchmark", "bench-dlrm-results.json", QUICK, FULL,
                              rank_main, {"ps": 2, "trainer": 1}, timeout=1200)
    results["ratios"] = ratios(results)
    return publish(results, report(results), path)


if __name__ == "__main__":
    main()
