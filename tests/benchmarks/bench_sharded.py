"""Sharded-module benchmark: LocalModule / RemoteTensor against the floors users have today.

    make bench                                  # runs this after bench_pipeline
    python -m tests.benchmarks.bench_sharded    # full size (about 2 minutes on 2 cores)
    python -m tests.benchmarks.bench_sharded --quick

Four local processes on loopback: "caller0" drives, "host0".."host2" only serve. Every
process starts with OMP_NUM_THREADS=1 in its environment before torch is imported, so each
host computes on one core (torch.set_num_threads(1) in the main thread would not limit the
BLAS threads of RPC handler threads).

1. **Small sharded forward** on N = 1, 2, 3 workers, no grad, the output dropped each
   iteration as a loop drops it (its shards are then freed by release messages that later
   calls carry or the caller's background thread sends: included). Two modules: the
   issue's, a ``LocalModule`` of ``Linear(16, 16)`` called on a caller tensor (4 x 16)
   distributed as ``Replicate()`` with the call, output ``Shard(0)``; and a tiny one
   (``x * 2``) on a RemoteTensor already distributed (``Shard(0)``, 4 x 16 floats a worker),
   whose call sends no tensor. The floor: N concurrent raw ``rpc.rpc_async`` no-ops to the
   same workers, waited for together. Also, for comparison only, the sharded forward with the
   outputs kept until the block's clock stopped (their releases sent after it): what a
   forward costs without its release messages. After every block, of every variant, the
   caller waits (clock stopped) until the hosts hold only the input shards again, so no
   variant's releases land in another's block.
2. **Megatron MLP** (``Linear(d_model, hidden) + ReLU + Linear(hidden, d_model)``, batch 256,
   d_model 1024, hidden 4096) on N = 2 and 3 workers, no grad: sharded (a column-parallel
   ``LocalModule``, input ``Replicate()`` sent with the call, output ``Shard(-1)``; a
   row-parallel ``LocalModule``, output ``Partial(sum)``; ``full_tensor()`` + the bias) vs
   the same by hand, as users write it today: per worker one ``RemoteModule`` of the column
   shard and one of the row shard, the caller gathering the hidden activations and sending
   each worker's slice back. Both variants' outputs are checked against a local model
   (atol 1e-4) in the run. Bytes through the caller per forward are **measured** by
   instrumenting the caller's ``rpc_async``/``rpc_sync``/``remote`` over a few forwards (see
   tests/benchmarks/_caller_bytes.py): tensors by their storage bytes, filed by shape (a
   tensor of shape ``(batch, k)`` with ``k != d_model`` is a hidden activation), the rest by
   its pickled length; TensorPipe's framing is not counted.

Figures are medians over blocks (small forward) or rounds (MLP), the variants interleaved
in an order that rotates every block; every ratio compares medians of this one run. Beside
each time: the CPU seconds per call (per forward) summed over the four processes (every
thread), metered over the same blocks (median over blocks / calls in a block; the waits for
releases after a block are outside both): what a call costs where each process has a core of
its own. Prints a table with the issue's targets and writes JSON (bench-sharded-results.json
by default; CPU figures in ``small_cpu_s`` and ``mlp_cpu_s``, per block in the
``*_cpu_samples_s`` keys).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from tests.benchmarks import _sharded_hosts as hosts
from tests.benchmarks._caller_bytes import CallerBytes
from tests.benchmarks._common import (
    cpu_cell,
    cpu_per_op,
    publish,
    repeated,
    rounds,
    run_world,
)
from tests.benchmarks._cpu import CpuMeter, world_meter
from tests.benchmarks.bench_remote_module import _verdict

HOSTS = ["host0", "host1", "host2"]
FULL = {"small_ns": [1, 2, 3], "blocks": 21, "per_block": 40, "mlp_ns": [2, 3], "batch": 256,
        "d_model": 1024, "hidden": 4096, "mlp_rounds": 25, "bytes_forwards": 3, "seed": 0}
# quick: the hidden slices (64 x 512 and 64 x 342 floats) stay above the 64 KiB under which
# RemoteModule writes a tensor into its pickle, so the byte count still files them as tensors
QUICK = {"small_ns": [1, 2, 3], "blocks": 3, "per_block": 5, "mlp_ns": [2, 3], "batch": 64,
         "d_model": 128, "hidden": 1024, "mlp_rounds": 3, "bytes_forwards": 2, "seed": 0}
DRAIN_S = 30.0


def held(workers: list[str]) -> list[int]:
    return [rpc.rpc_sync(w, hosts.held_count) for w in workers]


def drain(workers: list[str], want: list[int]) -> None:
    """Wait (polling, deadline) until ``workers`` hold ``want`` shards: releases have landed."""
    deadline = time.monotonic() + DRAIN_S
    while (got := held(workers)) != want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"hosts {workers} hold {got} shards {DRAIN_S:g} s on, expected {want}: a leak?")
        time.sleep(0.002)


def blocks(variants: dict[str, tuple[Callable[[], Any], Callable[[], None]]], n: int, per_block: int,
           meter: CpuMeter) -> tuple[dict[str, list[float]], dict[str, list[float | None]]]:
    """Seconds per call of each variant, one sample per block of ``per_block`` calls, and the
    CPU seconds per call of the world (``meter``'s processes) over each same block; the order
    rotates every block. Each variant is ``(call, after)``: ``after`` runs once the block's
    clock and meter have stopped."""
    for call, after in variants.values():  # warm up every path
        for _ in range(max(3, per_block // 4)):
            call()
        after()

    samples, cpu = rounds({name: repeated(call, per_block) for name, (call, _) in variants.items()}, n, 0, meter,
                          after={name: after for name, (_, after) in variants.items()})
    return ({name: [t / per_block for t in s] for name, s in samples.items()},
            {name: [None if c is None else c / per_block for c in s] for name, s in cpu.items()})


# ---- 1. small sharded forward ---------------------------------------------------------------


def small_forward(cfg: dict, meter: CpuMeter) -> tuple[dict[str, list[float]], dict[str, list[float | None]]]:
    from remote_module.sharded import LocalModule, distribute

    variants: dict[str, tuple[Callable[[], Any], Callable[[], None]]] = {}
    keep: list[Any] = []  # the outputs of the "releases excluded" variant, until its block ends
    inputs = []
    xr = torch.randn(4, 16)
    for n in cfg["small_ns"]:
        mesh = HOSTS[:n]
        x = distribute(torch.randn(4 * n, 16), mesh, Shard(0))
        lm = LocalModule(mesh, hosts.Tiny, out_placements=Shard(0))
        linear = LocalModule(mesh, nn.Linear, (16, 16), in_placements=[Replicate()], out_placements=Shard(0))
        inputs.append((x, lm, linear))

        def floor(mesh: list[str] = mesh) -> None:
            torch.futures.wait_all([rpc.rpc_async(w, hosts.noop) for w in mesh])

        def sharded(lm: Any = lm, x: Any = x) -> None:
            with torch.no_grad():
                lm(x)  # the output is dropped here: its shards are released in the background

        def sharded_kept(lm: Any = lm, x: Any = x) -> None:
            with torch.no_grad():
                keep.append(lm(x))

        def replicated(linear: Any = linear, xr: Any = xr) -> None:
            with torch.no_grad():
                linear(xr)

        def by_hand(mesh: list[str] = mesh, xr: Any = xr) -> None:
            torch.futures.wait_all([rpc.rpc_async(w, hosts.linear_by_hand, (xr,)) for w in mesh])

        variants[f"N={n}: {n} concurrent rpc_async no-ops"] = (floor, lambda: None)
        variants[f"N={n}: the Linear's work by hand (raw rpc_async)"] = (by_hand, lambda: None)
        variants[f"N={n}: Linear(16, 16), Replicate input"] = (replicated, lambda: None)
        variants[f"N={n}: sharded forward"] = (sharded, lambda: None)
        variants[f"N={n}: sharded forward, releases excluded"] = (sharded_kept, keep.clear)
    baseline = held(HOSTS)

    def settled(after: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            after()
            drain(HOSTS, baseline)
        return run

    variants = {name: (call, settled(after)) for name, (call, after) in variants.items()}
    return blocks(variants, cfg["blocks"], cfg["per_block"], meter)


# ---- 2. the Megatron MLP ----------------------------------------------------------------------


def _check_close(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got - want).abs().max().item()
    if not torch.allclose(got, want, rtol=0, atol=1e-4):
        raise AssertionError(
            f"{name}: output differs from the local model by up to {diff:.3g} (expected within atol 1e-4); "
            "the figures would compare different computations"
        )
    return diff


def _bytes_per_forward(cfg: dict, fn: Callable[[], Any], workers: list[str], want: list[int]) -> dict:
    """Measured traffic through the caller per forward (see tests/benchmarks/_caller_bytes.py)."""
    k = cfg["bytes_forwards"]
    batch, d = cfg["batch"], cfg["d_model"]

    def hidden(shape: tuple) -> bool:
        return len(shape) == 2 and shape[0] == batch and shape[1] != d

    with CallerBytes(ignore=(hosts.held_count,)) as counted:
        for _ in range(k):
            fn()
        drain(workers, want)  # the forwards' releases are sent (and counted) before stopping
    return {
        "sent_tensor_bytes": counted.tensor_bytes("sent") / k,
        "received_tensor_bytes": counted.tensor_bytes("received") / k,
        "sent_other_bytes": counted.other["sent"] / k,
        "received_other_bytes": counted.other["received"] / k,
        "hidden_activation_bytes": (
            (counted.tensor_bytes("sent", hidden) + counted.tensor_bytes("received", hidden)) / k
        ),
        "messages": {name: c / k for name, c in sorted(counted.messages.items())},
        "unpicklable_messages": counted.unpicklable,
    }


def mlp(cfg: dict, meter: CpuMeter) -> dict[str, Any]:
    from remote_module import RemoteModule
    from remote_module.sharded import LocalModule

    model = hosts.build_mlp(cfg)
    x = hosts.mlp_input(cfg)
    bias = model[2].bias.detach().clone()
    with torch.no_grad():
        want = model(x)
    out: dict[str, Any] = {"samples_s": {}, "bytes": {}, "max_abs_diff": {}}
    variants: dict[str, Callable[[], torch.Tensor]] = {}
    for n in cfg["mlp_ns"]:
        mesh = HOSTS[:n]
        per_rank = lambda r, n=n: ((cfg, r, n), None)  # noqa: E731
        col = LocalModule(mesh, hosts.ColumnShard, per_rank, in_placements=[Replicate()], out_placements=Shard(-1))
        row = LocalModule(mesh, hosts.RowShard, per_rank, in_placements=[Shard(-1)], out_placements=Partial("sum"))
        cols = [RemoteModule(f"{w}/cpu", hosts.ColumnShard, (cfg, r, n)) for r, w in enumerate(mesh)]
        rows = [RemoteModule(f"{w}/cpu", hosts.RowShard, (cfg, r, n)) for r, w in enumerate(mesh)]

        def sharded(col: Any = col, row: Any = row) -> torch.Tensor:
            with torch.no_grad():
                return row(col(x)).full_tensor() + bias

        def by_hand(cols: list = cols, rows: list = rows) -> torch.Tensor:
            with torch.no_grad():
                hs = torch.futures.wait_all([c.forward_async(x) for c in cols])  # hidden slices to the caller
                parts = torch.futures.wait_all([r.forward_async(h) for r, h in zip(rows, hs)])  # and back
                return sum(parts) + bias

        variants[f"N={n}: sharded"] = sharded
        variants[f"N={n}: by hand"] = by_hand
    baseline = held(HOSTS)
    for name, fn in variants.items():
        out["max_abs_diff"][name] = _check_close(f"MLP {name}", fn(), want)
        drain(HOSTS, baseline)
        out["bytes"][name] = _bytes_per_forward(cfg, fn, HOSTS, baseline)
    settle = {name: (fn, lambda: drain(HOSTS, baseline)) for name, fn in variants.items()}
    out["samples_s"], out["cpu_samples_s"] = blocks(settle, cfg["mlp_rounds"], 1, meter)
    return out


def caller_main(cfg: dict) -> dict:
    results: dict[str, Any] = {"config": cfg, "torch": torch.__version__}
    results["threads_in_rpc_handlers"] = {w: rpc.rpc_sync(w, hosts.handler_threads) for w in HOSTS}
    meter = world_meter()  # CPU of all four processes, every thread, over the same blocks as the clock
    samples, cpu = small_forward(cfg, meter)
    results["small_samples_s"] = samples
    results["small_s"] = {name: statistics.median(s) for name, s in samples.items()}
    results["small_cpu_samples_s"] = cpu  # per call, each block's
    results["small_cpu_s"] = cpu_per_op(cpu)
    m = mlp(cfg, meter)
    results["mlp_samples_s"] = m["samples_s"]
    results["mlp_s"] = {name: statistics.median(s) for name, s in m["samples_s"].items()}
    results["mlp_cpu_samples_s"] = m["cpu_samples_s"]  # per forward
    results["mlp_cpu_s"] = cpu_per_op(m["cpu_samples_s"])
    results["mlp_bytes"] = m["bytes"]
    results["mlp_max_abs_diff"] = m["max_abs_diff"]
    return results


def rank_main(cfg: dict) -> dict | None:
    if rpc.get_worker_info().name == "caller0":
        return caller_main(cfg)
    return None  # the hosts only serve


def ratios(r: dict) -> dict[str, float]:
    small, mlp_s = r["small_s"], r["mlp_s"]
    out: dict[str, float] = {}
    for n in r["config"]["small_ns"]:
        floor = small[f"N={n}: {n} concurrent rpc_async no-ops"]
        out[f"small fwd N={n}: Linear, Replicate input / {n} concurrent no-ops (target <= 1.3)"] = (
            small[f"N={n}: Linear(16, 16), Replicate input"] / floor
        )
        by_hand = small[f"N={n}: the Linear's work by hand (raw rpc_async)"]
        out[f"small fwd N={n}: the Linear's work by hand / {n} concurrent no-ops"] = by_hand / floor
        out[f"small fwd N={n}: Linear, Replicate input / the same work by hand"] = (
            small[f"N={n}: Linear(16, 16), Replicate input"] / by_hand
        )
        out[f"small fwd N={n}: x * 2 on Shard(0) / {n} concurrent no-ops"] = small[f"N={n}: sharded forward"] / floor
        out[f"small fwd N={n}: sharded, releases excluded / {n} concurrent no-ops"] = (
            small[f"N={n}: sharded forward, releases excluded"] / floor
        )
    for n in r["config"]["mlp_ns"]:
        speedup = mlp_s[f"N={n}: by hand"] / mlp_s[f"N={n}: sharded"]
        out[f"MLP N={n}: by hand / sharded time (target >= 1.0)"] = speedup
        out[f"MLP N={n}: by hand / sharded time, stretch (target >= 1.2)"] = speedup
    return out


def report(r: dict) -> str:
    cfg = r["config"]
    lines = ["", f"threads in the hosts' RPC handlers: {r['threads_in_rpc_handlers']}",
             "cpu: CPU seconds per call summed over the 4 processes (every thread)",
             f"{'small forward: median per call':<52}{'µs':>9}{'min µs':>9}{'max µs':>9}{'cpu µs':>9}", "-" * 88]
    for name, s in r["small_s"].items():
        all_s = r["small_samples_s"][name]
        lines.append(f"  {name:<50}{s * 1e6:>9.0f}{min(all_s) * 1e6:>9.0f}{max(all_s) * 1e6:>9.0f}"
                     f"{cpu_cell(r['small_cpu_s'][name], 1e6, 9, 0)}")
    lines += ["", f"Megatron MLP, batch {cfg['batch']}, d_model {cfg['d_model']}, hidden {cfg['hidden']}, no grad",
              f"{'median per forward':<52}{'ms':>9}{'min ms':>9}{'max ms':>9}{'cpu ms':>9}", "-" * 88]
    for name, s in r["mlp_s"].items():
        all_s = r["mlp_samples_s"][name]
        lines.append(f"  {name:<50}{s * 1e3:>9.1f}{min(all_s) * 1e3:>9.1f}{max(all_s) * 1e3:>9.1f}"
                     f"{cpu_cell(r['mlp_cpu_s'][name], 1e3, 9)}")
    lines += ["",
              "bytes through the caller per forward (measured: instrumented rpc_async/rpc_sync/remote in the caller)",
              f"{'':<22}{'sent tensors':>14}{'recv tensors':>14}{'sent other':>12}{'recv other':>12}"
              f"{'hidden act.':>13}",
              "-" * 87]
    for name, b in r["mlp_bytes"].items():
        lines.append(f"  {name:<20}{b['sent_tensor_bytes']:>14,.0f}{b['received_tensor_bytes']:>14,.0f}"
                     f"{b['sent_other_bytes']:>12,.0f}{b['received_other_bytes']:>12,.0f}{b['hidden_activation_bytes']:>13,.0f}")
        lines.append(f"    messages: {', '.join(f'{k} x{v:g}' for k, v in b['messages'].items())}")
    lines += ["", "ratios of medians (same run)", "-" * 79]
    width = max(map(len, r["ratios"]))
    for name, v in r["ratios"].items():
        lines.append(f"  {name:<{width}}{v:>6.2f}{_verdict(name, v)}")
    for n in cfg["mlp_ns"]:
        act = r["mlp_bytes"][f"N={n}: sharded"]["hidden_activation_bytes"]
        lines.append(f"  {f'MLP N={n}: sharded, hidden-activation bytes through the caller (target 0)':<{width}}"
                     f"{act:>6.0f}{'  met' if act == 0 else '  NOT MET'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    results, path = run_world(argv, "remote_module sharded-module benchmark", "bench-sharded-results.json", QUICK, FULL,
                              rank_main, {"caller": 1, "host": len(HOSTS)})
    results["ratios"] = ratios(results)
    return publish(results, report(results), path)


if __name__ == "__main__":
    main()
