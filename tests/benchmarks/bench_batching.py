"""Host-side batching benchmark (issue 46): calls/s of many callers' batch-1 inference calls to
one hosted MLP, with ``batching=BatchPolicy(...)`` against one forward per call, in one run.

    python -m tests.benchmarks.bench_batching            # MLP 1024-4096-1024, 8 callers
    python -m tests.benchmarks.bench_batching --quick    # a small MLP, 3 callers, not graded

A local world on loopback: "server0" hosts two copies of the same MLP (float32, ``eval()``),
one made with ``batching=BatchPolicy(max_batch=64, max_wait_ms=2)`` and one without; every
process runs with one OpenMP thread. Each of ``callers`` caller processes makes
``calls_per_caller`` batch-1 calls under ``no_grad``, one after another, with the proxy it was
sent; all callers at once. Rounds alternate the two modules (``rounds`` each, the order
rotating). Figures per variant: calls/s (all callers' calls over the round's wall time; the
median over rounds), each call's latency (p50 and p99 over every call of every round), and
from the host: the forwards' batch sizes and seconds, so that a call's time splits into the
forward's share and the rest (RPC, queueing, pickling); the CPU per call of the callers
together and of the server (every thread, from ``/proc``). A third variant is the floor: the
same calls to a module that does nothing but return a tensor of the output's size (what RPC
alone costs per call; batching cannot beat it). Ratios: batching's calls/s over one forward
per call, same run (target >= 3), and the floor's.

Checked (the run raises otherwise): both modules' outputs for the same inputs equal a local
copy's within ``atol`` (they are one module's state: the second is loaded from the first).
Writes JSON (bench-batching-results.json by default).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed.rpc as rpc

from remote_module import BatchPolicy, RemoteModule
from rpc_backend import current_worker
from tests.benchmarks import _serving_hosts as hosts
from tests.benchmarks._common import publish, run_world
from tests.benchmarks._cpu import CpuMeter
from tests.benchmarks.bench_remote_module import _verdict

PLAIN, BATCHED = "one forward per call", "batching"
FLOOR = "floor: an empty call, one each"
FULL = {"d_in": 1024, "hidden": 4096, "d_out": 1024, "callers": 8, "calls_per_caller": 200, "rounds": 3,
        "max_batch": 64, "max_wait_ms": 2.0, "atol": 1e-5}
QUICK = {**FULL, "d_in": 32, "hidden": 64, "d_out": 16, "callers": 3, "calls_per_caller": 20, "rounds": 2}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def driver_main(cfg: dict) -> dict:
    callers = current_worker().workers("caller")
    shape = (cfg["d_in"], cfg["hidden"], cfg["d_out"])
    proxies = {  # (other seeds: equal only once loaded)
        PLAIN: RemoteModule("server0/cpu", hosts.TimedMLP, (*shape, 1)).eval(),
        BATCHED: RemoteModule("server0/cpu", hosts.TimedMLP, (*shape, 2),
                              batching=BatchPolicy(max_batch=cfg["max_batch"], max_wait_ms=cfg["max_wait_ms"])).eval(),
    }
    proxies[BATCHED].load_state_dict(proxies[PLAIN].state_dict())
    # the floor: calls of the same sizes each way to a module that does nothing (what RPC alone costs)
    proxies[FLOOR] = RemoteModule("server0/cpu", hosts.Sized, (cfg["d_out"],)).eval()
    local = hosts.TimedMLP(*shape, 3).eval()
    local.load_state_dict(proxies[PLAIN].state_dict())
    x = torch.randn(5, cfg["d_in"])
    with torch.no_grad():
        want = local(x)
        diffs = {n: float((p(x) - want).abs().max()) for n, p in proxies.items() if n != FLOOR}
    for name, diff in diffs.items():
        if not diff <= cfg["atol"]:
            raise AssertionError(f"{name}: output differs from the local MLP by {diff:.3g}")
    rpc.rpc_sync("server0", hosts.forwards)
    for name, proxy in proxies.items():  # warm-up: every caller once
        torch.futures.wait_all([rpc.rpc_async(c, hosts.calls, (proxy, 5, cfg["d_in"], 0)) for c in callers])
    rpc.rpc_sync("server0", hosts.forwards)
    rates = {n: [] for n in proxies}
    latencies = {n: [] for n in proxies}
    fwd = {n: [] for n in proxies}
    cpu = {n: {"callers": [], "server": []} for n in proxies}  # CPU seconds per call, each side, per round
    meter = CpuMeter([rpc.rpc_sync(c, os.getpid) for c in callers] + [rpc.rpc_sync("server0", os.getpid)])
    order = list(proxies)
    total = len(callers) * cfg["calls_per_caller"]
    for r in range(cfg["rounds"]):
        for name in order[r % len(order):] + order[:r % len(order)]:
            meter.start()
            start = time.perf_counter()
            futs = [rpc.rpc_async(c, hosts.calls, (proxies[name], cfg["calls_per_caller"], cfg["d_in"], 100 * r + i),
                                  timeout=0) for i, c in enumerate(callers)]
            got = torch.futures.wait_all(futs)
            wall = time.perf_counter() - start
            each = meter.stop_each()
            rates[name].append(total / wall)
            if all(v is not None for v in each):
                cpu[name]["callers"].append(sum(each[:-1]) / total)
                cpu[name]["server"].append(each[-1] / total)
            for lat in got:
                latencies[name].extend(lat)
            fwd[name].extend(f for f in rpc.rpc_sync("server0", hosts.forwards) if name != FLOOR)
    out = {"config": cfg, "torch": torch.__version__, "max_abs_diff_vs_local": diffs, "calls_per_s_samples": rates}
    out["calls_per_s"] = {n: statistics.median(v) for n, v in rates.items()}
    out["latency_ms"] = {n: {"p50": 1e3 * _percentile(v, 0.5), "p99": 1e3 * _percentile(v, 0.99)}
                         for n, v in latencies.items()}
    calls_total = {n: len(v) for n, v in latencies.items()}
    out["host"] = {
        n: {"forwards": len(f), "mean_batch": sum(b for b, _ in f) / len(f),
            "forward_ms_median": 1e3 * statistics.median(s for _, s in f),
            "forward_ms_per_call": 1e3 * sum(s for _, s in f) / calls_total[n],
            "call_ms_mean": 1e3 * statistics.fmean(latencies[n])}
        for n, f in fwd.items() if f}
    out["cpu_ms_per_call"] = {n: {side: 1e3 * statistics.median(v) if v else None for side, v in c.items()}
                              for n, c in cpu.items()}
    out["cores"] = len(os.sched_getaffinity(0))
    return out


def rank_main(cfg: dict) -> dict | None:
    if current_worker().name != "caller0":
        return None
    return driver_main(cfg)


def ratios(r: dict) -> dict[str, float]:
    c = r["calls_per_s"]
    return {"calls/s: batching / one forward per call (target >= 3)": c[BATCHED] / c[PLAIN],
            "calls/s: the floor (empty calls) / one forward per call": c[FLOOR] / c[PLAIN]}


def report(r: dict) -> str:
    cfg = r["config"]
    lines = [f"MLP {cfg['d_in']}-{cfg['hidden']}-{cfg['d_out']} float32 on server0; {cfg['callers']} callers x "
             f"{cfg['calls_per_caller']} batch-1 calls, {cfg['rounds']} rounds per variant; "
             f"BatchPolicy(max_batch={cfg['max_batch']}, max_wait_ms={cfg['max_wait_ms']})",
             f"{'':32}{'calls/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'forwards':>10}{'mean batch':>11}"
             f"{'fwd ms':>8}{'fwd ms/call':>12}{'cpu ms':>9}{'cpu ms':>9}",
             f"{'':91}{'callers':>9}{'server':>9}"]
    for n in (PLAIN, BATCHED, FLOOR):
        lat = r["latency_ms"][n]
        row = f"{n:32}{r['calls_per_s'][n]:10.1f}{lat['p50']:9.2f}{lat['p99']:9.2f}"
        h = r["host"].get(n)
        if h is not None:
            row += (f"{h['forwards']:10d}{h['mean_batch']:11.2f}{h['forward_ms_median']:8.2f}"
                    f"{h['forward_ms_per_call']:12.2f}")
        else:
            row += f"{'':41}"
        c = r["cpu_ms_per_call"][n]
        row += "".join(f"{v:9.2f}" if v is not None else f"{'-':>9}" for v in (c["callers"], c["server"]))
        lines.append(row)
    lines.append("(fwd ms: a forward's median on the host; fwd ms/call: forward seconds per call; cpu ms: CPU per "
                 "call of all callers together and of the server, every thread)")
    lines.append(f"this machine: {r['cores']} cores for {cfg['callers'] + 1} processes; the floor is what RPC "
                 "alone allows here, and bounds what batching can reach")
    lines.append("")
    for k, v in r["ratios"].items():
        lines.append(f"  {k:70}{v:8.2f}{_verdict(k, v)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    callers = (QUICK if "--quick" in (sys.argv[1:] if argv is None else argv) else FULL)["callers"]
    results, path = run_world(argv, "remote_module host-side batching benchmark", "bench-batching-results.json",
                              QUICK, FULL, rank_main, {"server": 1, "caller": callers})
    results["ratios"] = ratios(results)
    return publish(results, report(results), path)


if __name__ == "__main__":
    main()
