"""Each side of a training step in CPU (issue 45): the trainer's and the server's CPU per step,
each beside the anchor's same process, with trainer and server pinned to a core each.

    python -m tests.benchmarks.bench_step_cpu            # 5 runs of 2,000 steps per variant (about 4 minutes)
    python -m tests.benchmarks.bench_step_cpu --quick    # 2 runs of 40 steps, not graded

The embedding benchmark's table and batches (``bench_embedding``: 1,000,000 x 16 rows, 256 bags
x 8 uniform ids, SGD lr 0.1, async), on one server. "trainer0" is pinned to one core and "ps0"
to another (``sched_setaffinity`` of every thread of each process; threads made later inherit
it). Variants: the anchor (``RemoteModule(nn.EmbeddingBag(sparse=True))``, distributed
autograd, ``DistributedOptimizer``), ``ShardedEmbeddingBag`` with ``prefetching()`` and with
``prefetching(overlap=True)``, and the floor of the trainer's side: a step that only sends the
bytes a prefetched step sends to the server and gets back the bytes it gets (one call with a
tensor of each size, counted with ``rpc_backend.Traffic`` on the prefetched step), and two
bounds of what the step's work itself costs (``_lean_step``): the least prefetched step written
plainly, with nothing but the work (the ids checked, one autograd node, one call per step
carrying the push and the next lookup), in the library's form (the trainer deduplicates the ids
and pushes the unique rows' gradients) and in the other (it pushes the bags' gradient and the
server computes the rows'), and the bags' form with what the library promises of every step
beyond the work, each done the least way (``_lean_step.Contract``: the arguments copied and
compared, a deadline per message, the push carrying its ids, step and token, answers as ``(ok,
value)``, the gradient held until its push lands, the marker's hook, the optimizer's settings
read and its step called). Each run
runs every variant for ``steps`` steps, in an order that rotates by run; CPU is user + system
time of each whole process (every thread; its CPU clock, as ``/proc/<pid>/stat``'s utime +
stime counts it) over those steps. Figures are medians over runs; a ratio is the median over
runs of the variant's figure over the anchor's in the same run. Beside them, this machine's own
probes, on the pinned trainer: ``torch.sort`` and ``torch.unique`` of 2,048 int64 ids and an
empty RPC round trip.

Checks (the run raises if one fails): every variant starts from the same rows and equals a
local ``nn.EmbeddingBag(sparse=True)`` + SGD after ``check_steps`` steps (``bench_embedding``'s
set-up; the bounds start from the anchor's rows there), and after the runs the tables of the
prefetched variant (not overlap's, whose lookups each miss one push) and of the bounds equal
the anchor's within ``end_atol``.
Writes JSON (bench-step-cpu-results.json by default).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed.rpc as rpc

from rpc_backend import current_worker
from tests.benchmarks import _embedding_hosts as hosts
from tests.benchmarks import _lean_step as lean
from tests.benchmarks._common import publish, rounds, run_world, traffic_per_call
from tests.benchmarks._cpu import CpuMeter
from tests.benchmarks.bench_embedding import ANCHOR, setup, sharded_name
from tests.benchmarks.bench_remote_module import _verdict

SERVER = "ps0"
PREFETCH, OVERLAP = sharded_name(1, True), sharded_name(1, "overlap")
FLOOR = "floor: the prefetched step's bytes each way, nothing else"
LEAN_TRAINER = "bound: the least step, the trainer's rows' gradients pushed"
LEAN_SERVER = "bound: the least step, the bags' gradient pushed"
CONTRACT = "bound: the least step, bags' form, with the library's promises"
FULL = {"rows": 1_000_000, "dim": 16, "bags": 256, "ids_per_bag": 8, "lr": 0.1, "seed": 0, "num_batches": 32,
        "steps": 2000, "runs": 5, "warmup_steps": 50, "check_steps": 3, "check_atol": 1e-6, "end_atol": 1e-5,
        "server_counts": [1]}
QUICK = {**FULL, "rows": 100_000, "steps": 40, "runs": 2, "warmup_steps": 5}


def pin(core: int) -> list[int]:
    """Pin every thread of this process to ``core`` (threads made later inherit it); the
    cores the calling thread may run on now."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:  # (a thread that ended meanwhile)
            pass
    return sorted(os.sched_getaffinity(0))


def _floor_step(to_bytes: int, from_bytes: int) -> Callable[[], None]:
    payload = torch.zeros(to_bytes, dtype=torch.uint8)

    def step() -> None:
        rpc.rpc_sync(SERVER, _answer, args=(payload, from_bytes))
    return step


def _answer(payload: torch.Tensor, n: int) -> torch.Tensor:
    """(On the server) the floor's call: ``payload`` in, ``n`` bytes out."""
    return torch.empty(n, dtype=torch.uint8)


def probes(reps: int = 300) -> dict[str, float]:
    """This machine's own cost (median, microseconds, on the calling thread's core) of
    ``torch.sort`` and ``torch.unique`` of 2,048 int64 ids and of an empty RPC round trip."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1_000_000, (2048,), generator=gen)

    def timed(fn: Callable[[], Any]) -> float:
        fn()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return statistics.median(out) * 1e6

    empty = torch.empty(0)
    return {"sort_2048_int64_us": timed(lambda: torch.sort(ids)),
            "unique_2048_int64_us": timed(lambda: torch.unique(ids, return_inverse=True)),
            "empty_rpc_round_trip_us": timed(lambda: rpc.rpc_sync(SERVER, hosts.echo, args=(empty,)))}


def trainer_main(cfg: dict) -> dict:
    me = os.getpid()
    server_pid = rpc.rpc_sync(SERVER, os.getpid)
    cores = sorted(os.sched_getaffinity(0))  # (a machine with one core: both on it, as the report says)
    pinned = {"trainer0": pin(cores[0]), SERVER: rpc.rpc_sync(SERVER, pin, args=(cores[1 % len(cores)],))}
    batches = hosts.make_batches(cfg)
    variants, facts = setup(cfg, batches)
    variants = {n: variants[n] for n in (ANCHOR, PREFETCH, OVERLAP)}
    start = variants[ANCHOR].weight()  # (every variant has trained check_steps steps: the bounds start there)
    variants[LEAN_TRAINER] = lean.TrainerRows("bench-step-cpu-trainer-rows", SERVER, start, cfg["lr"])
    variants[LEAN_SERVER] = lean.ServerRows("bench-step-cpu-server-rows", SERVER, start, cfg["lr"])
    variants[CONTRACT] = lean.Contract("bench-step-cpu-contract", SERVER, start, cfg["lr"])
    at = dict.fromkeys(variants, cfg["check_steps"])

    def train(name: str) -> Callable[[], None]:
        v = variants[name]

        def step() -> None:
            k = at[name]
            if name == ANCHOR:
                v.train(batches[k % len(batches)])
            else:
                v.train(batches[k % len(batches)], batches[(k + 1) % len(batches)])
            at[name] += 1
        return step

    steps = {n: train(n) for n in variants}
    for step in steps.values():  # (warm-up; the prefetched variants' first step sends its lookup alone)
        for _ in range(cfg["warmup_steps"]):
            step()
    counted = traffic_per_call(steps[PREFETCH], 4, settle=variants[PREFETCH].bag.flush)
    to_bytes = int(round(sum(counted["sent"].values())))
    from_bytes = int(round(sum(counted["received"].values())))
    for name in (ANCHOR, OVERLAP, LEAN_TRAINER, LEAN_SERVER, CONTRACT):  # (the counted steps: all as far along)
        while at[name] < at[PREFETCH]:
            steps[name]()
    steps[FLOOR] = _floor_step(to_bytes, from_bytes)
    for _ in range(cfg["warmup_steps"]):
        steps[FLOOR]()
    def run(name: str) -> Callable[[], None]:
        def steps_of_a_run() -> None:
            for _ in range(cfg["steps"]):
                steps[name]()
            if name in (PREFETCH, OVERLAP):
                variants[name].bag.flush()  # (the last step's pushes landed: their CPU is in the window)
            elif name in (LEAN_TRAINER, LEAN_SERVER, CONTRACT):
                variants[name].flush()
        return steps_of_a_run

    each: dict[str, list[list[float | None]]] = {}
    wall, _ = rounds({n: run(n) for n in steps}, cfg["runs"], 0, CpuMeter([me, server_pid]), each=each)
    samples = {n: {"wall": [w / cfg["steps"] for w in wall[n]],
                   "trainer": [c[0] / cfg["steps"] for c in each[n]],
                   "server": [c[1] / cfg["steps"] for c in each[n]]} for n in steps}
    if len(set(at.values())) != 1:
        raise AssertionError(f"the variants ran different numbers of steps: {at}")
    anchor_weight = variants[ANCHOR].weight()
    ends = {name: float((variants[name].weight() - anchor_weight).abs().max())
            for name in (PREFETCH, LEAN_TRAINER, LEAN_SERVER, CONTRACT)}  # (overlap's lookups miss a push: it differs)
    for name, diff in ends.items():
        if not diff <= cfg["end_atol"]:
            raise AssertionError(f"{name}: after identical steps its table differs from the anchor's by {diff:.3g}")
    end_diff = ends[PREFETCH]
    for name in (LEAN_TRAINER, LEAN_SERVER, CONTRACT):
        variants[name].close()
    med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    return {"config": cfg, "torch": torch.__version__, "pinned": pinned, **facts, "samples_s": samples,
            "median_s": med, "floor_bytes": {"to_server": to_bytes, "from_server": from_bytes},
            "end_max_abs_diff_vs_anchor": end_diff, "end_max_abs_diff_each": ends, "probes": probes()}


def rank_main(cfg: dict) -> dict | None:
    if current_worker().role != "trainer":
        return None
    return trainer_main(cfg)


def ratios(r: dict) -> dict[str, float]:
    """Same-run ratios: each run's ``what`` of ``name`` over the anchor's in that run (the
    variants of a run follow each other, so a slower stretch of the machine weighs on both),
    their median over runs."""
    med, samples = r["median_s"], r["samples_s"]

    def same_run(name: str, what: str, inverse: bool = False) -> float:
        pairs = zip(samples[name][what], samples[ANCHOR][what])
        return statistics.median([(a / n) if inverse else (n / a) for n, a in pairs])

    out = {}
    best = min((PREFETCH, OVERLAP), key=lambda n: med[n]["trainer"])
    out[f"trainer CPU per step: {PREFETCH} / anchor's trainer"] = same_run(PREFETCH, "trainer")
    out[f"trainer CPU per step: {OVERLAP} / anchor's trainer"] = same_run(OVERLAP, "trainer")
    out[f"trainer CPU per step: the better, {best.split()[-1]}, / anchor's trainer (target <= 0.6)"] = (
        same_run(best, "trainer"))
    out["trainer CPU per step: the floor / anchor's trainer"] = same_run(FLOOR, "trainer")
    out["trainer CPU per step: the least step, trainer's rows' gradients / anchor's trainer"] = (
        same_run(LEAN_TRAINER, "trainer"))
    out["trainer CPU per step: the least step, bags' gradient / anchor's trainer"] = same_run(LEAN_SERVER, "trainer")
    out["trainer CPU per step: the least step with the library's promises / anchor's trainer"] = (
        same_run(CONTRACT, "trainer"))
    out["server CPU per step: the least step, trainer's rows' gradients / anchor's server"] = (
        same_run(LEAN_TRAINER, "server"))
    out["server CPU per step: the least step, bags' gradient / anchor's server"] = same_run(LEAN_SERVER, "server")
    out["server CPU per step: the least step with the library's promises / anchor's server"] = (
        same_run(CONTRACT, "server"))
    out[f"server CPU per step: {PREFETCH} / anchor's server (target <= 0.6)"] = same_run(PREFETCH, "server")
    out[f"server CPU per step: {OVERLAP} / anchor's server (target <= 0.6)"] = same_run(OVERLAP, "server")
    for n in (PREFETCH, OVERLAP):
        out[f"steps/s pinned: {n} / anchor"] = same_run(n, "wall", inverse=True)
    return out


def report(r: dict) -> str:
    cfg, med = r["config"], r["median_s"]
    p = r["probes"]
    lines = ["", f"table {cfg['rows']:,} x {cfg['dim']}, {cfg['bags']} bags x {cfg['ids_per_bag']} ids, SGD, async, 1 "
             f"server; {cfg['runs']} runs of {cfg['steps']} steps per variant; pinned: {r['pinned']}",
             f"this machine: torch.sort of 2,048 int64 {p['sort_2048_int64_us']:.0f} us, torch.unique "
             f"{p['unique_2048_int64_us']:.0f} us, an empty RPC round trip {p['empty_rpc_round_trip_us']:.0f} us",
             f"the floor sends {r['floor_bytes']['to_server']:,} B and gets {r['floor_bytes']['from_server']:,} B "
             "a step (the prefetched step's payload each way)",
             f"{'median':<66}{'steps/s':>9}{'trainer CPU ms':>16}{'server CPU ms':>15}",
             "-" * 106]
    for name, m in med.items():
        lines.append(f"  {name:<64}{1 / m['wall']:>9.1f}{m['trainer'] * 1e3:>16.3f}{m['server'] * 1e3:>15.3f}")
    lines += ["", "same-run ratios, median over runs"]
    width = max(map(len, r["ratios"]))
    lines += [f"  {name:<{width}}{v:>7.3f}{_verdict(name, v)}" for name, v in r["ratios"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    results, path = run_world(argv, "remote_module step CPU benchmark (pinned)", "bench-step-cpu-results.json",
                              QUICK, FULL, rank_main, {"trainer": 1, "ps": 1})
    results["ratios"] = ratios(results)
    return publish(results, report(results), path)


if __name__ == "__main__":
    main()
