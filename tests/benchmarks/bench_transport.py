"""Transport benchmark: what TensorPipe's transports and channels cost, idle and busy.

    make bench                                    # runs this first
    python -m tests.benchmarks.bench_transport    # full size (about 2 minutes on 2 cores)
    python -m tests.benchmarks.bench_transport --quick

Four configurations of ``rpc.TensorPipeRpcBackendOptions`` (``rpc_backend.make_options``
builds the first two by name, ``transport="uv"`` / ``"shm"``):

* ``uv`` (the default): the libuv transport (TCP on loopback), tensors through the connection
  itself (the ``basic`` channel);
* ``shm``: torch's defaults (shared-memory transport, every channel), as a plain ``init_rpc``;
* ``uv+cma``: libuv, tensors on the ``cma`` channel (cross-memory attach: one copy between
  processes, where the kernel allows it), ``basic`` otherwise;
* ``uv+all``: libuv with every channel torch registered (``mpt_uv``, ``cma``, ``basic``, ...).

Each configuration runs in worlds of 4 local processes (OMP_NUM_THREADS=1; ``--quick``: 2
processes, ``uv`` and ``shm`` only), one world per configuration per repeat, the
configurations' order rotating between repeats. In each world, worker0 first makes every
pair of workers exchange a message, then measures:

* idle: CPU used by each rank over the idle window (a core is 1.0);
* small call: ``rpc_sync`` of a no-op to worker1, seconds per call;
* 64 in flight: 64 ``rpc_async`` calls to worker1 (a 16-float tensor each) awaited together;
* 64 x 1 MB in flight: 64 ``rpc_async`` calls carrying 1 MB each to worker1, awaited together;
* 64 MB: one ``rpc_sync`` carrying 64 MB to worker1 (a float answer).

Beside each time: CPU seconds per operation summed over the world's processes (every thread), which
is what the work costs where each rank has cores of its own. A last world started by
``run_local`` with its default options measures idle CPU per rank again (the issue's
acceptance figure). Figures are medians over repeats; "ratio" columns divide by ``shm`` from
the same repeat ("x shm"). Prints a table and writes JSON (bench-transport-results.json by default).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

from rpc_backend import current_worker, fresh_file_rendezvous, loopback_env, run_local
from rpc_backend._quiet import no_backend_as_process_group_warning
from rpc_backend.options import transport_kwargs
from tests.benchmarks._common import cpu_cell, median_cpu, one_thread_per_rank, parse_args, publish, repeated, rounds
from tests.benchmarks._cpu import CpuMeter, world_pids

CONFIGS: dict[str, dict[str, Any]] = {
    "uv": transport_kwargs("uv"),
    "shm": transport_kwargs("shm"),
    "uv+cma": {"_transports": ["uv"], "_channels": ["cma", "basic"]},
    "uv+all": {"_transports": ["uv"]},
}
FULL = {"ranks": 4, "configs": list(CONFIGS), "repeats": 5, "idle_s": 4.0, "small_calls": 400,
        "inflight_rounds": 40, "big_mb": 64, "big_calls": 6}
QUICK = {"ranks": 2, "configs": ["uv", "shm"], "repeats": 1, "idle_s": 1.0, "small_calls": 40,
         "inflight_rounds": 4, "big_mb": 8, "big_calls": 2}


def _noop() -> None:
    return None


def _first(t: torch.Tensor) -> float:
    return float(t[0])


def _names(n: int) -> list[str]:
    return [f"worker{r}" for r in range(n)]


def _greet_everyone(names: list[str]) -> None:
    me = rpc.get_worker_info().name
    for name in names:
        if name != me:
            rpc.rpc_sync(name, _noop)


def idle_after_traffic(names: list[str], idle_s: float) -> tuple[CpuMeter, list[float | None]]:
    """On ``names[0]``: after a message between every pair of ``names`` (so every connection
    exists), the CPU each of their processes uses over ``idle_s`` seconds of nothing, in cores;
    and the meter over those processes."""
    for name in names:
        rpc.rpc_sync(name, _greet_everyone, (names,))
    meter = CpuMeter(world_pids(names[1:]))
    time.sleep(0.5)  # let the last answers settle
    meter.start()
    time.sleep(idle_s)
    return meter, [None if c is None else c / idle_s for c in meter.stop_each()]


def measure(cfg: dict) -> dict:
    """Run on worker0: idle CPU per rank, then the call patterns (time and CPU per operation)."""
    meter, idle = idle_after_traffic(_names(cfg["ranks"]), cfg["idle_s"])
    out: dict[str, Any] = {"idle_core_per_rank": idle}

    def timed(key: str, fn: Callable[[], Any], ops: int, n: int) -> None:
        seconds, cpu = rounds({key: fn}, n, 1, meter)
        out[key] = statistics.median(seconds[key]) / ops
        out[_cpu_key(key)] = median_cpu(cpu[key], ops)

    small = cfg["small_calls"] // 4
    small_calls = repeated(lambda: rpc.rpc_sync("worker1", _noop), small)

    x = torch.ones(16)

    def inflight() -> None:
        torch.futures.wait_all([rpc.rpc_async("worker1", torch.add, (x, 1)) for _ in range(64)])

    mid = torch.ones((1 << 20) // 4)

    def inflight_mb() -> None:
        torch.futures.wait_all([rpc.rpc_async("worker1", _first, (mid,)) for _ in range(64)])

    big = torch.ones(cfg["big_mb"] * (1 << 20) // 4)

    def big_call() -> None:
        rpc.rpc_sync("worker1", _first, (big,))

    timed("small_call_s", small_calls, small, 4)
    timed("inflight64_s", inflight, 1, cfg["inflight_rounds"])
    timed("inflight64_1mb_s", inflight_mb, 1, cfg["big_calls"])
    timed("big_s", big_call, 1, cfg["big_calls"])
    return out


def _rank(rank: int, config: dict, init_method: str, cfg: dict, answers: Any) -> None:
    os.environ.update(loopback_env())
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=120, num_worker_threads=16,
                                              **config)
    with no_backend_as_process_group_warning():
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=cfg["ranks"], rpc_backend_options=options)
    if rank == 0:
        answers.put(measure(cfg))
    rpc.shutdown()


def one_world(config: dict, cfg: dict) -> dict:
    init_method, path = fresh_file_rendezvous()
    answers = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_rank, (config, init_method, cfg, answers), nprocs=cfg["ranks"])
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return answers.get()


def idle_under_run_local(cfg: dict) -> list[float | None]:
    """Per-rank idle CPU of a ``run_local`` world with its default options."""
    return run_local(_run_local_idle, cfg["ranks"], args=(cfg["idle_s"],))[0]


def _run_local_idle(idle_s: float) -> list[float | None] | None:
    if rpc.get_worker_info().id != 0:
        return None
    return idle_after_traffic(list(current_worker().names), idle_s)[1]


METRICS = [("small_call_s", "small call"), ("inflight64_s", "64 in flight"),
           ("inflight64_1mb_s", "64 x 1 MB"), ("big_s", "64 MB")]


def _cpu_key(key: str) -> str:
    """The JSON key of a metric's CPU seconds per operation: ``big_s`` -> ``big_cpu_s``."""
    return key.removesuffix("_s") + "_cpu_s"


def summarise(runs: dict[str, list[dict]]) -> dict:
    summary: dict[str, Any] = {}
    for name, worlds in runs.items():
        row: dict[str, Any] = {"idle_core_per_rank_max": statistics.median(
            max(v for v in w["idle_core_per_rank"] if v is not None) for w in worlds)}
        for key, _ in METRICS:
            row[key] = statistics.median(w[key] for w in worlds)
            cpu = [w[_cpu_key(key)] for w in worlds]
            row[_cpu_key(key)] = statistics.median(cpu) if None not in cpu else None
            row[key + "_ratio_to_shm"] = statistics.median(
                w[key] / s[key] for w, s in zip(worlds, runs["shm"]))
        summary[name] = row
    return summary


def report(results: dict) -> str:
    cfg = results["config"]
    lines = [f"TensorPipe transports, {cfg['ranks']} local processes, medians over {cfg['repeats']} worlds each "
             f"(torch {results['torch']}); CPU = summed over the processes, per operation",
             "", f"{'config':10} {'idle core/rank':>14} " + " ".join(
                 f"{label + ' us':>16} {'cpu us':>9} {'x shm':>6}" for _, label in METRICS)]
    for name, row in results["summary"].items():
        cells = [f"{name:10} {row['idle_core_per_rank_max']:14.3f}"]
        for key, _ in METRICS:
            cells.append(f"{row[key] * 1e6:16.0f} {cpu_cell(row[_cpu_key(key)], 1e6, 9, 0)} "
                         f"{row[key + '_ratio_to_shm']:6.2f}")
        lines.append(" ".join(cells))
    idle = results["run_local_default_idle_core_per_rank"]
    worst = max(v for v in idle if v is not None)
    lines += ["", f"run_local, default options, idle {cfg['idle_s']} s after traffic between every pair: "
              f"{', '.join(f'{v:.3f}' for v in idle)} core per rank "
              f"(target <= 0.03){'  met' if worst <= 0.03 else '  NOT MET'}",
              f"(64 MB row: {cfg['big_mb']} MB per call)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__.splitlines()[0], "bench-transport-results.json", argv, transport=False)
    cfg = dict(QUICK if args.quick else FULL)
    names = cfg["configs"]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with one_thread_per_rank():
        for r in range(cfg["repeats"]):
            for name in names[r % len(names):] + names[: r % len(names)]:
                runs[name].append(one_world(CONFIGS[name], cfg))
        idle = idle_under_run_local(cfg)
    results = {"config": cfg, "torch": torch.__version__, "configs": {n: CONFIGS[n] for n in names}, "runs": runs,
               "summary": summarise(runs), "run_local_default_idle_core_per_rank": idle}
    return publish(results, report(results), args.json)


if __name__ == "__main__":
    main()
