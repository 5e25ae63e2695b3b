"""Failover benchmark (issue 46): a ReplicatedModule on 3 servers under a steady load from 4
callers; one replica killed mid-run, another frozen and thawed. Failed calls and latency
around each event.

    python -m tests.benchmarks.bench_failover            # 12 s of load
    python -m tests.benchmarks.bench_failover --quick    # 6 s, not graded

A local world on loopback: "caller0".."caller3" and "server0".."server2" (an expendable role:
the job outlives a lost server). caller0 builds ``ReplicatedModule`` over the three servers (an
MLP 256-1024-256, eval mode, ``hedge_ms``) and sends it to every caller (itself included),
which serves the same replicas from its own process and learns their health for itself. Each
caller makes batch-8 no-grad calls one after another for ``seconds``, recording each call's
start, latency and outcome (clock: ``time.monotonic``, one clock for every process of one
machine). caller0 drives the events: at ``kill_at`` seconds ``server1`` is killed (SIGKILL); at
``freeze_at`` ``server2`` is stopped (SIGSTOP) and at ``thaw_at`` continued (SIGCONT). Figures:
failed calls (target 0), calls/s and p50/p99 latency in windows: before the kill, the second
after it, between, the frozen span, the second after the thaw, and after; the slowest call of
all against the call timeout (target: every call within it). Checked (the run raises
otherwise): every answer equals the local model's.
Writes JSON (bench-failover-results.json by default).
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed.rpc as rpc

from remote_module.serving import ReplicatedModule
from rpc_backend import current_worker, lost_workers
from tests.benchmarks import _serving_hosts as hosts
from tests.benchmarks._common import one_thread_per_rank, parse_args, publish
from tests.benchmarks.bench_remote_module import _verdict

FULL = {"d_in": 256, "hidden": 1024, "d_out": 256, "batch": 8, "callers": 4, "seconds": 12.0, "kill_at": 3.0,
        "freeze_at": 6.0, "thaw_at": 8.0, "hedge_ms": 100.0, "timeout": 10.0, "atol": 1e-5}
QUICK = {**FULL, "seconds": 6.0, "kill_at": 1.5, "freeze_at": 3.0, "thaw_at": 4.0}


def pid() -> int:
    return os.getpid()


def load(model: ReplicatedModule, cfg: dict, until: float, seed: int) -> dict:
    """(On a caller) calls until ``until`` (monotonic); each call's start, latency, outcome,
    and the largest difference from the expected outputs."""
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn(16, cfg["batch"], cfg["d_in"], generator=gen)
    local = hosts.TimedMLP(cfg["d_in"], cfg["hidden"], cfg["d_out"], 0).eval()
    local.load_state_dict(model.state_dict())
    with torch.no_grad():
        want = [local(x) for x in xs]
    starts, took, ok, errors, diff = [], [], [], [], 0.0
    i = 0
    with torch.no_grad():
        while time.monotonic() < until:
            start = time.monotonic()
            try:
                out = model(xs[i % 16])
                diff = max(diff, float((out - want[i % 16]).abs().max()))
                ok.append(True)
            except Exception as exc:  # noqa: BLE001 (counted and reported)
                ok.append(False)
                errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            starts.append(start)
            took.append(time.monotonic() - start)
            i += 1
    return {"starts": starts, "took": took, "ok": ok, "errors": errors[:5], "max_abs_diff": diff}


def _window(rows: list[tuple[float, float, bool]], lo: float, hi: float) -> dict:
    inside = [r for r in rows if lo <= r[0] < hi]
    lat = sorted(r[1] for r in inside)
    if not lat:
        return {"calls": 0}
    p = lambda q: 1e3 * lat[min(len(lat) - 1, int(round(q * (len(lat) - 1))))]  # noqa: E731
    return {"calls": len(inside), "failed": sum(not r[2] for r in inside), "calls_per_s": len(inside) / (hi - lo),
            "p50_ms": p(0.5), "p99_ms": p(0.99), "max_ms": 1e3 * lat[-1]}


def driver(cfg: dict) -> dict:
    callers = current_worker().workers("caller")
    servers = [f"server{i}/cpu" for i in range(3)]
    model = ReplicatedModule(servers, hosts.TimedMLP, (cfg["d_in"], cfg["hidden"], cfg["d_out"], 1),
                             timeout=cfg["timeout"], hedge_ms=cfg["hedge_ms"]).eval()
    pids = {s: rpc.rpc_sync(s.split("/")[0], pid) for s in servers}
    t0 = time.monotonic() + 1.0  # (every caller has its copy by then)
    until = t0 + cfg["seconds"]
    futs = [rpc.rpc_async(c, load, (model, cfg, until, i), timeout=0) for i, c in enumerate(callers)]
    events = {}
    for name, at, server, sig in (("kill", cfg["kill_at"], "server1/cpu", signal.SIGKILL),
                                  ("freeze", cfg["freeze_at"], "server2/cpu", signal.SIGSTOP),
                                  ("thaw", cfg["thaw_at"], "server2/cpu", signal.SIGCONT)):
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        os.kill(pids[server], sig)
        events[name] = time.monotonic() - t0
    got = [f.wait() for f in futs]
    rows = sorted((s - t0, d, k) for g in got for s, d, k in zip(g["starts"], g["took"], g["ok"]))
    diff = max(g["max_abs_diff"] for g in got)
    if not diff <= cfg["atol"]:
        raise AssertionError(f"an answer differs from the local model by {diff:.3g}")
    with torch.no_grad():  # (this process's copy has made no call since the kill: it learns now)
        for _ in range(6):
            model(torch.randn(cfg["batch"], cfg["d_in"]))
    k, f, t = events["kill"], events["freeze"], events["thaw"]
    windows = {"before the kill": (0.0, k), "1 s after the kill": (k, k + 1), "killed, before the freeze": (k + 1, f),
               "frozen": (f, t), "1 s after the thaw": (t, t + 1), "after": (t + 1, cfg["seconds"])}
    out = {"config": cfg, "torch": torch.__version__, "events_s": events,
           "windows": {n: _window(rows, lo, hi) for n, (lo, hi) in windows.items()},
           "calls": len(rows), "failed": sum(not r[2] for r in rows), "slowest_ms": 1e3 * max(r[1] for r in rows),
           "errors": [e for g in got for e in g["errors"]][:5], "max_abs_diff_vs_local": diff,
           "replica_states": model.replica_states()}
    deadline = time.monotonic() + 60  # the job's end goes on without server1 once the watcher named it
    while "server1" not in [w.name for w in lost_workers()] and time.monotonic() < deadline:
        time.sleep(0.1)
    return out


def rank_main(cfg: dict) -> dict | None:
    if current_worker().name != "caller0":
        return None
    return driver(cfg)


def ratios(r: dict) -> dict[str, float]:
    return {"failed calls (target <= 0)": float(r["failed"]),
            "slowest call / timeout (target <= 1)": r["slowest_ms"] / 1e3 / r["config"]["timeout"]}


def report(r: dict) -> str:
    cfg = r["config"]
    lines = [f"ReplicatedModule over 3 servers (MLP {cfg['d_in']}-{cfg['hidden']}-{cfg['d_out']}, batch "
             f"{cfg['batch']}), {cfg['callers']} callers for {cfg['seconds']:g} s, hedge_ms={cfg['hedge_ms']:g}, "
             f"timeout {cfg['timeout']:g} s; server1 killed at {r['events_s']['kill']:.2f} s, server2 frozen "
             f"at {r['events_s']['freeze']:.2f} s and thawed at {r['events_s']['thaw']:.2f} s",
             f"{'window':28}{'calls':>7}{'failed':>8}{'calls/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"]
    for name, w in r["windows"].items():
        if not w["calls"]:
            lines.append(f"{name:28}{0:7d}")
            continue
        lines.append(f"{name:28}{w['calls']:7d}{w['failed']:8d}{w['calls_per_s']:9.1f}{w['p50_ms']:9.2f}"
                     f"{w['p99_ms']:9.2f}{w['max_ms']:9.1f}")
    lines.append(f"replicas at the end: {', '.join(s['worker'] + ' ' + s['state'] for s in r['replica_states'])}")
    lines.append("")
    for k, v in r["ratios"].items():
        lines.append(f"  {k:60}{v:8.3f}{_verdict(k, v)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from rpc_backend import run_local

    args = parse_args("remote_module replica failover benchmark", "bench-failover-results.json", argv)
    cfg = dict(QUICK if args.quick else FULL)
    cfg["transport"] = args.transport
    with one_thread_per_rank():
        out = run_local(rank_main, cfg["callers"] + 3, roles={"caller": cfg["callers"], "server": 3},
                        args=(cfg,), transport=cfg["transport"], expendable=["server"], timeout=600)
    results = next(x for x in out if x is not None)
    results["ratios"] = ratios(results)
    return publish(results, report(results), args.json)


if __name__ == "__main__":
    main()
