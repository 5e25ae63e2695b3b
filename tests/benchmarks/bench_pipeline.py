"""Pipeline benchmark: RemotePipeline vs the RPC tutorial's pattern and torch's pipelining.

    make bench                                   # runs this after bench_remote_module
    python -m tests.benchmarks.bench_pipeline    # full size (about 2 minutes on 2 cores)
    python -m tests.benchmarks.bench_pipeline --quick

A compute-bound 2-stage model: each stage is 8 x (Linear(1024, 1024) + ReLU), batch 1024
(a stage's forward takes about 110-130 ms on one core here; the issue's "8 x Linear" is
per stage: 4 per stage would be about 55 ms). Three local processes on loopback: "caller0"
drives, "stage0" and "stage1" hold the stages. Every process starts with OMP_NUM_THREADS=1
in its environment before torch is imported (torch.set_num_threads(1) in the main thread
would not limit the BLAS threads of RPC handler threads), so each stage host computes on one
core, as on a machine with one core per stage.

Compared, at chunks 1, 4 and 8:

* forward, no grad: remote_module.pipeline.RemotePipeline vs the pattern of PyTorch's RPC
  pipeline tutorial written by hand (tests/benchmarks/_pipeline_hosts.py), and, as the floor
  for chunks=1, the two stages' forwards run one after the other on inputs already on their
  hosts (compute alone, no activation moves);
* forward + backward per step: RemotePipeline in a dist_autograd.context() (backward of
  out.sum()) vs torch.distributed.pipelining's ScheduleGPipe on the two stage hosts (gloo,
  sum loss per micro-batch, gradients not scaled), each step started over RPC on both hosts.

Every figure is the median over rounds of one step per variant, the variants interleaved in
an order that rotates from round to round; every ratio compares medians of this one run
(throughput ratios: the other's time per step over ours). The forward+backward section runs
last: once a process has used distributed autograd, its RPC calls cost more CPU. Beside each
time: the CPU seconds per step summed over the three processes (every thread), metered over
the same rounds (median over rounds): what a step costs where each process has a core of its
own. Prints a table with the issue's targets and writes JSON (bench-pipeline-results.json by
default; CPU figures in ``fwd_no_grad_cpu_s`` and ``fwd_bwd_cpu_s``, per round in the
``*_cpu_samples_s`` keys).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from rpc_backend import current_worker, init_role_process_group
from tests.benchmarks import _pipeline_hosts as hosts
from tests.benchmarks._common import cpu_cell, cpu_per_op, publish, rounds, run_world
from tests.benchmarks._cpu import world_meter
from tests.benchmarks.bench_remote_module import _verdict

STAGE_WORKERS = ["stage0", "stage1"]
BUSY = 0.15  # compute alone this much slower in the median round than in the fastest: a busy machine
FULL = {"width": 1024, "layers_per_stage": 8, "batch": 1024, "chunks": [1, 4, 8],
        "fwd_rounds": 21, "fwd_bwd_rounds": 9, "warmup": 1, "seed": 0}
QUICK = {"width": 128, "layers_per_stage": 2, "batch": 64, "chunks": [1, 4, 8],
         "fwd_rounds": 3, "fwd_bwd_rounds": 2, "warmup": 1, "seed": 0}


def _check_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        raise AssertionError(
            f"{name}: output differs from the local model by up to {(got - want).abs().max().item():.3g}"
            " (expected within 1e-4); the figures would compare different computations"
        )


def caller_main(cfg: dict) -> dict:
    from remote_module.pipeline import RemotePipeline, split_sequential

    results: dict[str, Any] = {"config": cfg, "torch": torch.__version__}
    results["threads_in_rpc_handlers"] = {w: rpc.rpc_sync(w, hosts.handler_threads) for w in STAGE_WORKERS}
    meter = world_meter()  # CPU of all three processes, every thread, over the same rounds as the clock
    chunk_list = cfg["chunks"]
    model = hosts.build_model(cfg)
    x = hosts.batch(cfg)
    with torch.no_grad():
        want = model(x)

    per_stage = 2 * cfg["layers_per_stage"]
    base = split_sequential(model, [f"{w}/cpu" for w in STAGE_WORKERS], balance=[per_stage, per_stage])
    ours = {c: RemotePipeline(list(base.stages), chunks=c) for c in chunk_list}  # same stages
    shards = [rpc.remote(w, hosts.TutorialShard, (cfg, i)) for i, w in enumerate(STAGE_WORKERS)]
    with torch.no_grad():
        for c in chunk_list:
            _check_close(f"RemotePipeline chunks={c}", ours[c](x), want)
            _check_close(f"tutorial pattern chunks={c}", hosts.tutorial_pipeline(shards, x, c), want)

    # forward, no grad ------------------------------------------------------------------------
    def ours_fwd(c: int) -> Callable[[], Any]:
        def step() -> Any:
            with torch.no_grad():
                return ours[c](x)
        return step

    def tutorial_fwd(c: int) -> Callable[[], Any]:
        return lambda: hosts.tutorial_pipeline(shards, x, c)

    def alone() -> None:  # the floor for chunks=1: both stages' compute, one after the other
        for shard in shards:
            rpc.rpc_sync(shard.owner(), hosts.compute_alone, (shard,))

    variants: dict[str, Callable[[], Any]] = {"stage 0 + stage 1 compute alone": alone}
    for c in chunk_list:
        variants[f"RemotePipeline chunks={c}"] = ours_fwd(c)
        variants[f"tutorial pattern chunks={c}"] = tutorial_fwd(c)
    samples, cpu = rounds(variants, cfg["fwd_rounds"], cfg["warmup"], meter)
    results["fwd_no_grad_samples_s"] = samples
    results["fwd_no_grad_s"] = {name: statistics.median(s) for name, s in samples.items()}
    results["fwd_no_grad_cpu_samples_s"] = cpu
    results["fwd_no_grad_cpu_s"] = cpu_per_op(cpu)  # per step (one step a round)

    # forward + backward ----------------------------------------------------------------------
    deadline = time.monotonic() + 120
    while not all(rpc.rpc_sync(w, hosts.gpipe_ready) for w in STAGE_WORKERS):
        if time.monotonic() > deadline:
            raise TimeoutError("the stage hosts did not set up torch.distributed.pipelining within 120 s")
        time.sleep(0.1)
    want_loss = float(want.sum())

    def gpipe(c: int) -> Callable[[], Any]:
        def step() -> Any:
            futures = [rpc.rpc_async(w, hosts.gpipe_step, (c,)) for w in STAGE_WORKERS]
            return torch.futures.wait_all(futures)[-1]
        return step

    def ours_fwd_bwd(c: int) -> Callable[[], Any]:
        def step() -> Any:
            with dist_autograd.context() as ctx:
                loss = ours[c](x).sum()
                dist_autograd.backward(ctx, [loss])
            return float(loss.detach())
        return step

    variants = {}
    for c in chunk_list:
        variants[f"RemotePipeline chunks={c}"] = ours_fwd_bwd(c)
        variants[f"pipelining GPipe chunks={c}"] = gpipe(c)
    for name, fn in variants.items():  # same loss as the local model (the warm-up step)
        got = fn()
        if abs(got - want_loss) > 1e-4 * max(1.0, abs(want_loss)):
            raise AssertionError(f"{name}: loss {got!r}, expected {want_loss!r} (the local model's)")
    samples, cpu = rounds(variants, cfg["fwd_bwd_rounds"], 0, meter)
    results["fwd_bwd_samples_s"] = samples
    results["fwd_bwd_s"] = {name: statistics.median(s) for name, s in samples.items()}
    results["fwd_bwd_cpu_samples_s"] = cpu
    results["fwd_bwd_cpu_s"] = cpu_per_op(cpu)
    return results


def rank_main(cfg: dict) -> dict | None:
    me = current_worker()
    if me.role == "caller":
        return caller_main(cfg)
    init_role_process_group(me)  # gloo among the two stage hosts, for torch's pipelining
    hosts.gpipe_setup(cfg, me.role_rank)
    return None


def ratios(r: dict) -> dict[str, float]:
    fwd, fb = r["fwd_no_grad_s"], r["fwd_bwd_s"]
    chunk_list = r["config"]["chunks"]
    more = [c for c in chunk_list if c > 1]

    def speedup(table: dict, prefix: str) -> float:
        return table[f"{prefix} chunks=1"] / min(table[f"{prefix} chunks={c}"] for c in more)

    best = f"best of chunks {'/'.join(map(str, more))}"
    out = {
        f"RemotePipeline fwd no_grad: {best} / chunks 1 (target >= 1.3)": speedup(fwd, "RemotePipeline"),
        f"tutorial pattern fwd no_grad: {best} / chunks 1": speedup(fwd, "tutorial pattern"),
    }
    for c in chunk_list:
        out[f"fwd no_grad chunks={c}: RemotePipeline / tutorial pattern (target >= 1.05)"] = (
            fwd[f"tutorial pattern chunks={c}"] / fwd[f"RemotePipeline chunks={c}"]
        )
    for c in chunk_list:
        out[f"fwd+bwd chunks={c}: RemotePipeline / pipelining GPipe (target >= 1.0)"] = (
            fb[f"pipelining GPipe chunks={c}"] / fb[f"RemotePipeline chunks={c}"]
        )
    out["fwd no_grad chunks=1: compute share (stage 0 + stage 1 compute alone / RemotePipeline)"] = (
        fwd["stage 0 + stage 1 compute alone"] / fwd["RemotePipeline chunks=1"]
    )
    out[f"RemotePipeline fwd+bwd: {best} / chunks 1"] = speedup(fb, "RemotePipeline")
    out[f"pipelining GPipe fwd+bwd: {best} / chunks 1"] = speedup(fb, "pipelining GPipe")
    return out


def report(r: dict) -> str:
    cfg = r["config"]
    lines = [
        "",
        f"2 stages x {cfg['layers_per_stage']} x (Linear({cfg['width']}, {cfg['width']}) + ReLU), "
        f"batch {cfg['batch']}; threads in the hosts' RPC handlers: {r['threads_in_rpc_handlers']}",
        "cpu: CPU seconds per step summed over the 3 processes (every thread)",
        f"{'median per step':<40}{'ms':>9}{'samples/s':>11}{'min ms':>9}{'max ms':>9}{'cpu ms':>9}",
        "-" * 87,
    ]
    for title, key in (("forward, no grad", "fwd_no_grad"), ("forward + backward", "fwd_bwd")):
        lines.append(title)
        for name, s in r[f"{key}_s"].items():
            all_s = r[f"{key}_samples_s"][name]
            lines.append(f"  {name:<38}{s * 1e3:>9.1f}{cfg['batch'] / s:>11.0f}"
                         f"{min(all_s) * 1e3:>9.1f}{max(all_s) * 1e3:>9.1f}{cpu_cell(r[f'{key}_cpu_s'][name], 1e3, 9)}")
    busy = r["compute_alone_median_over_fastest"] - 1
    if busy > BUSY:
        lines.append(
            f"NOTE: the machine was busy: the stages' compute alone took {busy:.0%} longer in the median "
            "round than in the fastest; the stages could not get a core each, so the ratios below "
            "understate pipelining. Rerun when the machine is quieter."
        )
    lines += ["", "throughput ratios of medians (same run)", "-" * 78]
    width = max(map(len, r["ratios"]))
    for name, v in r["ratios"].items():
        lines.append(f"  {name:<{width}}{v:>6.2f}{_verdict(name, v)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    results, path = run_world(argv, "remote_module pipeline benchmark", "bench-pipeline-results.json", QUICK, FULL,
                              rank_main, {"caller": 1, "stage": 2})
    results["ratios"] = ratios(results)
    alone = results["fwd_no_grad_samples_s"]["stage 0 + stage 1 compute alone"]
    results["compute_alone_median_over_fastest"] = statistics.median(alone) / min(alone)  # > 1.15: busy
    return publish(results, report(results), path)


if __name__ == "__main__":
    main()
