"""What checkpoints cost the click demo (issue 44's acceptance): ``python -m
remote_module.demos.dlrm --steps 2000`` with a full save every 100 steps (``--checkpoint DIR
--every 100``: 20 saves of its 71 MB of eager tables, plus optimizer state) beside the same run
without checkpoints; the target is at least 0.95x the steps/s.

    python -m tests.benchmarks.bench_checkpoint_cost                 # 3 rounds of both (about 4 minutes)
    python -m tests.benchmarks.bench_checkpoint_cost --rounds 5 --steps 2000 --every 100
    python -m tests.benchmarks.bench_checkpoint_cost --quick         # 1 round of 40 steps, not graded
    python -m tests.benchmarks.bench_checkpoint_cost --full-every 1  # without the incremental variant

A third variant, ``--full-every K`` (default 4), saves the tables whole every K-th checkpoint
and only the rows changed since the one before in the others (incremental saves).

Each round runs the variants, one after the other, in an order that rotates by round
(the demo's own processes: 2 servers, 2 trainers, on loopback); the figures are medians over
rounds and the same-round ratios. Per run: steps/s (the trainers' mean, as the demo measures
it: its training loop only), the CPU seconds of every process of the run per training step
(user + system, of the whole process tree, from ``getrusage(RUSAGE_CHILDREN)``) and of each
process over the training loop (trainer0, trainer1, ps0, ps1: the demo's ``cpu_s``), and with
checkpoints the saves completed, the bytes of each, the seconds training waited per save on
trainer0 (the servers' snapshot and its own file) and the seconds the servers took to write
the newest one in the background. Then this machine's own cost of what a server's save does
with 32 MB of rows (:func:`probe`: copies into fresh and into reused memory, SHA-256 and CRC-32,
a file written through the page cache and around it, in the directory the checkpoints went to).
Writes JSON (bench-checkpoint-cost-results.json by default).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _run(steps: int, checkpoint: str | None, every: int, work: Path, full_every: int = 1) -> dict[str, Any]:
    """One demo run: its trainers' figures and the CPU seconds of its processes."""
    out = work / "run.json"
    argv = [sys.executable, "-m", "remote_module.demos.dlrm", "--steps", str(steps), "--no-progress",
            "--plot", "", "--json", str(out)]
    if checkpoint is not None:
        shutil.rmtree(checkpoint, ignore_errors=True)
        argv += ["--checkpoint", checkpoint, "--every", str(every), "--full-every", str(full_every)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"the demo failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")
    trainers = json.loads(out.read_text())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    got = {"steps_per_s": statistics.mean(t["steps_per_s"] for t in trainers),
           "cpu_ms_per_step": 1e3 * cpu / (steps * len(trainers)),
           # each process over the training loop (a trainer's own; the servers' as trainer0 read them)
           "process_cpu_ms_per_step": {name: 1e3 * s / steps for t in trainers for name, s in t["cpu_s"].items()
                                       if name == t["trainer"] or t is trainers[0]}}
    if checkpoint is not None:
        figures = trainers[0]["checkpoints"]
        got.update(saves=figures["completed"], bytes_per_save=figures["bytes"], incremental=figures["incremental"],
                   waited_s_per_save=figures["save_s"] / max(1, figures["saves"]), write_s=figures["write_s"])
    return got


def _median_cpu_ms(work: Any, times: int = 3) -> float:
    """The median thread CPU milliseconds (user + system) of ``work()``."""
    spent = []
    for _ in range(times):
        before = time.thread_time()
        work()
        spent.append(1e3 * (time.thread_time() - before))
    return statistics.median(spent)


def probe(mb: int = 32) -> dict[str, float]:
    """This machine's own cost of what a server's save does with ``mb`` MB of rows (thread CPU
    ms, median of 3): copied into fresh memory and into memory touched before (the kept snapshot
    memory), checksummed (SHA-256, CRC-32 as the writers compute it, ``_shard_io.CRC32_BY``, and
    zlib's), and (median of 5 new files each, interleaved) a file
    of them written and fsynced through the page cache and around it (``O_DIRECT``; where the
    filesystem refuses it, both are buffered)."""
    import hashlib
    import zlib

    import torch

    from remote_module.ps import _shard_io

    rows = torch.randn(mb << 18)  # (mb MB of float32)
    kept = torch.empty_like(rows)
    data = memoryview(rows.numpy()).cast("B")
    got = {"copy_fresh_ms": _median_cpu_ms(lambda: rows.clone()),
           "copy_kept_ms": _median_cpu_ms(lambda: kept.copy_(rows)),
           "sha256_ms": _median_cpu_ms(lambda: hashlib.sha256(data).digest()),
           "crc32_ms": _median_cpu_ms(lambda: _shard_io._crc32(data)),  # (the one the writers use)
           "crc32_zlib_ms": _median_cpu_ms(lambda: zlib.crc32(data))}
    directory = tempfile.mkdtemp(prefix="bench-checkpoint-probe-")  # (where the runs' checkpoints went)
    writes: dict[str, list[float]] = {"write_buffered_ms": [], "write_direct_ms": []}
    previous = _shard_io.DIRECT_WRITES
    try:
        for i in range(5):  # (new files one after another, as a job's saves write them; interleaved)
            for name, direct in (("write_buffered_ms", False), ("write_direct_ms", True)):
                _shard_io.DIRECT_WRITES = direct
                writes[name].append(_median_cpu_ms(lambda: _shard_io.write_saved(directory, f"{name}{i}", [rows]), 1))
    finally:
        _shard_io.DIRECT_WRITES = previous
        shutil.rmtree(directory, ignore_errors=True)
    return {**got, **{name: statistics.median(spent) for name, spent in writes.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--full-every", type=int, default=4,
                        help="a third variant: the tables whole every K-th save, incremental between (1: none)")
    parser.add_argument("--quick", action="store_true", help="1 round of 40 steps, a save every 20 (not graded)")
    parser.add_argument("--json", default="bench-checkpoint-cost-results.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.every = 1, 40, 20
    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-cost-"))
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "checkpoints": []}
    if args.full_every > 1:
        runs["incremental"] = []
    try:
        for r in range(args.rounds):
            order = list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]  # (each variant first in turn)
            for variant in order:
                got = _run(args.steps, None if variant == "none" else str(work / "ckpt"), args.every, work,
                           args.full_every if variant == "incremental" else 1)
                runs[variant].append(got)
                print(f"round {r + 1} {variant:<12} " + "  ".join(
                    f"{k} {v:,.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in got.items()
                    if k != "process_cpu_ms_per_step"), flush=True)
                print("    CPU ms per step, each process: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in sorted(got["process_cpu_ms_per_step"].items())), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = [c["steps_per_s"] / n["steps_per_s"] for n, c in zip(runs["none"], runs["checkpoints"])]
    summary = {
        "steps": args.steps, "every": args.every, "rounds": args.rounds, "load_avg": os.getloadavg(),
        "steps_per_s": {v: statistics.median(x["steps_per_s"] for x in runs[v]) for v in runs},
        "cpu_ms_per_step": {v: statistics.median(x["cpu_ms_per_step"] for x in runs[v]) for v in runs},
        "process_cpu_ms_per_step": {v: {p: statistics.median(x["process_cpu_ms_per_step"][p] for x in runs[v])
                                        for p in runs[v][0]["process_cpu_ms_per_step"]} for v in runs},
        "same_round_ratios": ratios, "median_ratio": statistics.median(ratios), "target_ratio": 0.95,
        "bytes_per_save": statistics.median(x["bytes_per_save"] for x in runs["checkpoints"]),
        "waited_s_per_save": statistics.median(x["waited_s_per_save"] for x in runs["checkpoints"]),
        "write_s": statistics.median(x["write_s"] for x in runs["checkpoints"]),
        "saves": [x["saves"] for x in runs["checkpoints"]], "runs": runs, "quick": args.quick,
    }
    if "incremental" in runs:  # (its bytes: the newest save's, an incremental one unless saves % K == 1)
        summary["incremental"] = {
            "full_every": args.full_every, "same_round_ratios": [
                i["steps_per_s"] / n["steps_per_s"] for n, i in zip(runs["none"], runs["incremental"])],
            "bytes_newest_save": statistics.median(x["bytes_per_save"] for x in runs["incremental"]),
            "waited_s_per_save": statistics.median(x["waited_s_per_save"] for x in runs["incremental"]),
            "incremental_saves": [x["incremental"] for x in runs["incremental"]]}
        summary["incremental"]["median_ratio"] = statistics.median(summary["incremental"]["same_round_ratios"])
    summary["ratios"] = {"checkpoints_over_none_steps_per_s": summary["median_ratio"]}
    grade = ("quick run: not graded" if args.quick else
             "met" if summary["median_ratio"] >= summary["target_ratio"] else "NOT MET")
    print(f"\nsteps/s (median): none {summary['steps_per_s']['none']:.1f}, checkpoints "
          f"{summary['steps_per_s']['checkpoints']:.1f}; same-round ratios "
          f"{', '.join(f'{r:.3f}' for r in ratios)} (median {summary['median_ratio']:.3f}, target >= 0.95)  {grade}")
    print(f"CPU ms per trainer step, every process of the run: none {summary['cpu_ms_per_step']['none']:.2f}, "
          f"checkpoints {summary['cpu_ms_per_step']['checkpoints']:.2f}")
    each = summary["process_cpu_ms_per_step"]
    print("CPU ms per step of each process over the training loop (median; none -> checkpoints): " + ", ".join(
        f"{p} {each['none'][p]:.2f} -> {each['checkpoints'][p]:.2f}" for p in sorted(each["none"])))
    print(f"per save: {summary['bytes_per_save'] / 1e6:.1f} MB, training waited {summary['waited_s_per_save']:.3f} s, "
          f"the servers wrote in {summary['write_s']:.2f} s in the background; saves completed per run "
          f"{summary['saves']}; load average {summary['load_avg'][0]:.1f}")
    if "incremental" in summary:
        inc = summary["incremental"]
        print(f"incremental (--full-every {inc['full_every']}): steps/s {summary['steps_per_s']['incremental']:.1f}, "
              f"same-round ratios to none {', '.join(f'{r:.3f}' for r in inc['same_round_ratios'])} (median "
              f"{inc['median_ratio']:.3f}); newest save {inc['bytes_newest_save'] / 1e6:.1f} MB, training waited "
              f"{inc['waited_s_per_save']:.3f} s per save; incremental saves per run {inc['incremental_saves']}")
    summary["probe"] = probe(4 if args.quick else 32)
    mb = 4 if args.quick else 32
    print(f"this machine, {mb} MB of rows (thread CPU ms, median of 3): " + ", ".join(
        f"{k[:-3].replace('_', ' ')} {v:.1f}" for k, v in summary["probe"].items()))
    Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
