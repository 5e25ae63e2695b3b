"""Admission and eviction benchmark: a lazy sharded table's memory under a stream of ids seen
once, and what admission and eviction cost per step.

    make bench                                     # runs this last, after bench_dlrm
    python -m tests.benchmarks.bench_admission     # full size (a few minutes on 2 cores)
    python -m tests.benchmarks.bench_admission --distinct 2000000   # a shorter stream
    python -m tests.benchmarks.bench_admission --quick

Two local processes on loopback, each started with OMP_NUM_THREADS=1: "trainer0" runs
everything, "ps0" serves.

Part 1, issue 26's acceptance: ``--distinct`` ids (default 20,000,000) streamed once each,
``--fresh-per-step`` of them a step (default 20,000: 1,000 steps), plus a hot set of
``--hot`` ids (default 10,000) looked up in every step, through a lazy 10^9 x 16
``ShardedEmbedding`` (SGD, lr 0.05) with ``admit_after=2`` and the default admission sketch
(``DEFAULT_SKETCH_BYTES``). A step is ``emb(ids)``, the loss ``(rows * w * c_s).sum()``, its
backward and ``emb.step()``: ``w`` is a fixed random matrix and ``c_s = 1 + s / steps`` rises
with the step, so each row's gradient is its row of ``w * c_s``, known here, and different in
every step. Measured: the server's resident set (``VmRSS``) before the table exists, once it is
created (its sketch allocated) and after the stream, its peak over the stream (``VmHWM``,
reset when the stream starts), and its growth over the stream against the target (<= 100 MB);
``table_stats()``; the false admissions (rows admitted beyond the hot ones: fresh ids seen once
whose counters others had raised) beside the number the documented bound predicts
(``false_admission_rate`` summed over the stream's ids); steps/s, the slowest step and the CPU
seconds per step of both processes. Checked (the run raises otherwise): every hot row equals a
reference computed here, its first value (``initial_rows``) stepped by SGD with the gradients
of every step but the first ``admit_after - 1`` (those its id was counted in before its row was
admitted), within ``hot_atol``.

Part 2, eviction: a drifting stream (each step ``drift_batch`` ids drawn from a window of
``drift_window`` ids that slides by ``drift_slide`` a step) through four lazy tables: neither
admission nor eviction ("lazy"), ``admit_after=2`` ("admission"), ``evict_after_steps=50``
("eviction"), both ("admission + eviction"); the same stream for each, interleaved in rounds of
``drift_steps_per_round`` steps in an order that rotates every round. Figures: steps/s (medians
over rounds) and CPU per step side by side, their ratios to "lazy" (same run), each table's
rows held after every round, and its longest eviction pause (``longest_eviction_pause_s``: the
longest sweep, which holds the table's lock). Checked: the evicting tables hold at most the ids
the stream drew in the last ``evict_after + evict_after // 4 + 1`` steps (a sweep runs every
quarter of ``evict_after``).

Writes JSON (bench-admission-results.json by default).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed.rpc as rpc

from remote_module.ps.tables.lifetime._admission import DEFAULT_SKETCH_BYTES, false_admission_rate
from remote_module.ps.tables.server._initial import initial_rows, row_key
from rpc_backend import current_worker
from tests.benchmarks import _admission_hosts as hosts
from tests.benchmarks._common import (
    cpu_cell,
    cpu_per_op,
    one_thread_per_rank,
    parse_args,
    publish,
    rounds,
)
from tests.benchmarks._cpu import world_meter
from tests.benchmarks.bench_remote_module import _verdict

SERVER = "ps0"
NAME = "bench-admission"
MB = 1e6
FULL = {"rows": 10**9, "dim": 16, "lr": 0.05, "seed": 0, "hot": 10_000, "distinct": 20_000_000,
        "fresh_per_step": 20_000, "admit_after": 2, "sketch_bytes": DEFAULT_SKETCH_BYTES, "rss_target_MB": 100,
        "hot_atol": 1e-5, "rss_every": 100,
        "drift_batch": 4096, "drift_window": 65_536, "drift_slide": 1024, "evict_after": 50,
        "drift_steps_per_round": 50, "drift_rounds": 8, "drift_warmup_rounds": 1}
QUICK = {**FULL, "hot": 1000, "distinct": 100_000, "fresh_per_step": 5_000, "sketch_bytes": 1 << 20,
         "rss_every": 5, "drift_batch": 512, "drift_window": 4096, "drift_slide": 256, "evict_after": 8,
         "drift_steps_per_round": 8, "drift_rounds": 2, "drift_warmup_rounds": 1}
DRIFT_VARIANTS = ("lazy", "admission", "eviction", "admission + eviction")


def _table(cfg: dict, name: str, **kwargs: Any) -> Any:
    from remote_module.ps import ShardedEmbedding

    return ShardedEmbedding(cfg["rows"], cfg["dim"], [SERVER], name=name, init="lazy", seed=cfg["seed"],
                            optimizer=(torch.optim.SGD, {"lr": cfg["lr"]}), timeout=120, **kwargs)


def _memory() -> dict[str, int]:
    return rpc.rpc_sync(SERVER, hosts.server_memory)


# ---- part 1: ids seen once, and a hot set -------------------------------------------------------


def expected_false_admissions(cfg: dict) -> float:
    """The false admissions the documented bound predicts over the stream: each step's fresh
    ids times :func:`false_admission_rate` of the distinct ids counted before that step."""
    steps = math.ceil(cfg["distinct"] / cfg["fresh_per_step"])
    total = 0.0
    for s in range(steps):
        fresh = min(cfg["fresh_per_step"], cfg["distinct"] - s * cfg["fresh_per_step"])
        seen = cfg["hot"] + s * cfg["fresh_per_step"]
        total += fresh * false_admission_rate(cfg["sketch_bytes"], cfg["admit_after"], seen)
    return total


def admission_stream(cfg: dict) -> dict:
    """Part 1 (see the module docstring)."""
    hot, fresh, k, rows, dim = cfg["hot"], cfg["fresh_per_step"], cfg["admit_after"], cfg["rows"], cfg["dim"]
    steps = math.ceil(cfg["distinct"] / fresh)
    before = _memory()
    emb = _table(cfg, NAME, admit_after=k, admit_sketch_bytes=cfg["sketch_bytes"])
    created = _memory()
    peak_reset = rpc.rpc_sync(SERVER, hosts.reset_peak)
    hot_ids = hosts.spread(torch.arange(hot), rows)
    w = torch.randn(hot + fresh, dim, generator=torch.Generator().manual_seed(cfg["seed"]))
    first = initial_rows(row_key(cfg["seed"], NAME), hot_ids, dim)
    reference = first.clone()
    rss_series = [(0, created["VmRSS"])]
    step_s: list[float] = []
    meter = world_meter()
    meter.start()
    for s in range(steps):
        began = time.perf_counter()
        lo = hot + s * fresh
        hi = min(lo + fresh, hot + cfg["distinct"])
        ids = torch.cat([hot_ids, hosts.spread(torch.arange(lo, hi), rows)])
        grad = w[: ids.numel()] * (1 + s / steps)  # each row's gradient: its id appears once
        (emb(ids) * grad).sum().backward()
        emb.step()
        step_s.append(time.perf_counter() - began)
        if s >= k - 1:  # (the first k - 1 steps: the hot ids were counted, not admitted yet)
            reference = reference.add(grad[:hot], alpha=-cfg["lr"])
        if (s + 1) % cfg["rss_every"] == 0:  # (outside the step's clock)
            rss_series.append((s + 1, _memory()["VmRSS"]))
    emb.flush()  # the last step's push landed
    cpu = meter.stop()
    wall = sum(step_s)
    after = _memory()
    stats = emb.table_stats()
    with torch.no_grad():
        got = emb(hot_ids)
    diff = float((got - reference).abs().max())
    moved = float((got - first).abs().max())
    if not diff <= cfg["hot_atol"]:
        raise AssertionError(f"the hot rows differ from the reference (first {k - 1} counted steps dropped) by "
                             f"{diff:.3g} (allowed {cfg['hot_atol']})")
    if not moved > 0:
        raise AssertionError("the hot rows never moved from their first values: the check is void")
    trimmed = rpc.rpc_sync(SERVER, hosts.trimmed_rss)
    ordered = sorted(step_s)
    return {
        "steps": steps, "ids_per_step": hot + fresh, "step_wall_s": wall, "steps_per_s": steps / wall,
        "step_cpu_s": None if cpu is None else cpu / steps,
        "step_s_median": statistics.median(step_s), "step_s_p99": ordered[min(len(ordered) - 1,
                                                                             int(0.99 * len(ordered)))],
        "step_s_max": ordered[-1], "slowest_step": step_s.index(ordered[-1]),
        "rss_before_table_MB": before["VmRSS"] / MB, "rss_table_created_MB": created["VmRSS"] / MB,
        "rss_after_MB": after["VmRSS"] / MB, "rss_growth_MB": (after["VmRSS"] - created["VmRSS"]) / MB,
        "peak_reset": peak_reset, "rss_peak_MB": after["VmHWM"] / MB,
        "peak_growth_MB": (after["VmHWM"] - created["VmRSS"]) / MB,
        "rss_after_malloc_trim_MB": None if trimmed is None else trimmed / MB,
        "rss_series_MB": [(s, v / MB) for s, v in rss_series],
        "table_stats": stats, "false_admissions": stats["rows_admitted"] - hot,
        "false_admission_rate_at_end": false_admission_rate(cfg["sketch_bytes"], k, hot + cfg["distinct"]),
        "false_admissions_by_the_bound": expected_false_admissions(cfg),
        "hot_max_abs_diff": diff, "hot_max_moved": moved,
    }


# ---- part 2: a drifting stream, with and without admission and eviction -------------------------


def drift_bound(cfg: dict) -> int:
    """The most rows an evicting table may hold: the ids drawn in the last ``evict_after +
    evict_after // 4 + 1`` steps (rows not stepped in ``evict_after`` steps, swept every
    quarter of it), a window slid that many times."""
    e = cfg["evict_after"]
    return cfg["drift_window"] + (e + max(1, e // 4) + 1) * cfg["drift_slide"]


def drift(cfg: dict) -> dict:
    """Part 2 (see the module docstring)."""
    k, e = cfg["admit_after"], cfg["evict_after"]
    kwargs = {"lazy": {}, "admission": {"admit_after": k}, "eviction": {"evict_after_steps": e},
              "admission + eviction": {"admit_after": k, "evict_after_steps": e}}
    sketch = {"admit_sketch_bytes": cfg["sketch_bytes"]}
    tables = {v: _table(cfg, f"{NAME}-drift-{v.replace(' + ', '-')}", **kw, **(sketch if "admit_after" in kw else {}))
              for v, kw in kwargs.items()}
    w = torch.randn(cfg["drift_batch"], cfg["dim"], generator=torch.Generator().manual_seed(cfg["seed"] + 1))
    done = dict.fromkeys(tables, 0)
    held: dict[str, list[tuple[int, int]]] = {v: [] for v in tables}

    def train(v: str) -> Callable[[], None]:
        emb = tables[v]

        def run() -> None:
            for _ in range(cfg["drift_steps_per_round"]):
                ids = hosts.spread(hosts.drift_positions(done[v], cfg), cfg["rows"])
                (emb(ids) * w).sum().backward()
                emb.step()
                done[v] += 1
        return run

    def sample(v: str) -> Callable[[], None]:
        return lambda: held[v].append((done[v], tables[v].table_stats()["rows_held"]))  # (lands the push)

    samples, cpu = rounds({v: train(v) for v in tables}, cfg["drift_rounds"], cfg["drift_warmup_rounds"],
                          world_meter(), after={v: sample(v) for v in tables})
    per_round = cfg["drift_steps_per_round"]
    stats = {v: emb.table_stats() for v, emb in tables.items()}
    bound = drift_bound(cfg)
    for v in ("eviction", "admission + eviction"):
        most = max(n for _, n in held[v])
        if most > bound:
            raise AssertionError(f"drift {v}: held {most} rows, more than the {bound} ids the stream drew in the last "
                                 f"{e + max(1, e // 4) + 1} steps: eviction does not bound the table")
        if not stats[v]["rows_evicted"] > 0:
            raise AssertionError(f"drift {v}: no row was evicted in {done[v]} steps (evict_after_steps={e})")
    return {
        "steps_each": done, "round_samples_s": samples, "round_cpu_samples_s": cpu,
        "steps_per_s": {v: per_round / statistics.median(s) for v, s in samples.items()},
        "step_cpu_s": cpu_per_op(cpu, per_round),
        "rows_held_series": held, "rows_held_bound": bound,
        "table_stats": stats,
        "longest_eviction_pause_s": {v: stats[v]["longest_eviction_pause_s"] for v in tables},
    }


def trainer_main(cfg: dict) -> dict:
    results: dict[str, Any] = {"config": cfg, "torch": torch.__version__}
    results["threads_in_rpc_handlers"] = {SERVER: rpc.rpc_sync(SERVER, hosts.handler_threads)}
    # glibc's malloc settings the ranks inherited (they change the server's resident set a lot)
    results["malloc_env"] = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    results["admission"] = admission_stream(cfg)  # first: the server's memory holds nothing else yet
    results["drift"] = drift(cfg)
    return results


def rank_main(cfg: dict) -> dict | None:
    if current_worker().role != "trainer":
        return None  # the server only serves
    return trainer_main(cfg)


def ratios(r: dict) -> dict[str, float]:
    sps = r["drift"]["steps_per_s"]
    return {f"drift steps/s: {v} / lazy": sps[v] / sps["lazy"] for v in DRIFT_VARIANTS if v != "lazy"}


def report(r: dict) -> str:
    cfg, a, d = r["config"], r["admission"], r["drift"]
    st = a["table_stats"]
    target = cfg["rss_target_MB"]
    peak = (f"{a['rss_peak_MB']:.1f} MB (+{a['peak_growth_MB']:.1f} over the stream)" if a["peak_reset"]
            else f"{a['rss_peak_MB']:.1f} MB (since the process started: its reset was refused)")
    trim = "-" if a["rss_after_malloc_trim_MB"] is None else f"{a['rss_after_malloc_trim_MB']:.1f} MB"
    lines = [
        "",
        f"part 1: {cfg['distinct']:,} distinct ids once each ({cfg['fresh_per_step']:,} a step) + {cfg['hot']:,} hot "
        f"ids every step; lazy {cfg['rows']:,} x {cfg['dim']} ShardedEmbedding, SGD lr {cfg['lr']}, "
        f"admit_after={cfg['admit_after']}, sketch {cfg['sketch_bytes'] / 2**20:g} MiB; one server",
        f"  {a['steps']:,} steps of {a['ids_per_step']:,} ids: {a['steps_per_s']:.1f} steps/s "
        f"({a['steps'] * a['ids_per_step'] / a['step_wall_s']:,.0f} ids/s), step median "
        f"{1e3 * a['step_s_median']:.1f} ms, p99 {1e3 * a['step_s_p99']:.1f} ms, max {1e3 * a['step_s_max']:.1f} ms "
        f"(step {a['slowest_step']}); cpu {cpu_cell(a['step_cpu_s'], 1e3, 0, 1).strip()} ms/step (both processes)",
        f"  server RSS ({', '.join(f'{k}={v}' for k, v in r['malloc_env'].items()) or 'glibc malloc defaults'}): "
        f"{a['rss_before_table_MB']:.1f} MB before the table, {a['rss_table_created_MB']:.1f} MB once "
        f"created, {a['rss_after_MB']:.1f} MB after the stream; peak {peak}; after malloc_trim {trim}",
        "  server RSS over the stream (step: MB): " + ", ".join(f"{s}: {v:.0f}" for s, v in a["rss_series_MB"]),
        f"  table_stats: rows_held {st['rows_held']:,}, rows_admitted {st['rows_admitted']:,}, rows_evicted "
        f"{st['rows_evicted']:,}, bytes {st['bytes']:,} ({st['bytes'] / MB:.1f} MB)",
        f"  false admissions: {a['false_admissions']:,} of {cfg['distinct']:,} ids seen once "
        f"({a['false_admissions'] / cfg['distinct']:.3%}); the documented bound: "
        f"{a['false_admissions_by_the_bound']:,.0f} over the stream (false_admission_rate at the end: "
        f"{a['false_admission_rate_at_end']:.3%})",
        f"  check: hot rows vs the reference (first {cfg['admit_after'] - 1} counted step(s) dropped): max |diff| "
        f"{a['hot_max_abs_diff']:.2g} (allowed {cfg['hot_atol']:g}; rows moved up to {a['hot_max_moved']:.2f})",
        f"  {f'server RSS growth over the stream, MB (target <= {target})':<60}{a['rss_growth_MB']:>8.1f}"
        f"{_verdict(f'(target <= {target})', a['rss_growth_MB'])}",
        "",
        f"part 2: drifting stream, {cfg['drift_batch']:,} ids a step from a window of {cfg['drift_window']:,} sliding "
        f"{cfg['drift_slide']:,} a step; evict_after_steps={cfg['evict_after']}, admit_after={cfg['admit_after']}; "
        f"{cfg['drift_steps_per_round']} steps per round, {cfg['drift_rounds']} rounds (+{cfg['drift_warmup_rounds']} "
        f"warmup), {d['steps_each']['lazy']} steps per variant",
        f"{'median':<24}{'steps/s':>9}{'ms/step':>9}{'cpu ms/step':>13}{'rows held':>11}{'admitted':>10}"
        f"{'evicted':>10}{'MB':>7}{'longest pause ms':>18}",
        "-" * 111,
    ]
    for v in DRIFT_VARIANTS:
        sps, s = d["steps_per_s"][v], d["table_stats"][v]
        pause = d["longest_eviction_pause_s"][v]
        lines.append(f"  {v:<22}{sps:>9.1f}{1e3 / sps:>9.2f}{cpu_cell(d['step_cpu_s'][v], 1e3, 13, 2)}"
                     f"{s['rows_held']:>11,}{s['rows_admitted']:>10,}{s['rows_evicted']:>10,}{s['bytes'] / MB:>7.1f}"
                     + (f"{1e3 * pause:>18.2f}" if "eviction" in v else f"{'-':>18}"))
    lines += ["", f"rows held after each round (step: rows; evicting tables bounded by {d['rows_held_bound']:,})"]
    for v in DRIFT_VARIANTS:
        lines.append(f"  {v:<22}" + ", ".join(f"{s}: {n:,}" for s, n in d["rows_held_series"][v]))
    lines += ["", "ratios of medians (same run)", "-" * 111]
    width = max(map(len, r["ratios"]))
    for name, v in r["ratios"].items():
        lines.append(f"  {name:<{width}}{v:>7.3f}{_verdict(name, v)}")
    return "\n".join(lines)


def _options(parser: Any) -> None:
    parser.add_argument("--distinct", type=int, help=f"ids streamed once each (default {FULL['distinct']:,})")
    parser.add_argument("--fresh-per-step", type=int,
                        help=f"of those, ids per step (default {FULL['fresh_per_step']:,})")
    parser.add_argument("--hot", type=int, help=f"hot ids, looked up every step (default {FULL['hot']:,})")


def main(argv: list[str] | None = None) -> dict:
    from rpc_backend import run_local

    args = parse_args("remote_module row admission and eviction benchmark", "bench-admission-results.json", argv,
                      extra=_options)
    cfg = dict(QUICK if args.quick else FULL)
    for key in ("distinct", "fresh_per_step", "hot"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    cfg["transport"] = args.transport
    with one_thread_per_rank():
        out = run_local(rank_main, 2, roles={"trainer": 1, "ps": 1}, args=(cfg,), transport=cfg["transport"],
                        timeout=3600)
    results = next(r for r in out if r is not None)
    results["ratios"] = ratios(results)
    return publish(results, report(results), args.json)


if __name__ == "__main__":
    main()
