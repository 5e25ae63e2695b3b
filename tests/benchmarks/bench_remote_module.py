"""Side-by-side benchmark: raw RPC, torch's RemoteModule and remote_module.RemoteModule.

    make bench                      # full size (about two minutes on 2 cores)
    python -m tests.benchmarks.bench_remote_module --quick

Two local processes on loopback ("caller" and "host"). Every figure is a median over blocks
of calls, with the variants interleaved block by block (in an order that rotates from block
to block) so drift and ordering effects hit them all alike, and
every ratio compares medians from this one run. The distributed-autograd section runs last
(see the note there). Beside every time or rate: the CPU seconds per call (per round trip for
the large ones) summed over both processes, every thread, metered over the same blocks
(median over blocks / calls in a block): what a call costs where each process has a core of
its own, which on 2 shared cores the wall time does not say. Prints a table and writes JSON
(bench-results.json by default; CPU figures in the ``*_cpu_s`` keys beside the times).
"""

from __future__ import annotations

import os
import statistics
from typing import Any, Callable

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

from rpc_backend import run_local
from tests.benchmarks._common import cpu_cell, cpu_per_op, parse_args, publish, repeated, rounds
from tests.benchmarks._cpu import CpuMeter, world_meter

SMALL_IN = 16


# ---- host-side functions (module level: RPC pickles them by reference) -------------------


def noop() -> None:
    return None


def rref_forward(rref: rpc.RRef, x: torch.Tensor) -> torch.Tensor:
    return rref.local_value()(x)


_held: dict[str, nn.Module] = {}


def hold_linear() -> None:
    """Make the host's ``Linear(SMALL_IN, SMALL_IN)`` for :func:`held_forward`."""
    _held["linear"] = nn.Linear(SMALL_IN, SMALL_IN)


def held_forward(x: torch.Tensor) -> torch.Tensor:
    """The small forward's work as a raw handler: a module held in a dict (no RRef), run
    without grad, its output returned: what a call costs with no proxy machinery at all."""
    with torch.no_grad():
        return _held["linear"](x)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def gc_collect() -> None:
    import gc

    gc.collect()


# ---- measuring ---------------------------------------------------------------------------


def interleaved(variants: dict[str, Callable[[], Any]], blocks: int, per_block: int, meter: CpuMeter
                ) -> tuple[dict[str, float], dict[str, float | None]]:
    """Median seconds per call of each variant, and median CPU seconds per call of the world
    (``meter``'s processes) over the same blocks; blocks alternate between variants."""
    for fn in variants.values():  # warm up every path first
        for _ in range(max(3, per_block // 4)):
            fn()

    # rounds rotates the order each block, so no variant always runs right after the same other
    samples, cpu = rounds({name: repeated(fn, per_block) for name, fn in variants.items()}, blocks, 0, meter)
    return {name: statistics.median(s) / per_block for name, s in samples.items()}, cpu_per_op(cpu, per_block)


def in_flight(variants: dict[str, Callable[[], Any]], blocks: int, depth: int, meter: CpuMeter
              ) -> tuple[dict[str, float], dict[str, float | None]]:
    """Median calls per second with ``depth`` async calls in flight, and median CPU seconds
    per call of the world (``meter``'s processes) over the same blocks."""
    for fn in variants.values():
        torch.futures.wait_all([fn() for _ in range(depth)])

    def block(fn: Callable[[], Any]) -> Callable[[], None]:
        return lambda: torch.futures.wait_all([fn() for _ in range(depth)])

    samples, cpu = rounds({name: block(fn) for name, fn in variants.items()}, blocks, 0, meter)
    return {name: statistics.median(depth / t for t in s) for name, s in samples.items()}, cpu_per_op(cpu, depth)


def caller_main(cfg: dict) -> dict:
    from torch.distributed.nn import RemoteModule as TorchRemoteModule

    from remote_module import RemoteModule

    host = "host"
    results: dict[str, Any] = {"config": cfg, "torch": torch.__version__}
    meter = world_meter()  # CPU of both processes, every thread, over the same blocks as the clock

    # small forward ------------------------------------------------------------------------
    torch.manual_seed(0)
    ours = RemoteModule(f"{host}/cpu", nn.Linear, (SMALL_IN, SMALL_IN))
    theirs = TorchRemoteModule(f"{host}/cpu", nn.Linear, (SMALL_IN, SMALL_IN))
    raw_rref = rpc.remote(host, nn.Linear, (SMALL_IN, SMALL_IN))
    rpc.rpc_sync(host, hold_linear)
    x = torch.randn(1, SMALL_IN)
    with torch.no_grad():
        small, small_cpu = interleaved(
            {
                "raw rpc_sync no-op": lambda: rpc.rpc_sync(host, noop),
                "raw RRef call": lambda: rpc.rpc_sync(host, rref_forward, (raw_rref, x)),
                "raw call of a held module": lambda: rpc.rpc_sync(host, held_forward, (x,)),
                "torch RemoteModule": lambda: theirs.forward(x),
                "remote_module": lambda: ours.forward(x),
            },
            cfg["blocks"],
            cfg["per_block"],
            meter,
        )
    results["small_forward_no_grad_s"] = small
    results["small_forward_no_grad_cpu_s"] = small_cpu

    # forward_async, 64 in flight ----------------------------------------------------------
    with torch.no_grad():
        rates, rates_cpu = in_flight(
            {
                "raw rpc_async RRef call": lambda: rpc.rpc_async(host, rref_forward, (raw_rref, x)),
                "torch RemoteModule": lambda: theirs.forward_async(x),
                "remote_module": lambda: ours.forward_async(x),
            },
            cfg["blocks"],
            64,
            meter,
        )
    results["forward_async_64_calls_per_s"] = rates
    results["forward_async_64_cpu_s"] = rates_cpu  # per call

    # large round trips --------------------------------------------------------------------
    ours_id = RemoteModule(f"{host}/cpu", nn.Identity)
    theirs_id = TorchRemoteModule(f"{host}/cpu", nn.Identity)
    large: dict[str, dict[str, float]] = {}
    large_cpu: dict[str, dict[str, float | None]] = {}
    for label, nbytes in (("1MB", 1 << 20), ("64MB", 64 << 20)):
        t = torch.randn(nbytes // 4)
        blocks = cfg["blocks"] if nbytes <= (1 << 20) else cfg["large_blocks"]
        per_block = cfg["per_block"] // 4 if nbytes <= (1 << 20) else 1
        with torch.no_grad():
            secs, large_cpu[label] = interleaved(
                {
                    "in-process copy": lambda: t.clone(),
                    "torch RemoteModule": lambda: theirs_id.forward(t),
                    "remote_module": lambda: ours_id.forward(t),
                },
                blocks,
                per_block,
                meter,
            )
        large[label] = {name: nbytes / s / 1e9 for name, s in secs.items()}  # GB/s of payload
    results["round_trip_GB_per_s"] = large
    results["round_trip_cpu_s"] = large_cpu  # per round trip

    # memory over many calls ---------------------------------------------------------------
    calls = cfg["memory_calls"]
    with torch.no_grad():
        for _ in range(cfg["memory_warmup"]):
            ours.forward(x)
        import gc

        gc.collect()
        rpc.rpc_sync(host, gc_collect)
        caller_before, host_before = rss_bytes(), rpc.rpc_sync(host, rss_bytes)
        for _ in range(calls):
            ours.forward(x)
        gc.collect()
        rpc.rpc_sync(host, gc_collect)
        caller_after, host_after = rss_bytes(), rpc.rpc_sync(host, rss_bytes)
    results["memory"] = {
        "calls": calls,
        "caller_growth_MB": (caller_after - caller_before) / 2**20,
        "host_growth_MB": (host_after - host_before) / 2**20,
    }
    # small forward under distributed autograd: last, because once a process has used
    # distributed autograd, torch RPC calls between these processes cost more CPU for every
    # variant (measured here: host CPU per async call ~115 -> ~340 µs), which would blur the
    # figures above.
    xg = torch.randn(1, SMALL_IN, requires_grad=True)

    def under_context(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with dist_autograd.context():
                return fn()

        return run

    autograd, autograd_cpu = interleaved(
        {
            "torch RemoteModule": under_context(lambda: theirs.forward(xg)),
            "remote_module": under_context(lambda: ours.forward(xg)),
        },
        cfg["blocks"],
        cfg["per_block"],
        meter,
    )
    results["small_forward_dist_autograd_s"] = autograd
    results["small_forward_dist_autograd_cpu_s"] = autograd_cpu

    return results


def rank_main(cfg: dict) -> dict | None:
    if rpc.get_worker_info().name == "caller":
        return caller_main(cfg)
    # torch's RemoteModule generates its host-side module lazily; import it up front so its
    # first call cannot race the import (a torch issue this benchmark is not about).
    import torch.distributed.nn.api.remote_module  # noqa: F401

    return None


def ratios(r: dict) -> dict[str, float]:
    small, ag, rates, large = (
        r["small_forward_no_grad_s"],
        r["small_forward_dist_autograd_s"],
        r["forward_async_64_calls_per_s"],
        r["round_trip_GB_per_s"],
    )
    return {
        "small no_grad: project / torch (target <= 0.70)": small["remote_module"] / small["torch RemoteModule"],
        "small no_grad: project / raw no-op (target <= 1.5)": small["remote_module"] / small["raw rpc_sync no-op"],
        "small no_grad: project / raw call of a held module": (
            small["remote_module"] / small["raw call of a held module"]
        ),
        "small no_grad: raw call of a held module / torch": (
            small["raw call of a held module"] / small["torch RemoteModule"]
        ),
        "async 64 in flight: project / torch calls/s (target >= 4)": (
            rates["remote_module"] / rates["torch RemoteModule"]
        ),
        "dist autograd: project / torch (target <= 1.05)": ag["remote_module"] / ag["torch RemoteModule"],
        "64MB bandwidth: project / torch (target >= 0.95)": (
            large["64MB"]["remote_module"] / large["64MB"]["torch RemoteModule"]
        ),
        "64MB bandwidth: project / in-process copy": large["64MB"]["remote_module"] / large["64MB"]["in-process copy"],
        "1MB bandwidth: project / torch": large["1MB"]["remote_module"] / large["1MB"]["torch RemoteModule"],
    }


def report(r: dict) -> str:
    lines = ["", "median per call; cpu: CPU seconds summed over both processes (every thread)", "-" * 60,
             f"{'time per call (µs)':<30}{'µs':>8}{'cpu µs':>10}"]
    for section, key in (("small forward, no_grad", "small_forward_no_grad"),
                         ("small forward, dist autograd", "small_forward_dist_autograd")):
        lines.append(section)
        cpu = r[f"{key}_cpu_s"]
        for name, s in r[f"{key}_s"].items():
            lines.append(f"  {name:<28}{s * 1e6:>8.1f}{cpu_cell(cpu[name], 1e6, 10)}")
    lines.append(f"{'forward_async, 64 in flight':<30}{'calls/s':>8}{'cpu µs':>10}")
    for name, v in r["forward_async_64_calls_per_s"].items():
        lines.append(f"  {name:<28}{v:>8.0f}{cpu_cell(r['forward_async_64_cpu_s'][name], 1e6, 10)}")
    for size, row in r["round_trip_GB_per_s"].items():
        lines.append(f"{size + ' round trip, nn.Identity':<30}{'GB/s':>8}{'cpu ms':>10}  (GB/s of payload)")
        for name, v in row.items():
            lines.append(f"  {name:<28}{v:>8.2f}{cpu_cell(r['round_trip_cpu_s'][size][name], 1e3, 10, 2)}")
    m = r["memory"]
    lines.append(f"memory after {m['calls']} calls: caller +{m['caller_growth_MB']:.1f} MB, "
                 f"host +{m['host_growth_MB']:.1f} MB")
    lines.append("")
    lines.append("ratios of medians (same run)")
    lines.append("-" * 60)
    for name, v in r["ratios"].items():
        lines.append(f"  {name:<62}{v:>7.2f}{_verdict(name, v)}")
    grown = max(m["caller_growth_MB"], m["host_growth_MB"])
    lines.append(f"  {'memory growth, worst side (MB, target < 20)':<62}{grown:>7.1f}"
                 f"{'  met' if grown < 20 else '  NOT MET'}")
    return "\n".join(lines)


def _verdict(name: str, value: float) -> str:
    """'  met' / '  NOT MET' for a ratio whose name carries its target, else nothing."""
    if "(target <= " in name:
        return "  met" if value <= float(name.split("(target <= ")[1].rstrip(")")) else "  NOT MET"
    if "(target >= " in name:
        return "  met" if value >= float(name.split("(target >= ")[1].rstrip(")")) else "  NOT MET"
    return ""


def main(argv: list[str] | None = None) -> dict:
    args = parse_args("remote_module benchmark", "bench-results.json", argv)
    cfg = (
        # quick: only that every figure is produced (the smoke test), at the least cost
        {"blocks": 3, "per_block": 20, "large_blocks": 1, "memory_warmup": 200, "memory_calls": 500}
        if args.quick
        else {"blocks": 31, "per_block": 100, "large_blocks": 9, "memory_warmup": 1000, "memory_calls": 100_000}
    )
    cfg["transport"] = args.transport
    results = run_local(rank_main, 2, names=["caller", "host"], args=(cfg,), transport=cfg["transport"],
                        timeout=1800)[0]
    results["ratios"] = ratios(results)
    return publish(results, report(results), args.json)


if __name__ == "__main__":
    main()
