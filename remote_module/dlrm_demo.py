"""A small DLRM-style click model on parameter servers (work in progress for ``make demo``).

Sparse features look up ``ShardedEmbeddingBag`` tables sliced over the servers; the dense part
(bottom and top MLPs) trains on every trainer under ``DistributedDataParallel`` (gloo, among
the trainers only). Clicks are synthetic, drawn from a hidden ground truth (per-row weights of
each table plus a dense weight vector), so the AUC has somewhere to go.

    python -m remote_module.dlrm_demo [--mode sync|async|half_async|geo] [--servers 2]
                                      [--trainers 2] [--steps 300]

Under torchrun the same script runs one rank per process (roles ``{"ps": S, "trainer": N-S}``).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

from rpc_backend import current_worker, init_from_env, init_role_process_group, read_env, run_local

TABLES = 3
ROWS = 20_000
DIM = 16
DENSE = 8
BAG = 3
BATCH = 128


class Truth:
    """The hidden ground truth: a weight per table row and a dense weight vector."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(12345)
        self.rows = torch.randn(TABLES, ROWS, generator=g)
        self.dense = torch.randn(DENSE, generator=g) * 0.5

    def batch(self, gen: torch.Generator, size: int = BATCH) -> tuple:
        ids = torch.randint(0, ROWS, (TABLES, size, BAG), generator=gen)
        dense = torch.randn(size, DENSE, generator=gen)
        logit = sum(self.rows[t][ids[t]].mean(1) for t in range(TABLES)) + dense @ self.dense
        clicks = torch.bernoulli(torch.sigmoid(2.0 * logit), generator=gen)
        return ids, dense, clicks


class Dense(nn.Module):
    """Bottom MLP on the dense features, top MLP on [bottom, pooled embeddings]."""

    def __init__(self) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(DENSE, DIM), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(DIM * (TABLES + 1), 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
        return self.top(torch.cat([self.bottom(dense), *pooled], dim=1)).squeeze(1)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (the rank statistic; ties averaged)."""
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def train(args: argparse.Namespace) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from remote_module.ps import ShardedEmbeddingBag

    me = current_worker()
    init_role_process_group(me)
    torch.manual_seed(0)  # the same dense initialisation on every trainer (DDP checks it anyway)
    tables = [
        ShardedEmbeddingBag(ROWS, DIM, me.workers("ps"), name=f"table{t}", mode="mean", ps_mode=args.mode,
                            num_trainers=me.role_size, optimizer=(torch.optim.Adagrad, {"lr": 0.1}),
                            min_block_size=4096, geo_push_every=5, seed=t)
        for t in range(TABLES)
    ]
    dense = DDP(Dense())
    opt = torch.optim.Adam(dense.parameters(), lr=0.003)
    truth = Truth()
    gen = torch.Generator().manual_seed(100 + me.role_rank)
    bar = _progress(args.steps, me.role_rank, args.progress)
    latencies, losses = [], []
    start = time.perf_counter()
    for _ in range(args.steps):
        ids, x, clicks = truth.batch(gen)
        t0 = time.perf_counter()
        pooled = [tables[t](ids[t]) for t in range(TABLES)]
        latencies.append(time.perf_counter() - t0)
        loss = nn.functional.binary_cross_entropy_with_logits(dense(x, pooled), clicks)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for table in tables:
            table.step()
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    elapsed = time.perf_counter() - start
    bar.close()
    ids, x, clicks = truth.batch(torch.Generator().manual_seed(999), 4096)
    with torch.no_grad():
        scores = dense.module(x, [tables[t](ids[t]) for t in range(TABLES)])
    lat = torch.tensor(latencies)
    k = max(1, len(losses) // 10)
    return {
        "trainer": me.name, "loss_first": sum(losses[:k]) / k, "loss_last": sum(losses[-k:]) / k,
        "auc": auc(scores, clicks), "steps_per_s": args.steps / elapsed,
        "lookups_per_s": args.steps * TABLES * BATCH * BAG / elapsed,
        "bytes_pushed_per_step": sum(t.pushed_bytes for t in tables) / args.steps,
        "lookup_p50_ms": float(lat.quantile(0.5)) * 1e3, "lookup_p99_ms": float(lat.quantile(0.99)) * 1e3,
        "losses": losses,
    }


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kwargs: object) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, position: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # the demo extra is optional
        return _NoBar()
    return tqdm(total=total, desc=f"trainer{position}", position=position, unit="step", leave=True)


def _rank(args: argparse.Namespace) -> dict | None:
    # Ranks sharing a machine's cores: more intra-op threads than cores per rank only spin
    # (OpenMP waits busily after each parallel op) and slow down the other ranks' RPCs.
    torch.set_num_threads(args.threads)
    if current_worker().role == "ps":
        return None
    return train(args)


def summary(results: list[dict], args: argparse.Namespace) -> str:
    lines = [f"DLRM on {args.servers} parameter server(s) and {args.trainers} trainer(s), mode {args.mode}, "
             f"{args.steps} steps of {BATCH} clicks per trainer",
             f"{'trainer':<10}{'loss':>14}{'AUC':>7}{'steps/s':>9}{'lookups/s':>11}{'push B/step':>13}"
             f"{'p50 ms':>8}{'p99 ms':>8}"]
    for r in results:
        lines.append(f"{r['trainer']:<10}{r['loss_first']:>6.3f} -> {r['loss_last']:<5.3f}{r['auc']:>7.3f}"
                     f"{r['steps_per_s']:>9.1f}{r['lookups_per_s']:>11.0f}{r['bytes_pushed_per_step']:>13.0f}"
                     f"{r['lookup_p50_ms']:>8.2f}{r['lookup_p99_ms']:>8.2f}")
    return "\n".join(lines)


def _plot(results: list[dict], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        ax.plot(r["losses"], label=f"{r['trainer']} (AUC {r['auc']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["sync", "async", "half_async", "geo"], default="async")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: this machine's cores / local ranks, at least 1)")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--plot", default="dlrm-demo.png", help="loss curve PNG (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.threads is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", args.servers + args.trainers))
        args.threads = max(1, (os.cpu_count() or 1) // local)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: one rank here
        world = read_env()["world_size"]
        args.trainers = world - args.servers
        with init_from_env(roles={"ps": args.servers, "trainer": args.trainers}):
            result = _rank(args)
        if result is not None:
            print(summary([result], args), flush=True)
        return [result] if result is not None else []
    print(f"Starting a local RPC world on loopback: {args.servers} server(s), {args.trainers} trainer(s)...", flush=True)
    out = run_local(_rank, args.servers + args.trainers, roles={"ps": args.servers, "trainer": args.trainers},
                    args=(args,), timeout=900)
    results = [r for r in out if r is not None]
    print("\n" + summary(results, args), flush=True)
    plotted = _plot(results, args.plot)
    if plotted:
        print(f"loss curve: {plotted}")
    return results


if __name__ == "__main__":
    main()
