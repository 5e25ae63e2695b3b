"""``make demo``: a small DLRM-style click model trained on parameter servers.

Three sparse features (a user, an ad and a site id per click, three ids each) look up
``ShardedEmbeddingBag`` tables of 1,000,000, 100,000 and 10,000 rows sliced over the parameter
servers, grouped in a ``ShardedEmbeddingBagCollection``: a step's lookups of all three tables
travel in one message per server, and so do their pushes; only the rows a batch touches travel,
both ways. The dense part (bottom and top MLPs)
trains on every trainer under ``DistributedDataParallel`` (gloo, among the trainers only).
Clicks are synthetic, drawn from a hidden ground truth: a weight for every table row plus a
dense weight vector. Ids follow a Zipf-like popularity curve (a few ids are frequent, most are
rare), so the tables can learn the frequent rows within a short run, and most of what there is
to learn is in the tables: the summary shows the AUC the truth itself reaches and the AUC of its
dense part alone, which the model can only beat by training its tables.

Run it on a local world (every rank a process on this machine, loopback only)::

    python -m remote_module.demos.dlrm [--mode async|sync|half_async|geo] [--servers 2]
                                       [--trainers 2] [--steps 150]
                                       [--stream] [--admit-after K] [--evict-after-steps N]

or under torchrun, one rank per process, the first ``--servers`` ranks serving the tables::

    torchrun --standalone --nproc-per-node=4 -m remote_module.demos.dlrm --servers 2

trainer0 tells the setup (the same on every trainer) once; then each trainer shows a progress
bar (when tqdm is installed and stderr is a terminal; else a line every few seconds); at the end
one summary table is printed (by trainer0 under torchrun) and, when matplotlib is installed, a
PNG of the loss and AUC curves is written, titled with the run. ``--json PATH`` also writes
every trainer's figures there, each step's loss among them, at full precision (to compare runs).

The rows' lifetime on the servers: ``--stream`` makes the ids drift (each table keeps a popular
head of ids all run long; its other ids come from a window of the id space that slides with the
step, so new ids appear, popular at first, fade, and stop); ``--admit-after K`` stores an id's row
only once the id was looked up in K of its table's steps; ``--evict-after-steps N`` drops a row
not stepped in N of its table's steps. With any of them the tables are ``init="lazy"`` (rows
created as they are admitted), trainer0 samples ``table_stats()`` a few dozen times over the run,
and the summary and PNG show the rows each server holds over time.

The network: the summary ends with the bytes per training step between trainers and servers,
each way, measured on what each trainer's calls sent and were answered (``rpc_backend.Traffic``:
the RPC payload, without TensorPipe's framing or TCP/IP headers), and the rate they make at each
trainer's steps/s: what the network between them must carry (tutorials/performance.md compares
them with a link's counters).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple

import torch
from torch import nn

from remote_module.demos.progress import bar_hidden, progress_bar
from rpc_backend import (
    DEFAULT_TRANSPORT,
    TRANSPORTS,
    Traffic,
    Worker,
    current_worker,
    init_from_env,
    init_role_process_group,
    read_env,
    run_local,
)

TABLES = {"user": 1_000_000, "ad": 100_000, "site": 10_000}  # rows per table
DIM = 16  # embedding width
DENSE = 8  # dense features per click
BAG = 3  # ids per sparse feature per click
BATCH = 128  # clicks per trainer per step
ZIPF = 1.1  # popularity: the id of rank k is drawn with probability ~ 1 / k**ZIPF
EVAL = 4096  # held-out clicks for the final AUC
PLAIN_PROGRESS_EVERY = 2.0  # seconds between a trainer's progress lines when no bar is shown
WINDOW = 20  # steps in the progressive AUC (each batch scored before it is trained on)
MODES = ("async", "sync", "half_async", "geo")
GEO_PUSH_EVERY = 20  # geo: a trainer pushes its trained rows' deltas every this many steps
# --stream: each table's STREAM_HEAD most popular ids are drawn all run long; its other ids from
# a window of STREAM_WINDOW ids (the same Zipf-like curve over head and window) that slides by
# STREAM_DRIFT ids a step: an id enters at the window's popular end and fades out of its tail
STREAM_HEAD = 64
STREAM_WINDOW = 4096
STREAM_DRIFT = 32
STATS_SAMPLES = 30  # table_stats() samples per run (each a round trip per table per server)
# --admit-after: the admission sketch per table per server (the library's default is 32 MiB):
# about 1e-4 of the ids seen once are admitted early with 100,000 such ids on a server
ADMIT_SKETCH_BYTES = 1 << 20


class Batch(NamedTuple):
    ids: list[torch.Tensor]  # per table: (clicks, BAG) row ids
    dense: torch.Tensor  # (clicks, DENSE)
    clicks: torch.Tensor  # (clicks,) 0. or 1.


class Truth:
    """The hidden ground truth: a weight per table row and a dense weight vector. A click's
    logit is the sum over tables of its ids' mean weight plus the dense features' dot product."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(12345)
        self.rows = [torch.randn(rows, generator=g) for rows in TABLES.values()]
        # popular ids spread over the id space (as hashed ids are), so over every server
        self.ids_by_rank = [torch.randperm(rows, generator=g) for rows in TABLES.values()]
        self.cdf = []
        for rows in TABLES.values():
            p = torch.arange(1, rows + 1, dtype=torch.float64).pow(-ZIPF).cumsum(0)
            self.cdf.append(p / p[-1])
        self.dense = torch.randn(DENSE, generator=g) * 0.2
        p = torch.arange(1, STREAM_HEAD + STREAM_WINDOW + 1, dtype=torch.float64).pow(-ZIPF).cumsum(0)
        self.stream_cdf = p / p[-1]

    def batch(self, gen: torch.Generator, size: int = BATCH, step: int | None = None) -> Batch:
        """``size`` clicks; with ``step``, drawn from that step's stream (see :meth:`stream_ids`)."""
        ids = []
        for by_rank, cdf in zip(self.ids_by_rank, self.cdf):
            u = torch.rand(size * BAG, generator=gen, dtype=torch.float64)
            if step is None:
                rank = torch.searchsorted(cdf, u).clamp_(max=len(cdf) - 1)
            else:
                rank = self.stream_ids(torch.searchsorted(self.stream_cdf, u), step, len(by_rank))
            ids.append(by_rank[rank].view(size, BAG))
        dense = torch.randn(size, DENSE, generator=gen)
        clicks = torch.bernoulli(torch.sigmoid(2.0 * self.logit(ids, dense)), generator=gen)
        return Batch(ids, dense, clicks)

    @staticmethod
    def stream_ids(rank: torch.Tensor, step: int, rows: int) -> torch.Tensor:
        """--stream: the popularity ``rank`` (0: the most popular) of a draw at ``step`` as a
        position in a table's ids by popularity: the head's ranks are themselves; window rank j
        is position ``STREAM_HEAD + (step * STREAM_DRIFT + STREAM_WINDOW - 1 - j) % (rows -
        STREAM_HEAD)``, so a position enters the window as its rank 0 and leaves it
        ``STREAM_WINDOW / STREAM_DRIFT`` steps later (after wrapping round, it comes back)."""
        rank = rank.clamp(max=STREAM_HEAD + STREAM_WINDOW - 1)
        j = rank - STREAM_HEAD
        moved = STREAM_HEAD + (step * STREAM_DRIFT + STREAM_WINDOW - 1 - j) % (rows - STREAM_HEAD)
        return torch.where(j >= 0, moved, rank)

    def logit(self, ids: list[torch.Tensor], dense: torch.Tensor, sparse: bool = True) -> torch.Tensor:
        out = dense @ self.dense
        if sparse:
            out = out + sum(w[i].mean(1) for w, i in zip(self.rows, ids))
        return out


class Dense(nn.Module):
    """Bottom MLP on the dense features, top MLP on [bottom, pooled embeddings]."""

    def __init__(self) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(DENSE, DIM), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(DIM * (len(TABLES) + 1), 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
        return self.top(torch.cat([self.bottom(dense), *pooled], dim=1)).squeeze(1)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: the chance that a random click scores above a random non-click
    (ties count one half); NaN when ``labels`` hold one class only.

    Example::

        >>> auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0., 0., 1., 1.]))
        0.75
    """
    scores = scores.double()
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    uniq, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    # a score's rank is the mean of the ranks its ties share
    mean_rank = counts.cumsum(0).double() - (counts.double() - 1) / 2
    ranks = mean_rank[inverse]
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def train(args: argparse.Namespace) -> dict[str, Any]:
    """One trainer's run: train ``args.steps`` steps, then score held-out clicks; the figures
    the summary prints (see :func:`summary`) plus the loss and progressive-AUC curves."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from remote_module.ps import ShardedEmbeddingBag, ShardedEmbeddingBagCollection, prefetching

    me = current_worker()
    # the setup is the same on every trainer: trainer0 tells it, once
    lead = me.role_rank == 0
    if lead:
        say(f"forming the trainers' DDP group ({plural(me.role_size, 'trainer')})")
    init_role_process_group(me)
    servers = me.workers("ps")
    torch.manual_seed(0)  # the same dense initialisation on every trainer (DDP checks it anyway)
    # (the process's first torch.optim optimizer imports torch._dynamo, a few seconds once per
    # process: said here, not taken for the first table's creation, whose ps_optimizer makes one)
    with still("building the dense model and its optimizer (torch.optim's first use imports torch._dynamo)",
               quiet=not lead):
        dense = DDP(Dense())
        opt = torch.optim.Adam(dense.parameters(), lr=0.003)
        truth = Truth()
    # geo: a trainer pushes every cached row's delta each geo_push_every steps
    # --stream, --admit-after, --evict-after-steps: lazy tables (a row stored once admitted)
    lifetime = rows_lifetime(args)
    kwargs: dict[str, Any] = {}
    if lifetime:
        kwargs = {"init": "lazy", "admit_after": args.admit_after, "evict_after_steps": args.evict_after_steps}
        if args.admit_after > 1:
            kwargs["admit_sketch_bytes"] = ADMIT_SKETCH_BYTES
    tables = {}
    for t, (name, rows) in enumerate(TABLES.items()):
        lazy = " (lazy)" if lifetime else ""
        with still(f"creating table {name} ({rows:,} rows x {DIM}){lazy} on {plural(len(servers), 'server')}",
                   quiet=not lead):
            tables[name] = ShardedEmbeddingBag(
                rows, DIM, servers, name=f"dlrm.{name}", mode="mean", ps_mode=args.mode, num_trainers=me.role_size,
                optimizer=(torch.optim.Adagrad, {"lr": 0.3}), min_block_size=4096, geo_push_every=GEO_PUSH_EVERY,
                seed=t,
                **kwargs)
    # the tables looked up together (one message per server) and stepped together
    ebc = ShardedEmbeddingBagCollection(tables)
    gen = torch.Generator().manual_seed(100 + me.role_rank)
    if lead:
        say(f"training {args.steps} steps of {BATCH} clicks per trainer ({args.mode} mode)")
    _trainers_barrier()  # every setup line is out before the bars draw (they share the terminal)
    bar = _progress(args.steps, me, args.progress, getattr(args, "terminal_lock", None))
    # without a bar on screen (no terminal, --no-progress, no tqdm), a line every few seconds
    plain_every = PLAIN_PROGRESS_EVERY if bar_hidden(bar) else None
    last_line = time.monotonic()
    latencies: list[float] = []
    losses: list[float] = []
    recent: deque = deque(maxlen=WINDOW)
    auc_curve: list[tuple[int, float]] = []
    # trainer0 samples the servers' rows every `every` steps (none in a plain run)
    held = RowsHeld(tables.values(), args.steps) if lifetime and me.role_rank == 0 else None
    drawn: list[list[torch.Tensor]] = [[] for _ in TABLES] if lifetime else []  # ids drawn, per table
    stream = getattr(args, "stream", False)
    # the bytes this trainer's calls carry, each way, from here until its last push landed
    with Traffic() as traffic:
        start = time.perf_counter()
        # batch k + 1's lookups are planned during batch k and sent with its ebc.step(): one message
        # per server per step, answered once the servers applied the step (the same results)
        # (--overlap: async modes, lookups one step further ahead: a read misses this trainer's last push)
        batches = prefetching((truth.batch(gen, step=k if stream else None) for k in range(args.steps)), ebc,
                              features=lambda b: dict(zip(TABLES, b.ids)),
                              overlap=getattr(args, "overlap", False))
        for step, batch in enumerate(batches, 1):
            t0 = time.perf_counter()
            out = ebc(dict(zip(TABLES, batch.ids)))
            latencies.append(time.perf_counter() - t0)
            if held is not None and (step - 1) % held.every == 0 and step > 1:
                held.sample(step - 1)  # (the last step landed: the forward waited for its answer)
            for seen, ids in zip(drawn, batch.ids):
                seen.append(ids.unique())
            scores = dense(batch.dense, [out[name] for name in TABLES])
            loss = nn.functional.binary_cross_entropy_with_logits(scores, batch.clicks)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ebc.step()  # every table's touched rows (and the next batch's lookups), one message per server
            losses.append(loss.item())
            recent.append((scores.detach(), batch.clicks))
            if step % 5 == 0 or step == args.steps:
                auc_curve.append((step, auc(torch.cat([s for s, _ in recent]), torch.cat([c for _, c in recent]))))
                bar.set_postfix(loss=f"{losses[-1]:.3f}", train_auc=f"{auc_curve[-1][1]:.3f}", refresh=False)
            bar.update(1)
            if plain_every is not None and time.monotonic() - last_line >= plain_every:
                last_line = time.monotonic()
                auc_text = f", training AUC (last {WINDOW} batches) {auc_curve[-1][1]:.3f}" if auc_curve else ""
                say(f"{me.name}: step {step}/{args.steps}, loss {losses[-1]:.3f}{auc_text}")
        ebc.flush()  # the last step's pushes landed
    if held is not None:
        held.sample(args.steps)
    elapsed = time.perf_counter() - start - (held.seconds if held is not None else 0.0)
    to_servers = sum(traffic.sent[s] for s in servers)
    from_servers = sum(traffic.received[s] for s in servers)
    messages = sum(traffic.messages[s] for s in servers)
    per_server = {server: dict(t) for server, t in sorted(ebc.traffic.items())}
    _close_in_order(bar, me)
    say(f"{me.name}: {args.steps} steps done; scoring {EVAL} held-out clicks")
    # --stream: held-out clicks of the step after the last (the ids in use now)
    held_out = truth.batch(torch.Generator().manual_seed(999), EVAL, step=args.steps if stream else None)
    with torch.no_grad():
        out = ebc(dict(zip(TABLES, held_out.ids)))
        scores = dense.module(held_out.dense, [out[name] for name in TABLES])
    lat = torch.tensor(latencies, dtype=torch.float64)
    k = max(1, len(losses) // 10)
    return {
        "trainer": me.name,
        "steps": args.steps,
        "loss_first": sum(losses[:k]) / k,  # mean of the first tenth of the steps
        "loss_last": sum(losses[-k:]) / k,  # ... and of the last tenth
        "auc": auc(scores, held_out.clicks),  # held out
        "auc_train": auc_curve[-1][1],  # progressive: the last WINDOW batches, each scored before it trained
        "auc_truth": auc(truth.logit(held_out.ids, held_out.dense), held_out.clicks),
        "auc_truth_dense_only": auc(truth.logit(held_out.ids, held_out.dense, sparse=False), held_out.clicks),
        "steps_per_s": args.steps / elapsed,
        "lookups_per_s": args.steps * BATCH * BAG * len(TABLES) / float(lat.sum()),
        "bytes_pushed_per_step": sum(t.pushed_bytes for t in tables.values()) / args.steps,
        # measured: the RPC payload of this trainer's calls to the servers and of their answers
        # (rpc_backend.traffic.Traffic), per training step, heartbeats left out
        "bytes_to_servers_per_step": to_servers / args.steps,
        "bytes_from_servers_per_step": from_servers / args.steps,
        "messages_to_servers_per_step": messages / args.steps,
        "lookup_p50_ms": float(lat.quantile(0.5)) * 1e3,
        "lookup_p99_ms": float(lat.quantile(0.99)) * 1e3,
        # per server: messages per training step, and ids looked up / rows pushed per second
        "per_server": {server: {"messages_per_step": t["messages"] / args.steps,
                                "ids_per_s": t["ids_looked_up"] / elapsed,
                                "rows_pushed_per_s": t["rows_pushed"] / elapsed}
                       for server, t in per_server.items()},
        "losses": losses,
        "auc_curve": auc_curve,
        # with --stream, --admit-after or --evict-after-steps: the distinct ids this trainer drew
        # (all tables); trainer0 also: the rows on the servers (see RowsHeld.figures)
        **({"distinct_ids": sum(int(torch.cat(seen).unique().numel()) for seen in drawn)} if lifetime else {}),
        **(held.figures() if held is not None else {}),
    }


def rows_lifetime(args: argparse.Namespace) -> bool:
    """Whether the run watches its rows' lifetime (--stream, --admit-after > 1 or
    --evict-after-steps): lazy tables, table_stats() samples."""
    return (getattr(args, "stream", False) or getattr(args, "admit_after", 1) > 1
            or getattr(args, "evict_after_steps", None) is not None)


class RowsHeld:
    """The rows the servers hold, sampled with ``table_stats()`` every ``every`` steps (about
    ``STATS_SAMPLES`` samples a run, each a round trip per table per server), summed over the
    tables per server."""

    def __init__(self, tables: Any, steps: int) -> None:
        self.tables = list(tables)
        self.every = max(1, steps // STATS_SAMPLES)
        self.curve: list[tuple[int, dict[str, int]]] = []  # (steps done, {server: rows held})
        self.last: dict[str, dict[str, float]] = {}  # per server: the last sample's figures
        self.seconds = 0.0  # spent sampling

    def sample(self, step: int) -> None:
        t0 = time.perf_counter()
        per_server: dict[str, dict[str, float]] = {}
        for table in self.tables:
            for server, got in table.table_stats()["per_server"].items():
                mine = per_server.setdefault(server, dict.fromkeys(
                    ("rows_held", "rows_admitted", "rows_evicted", "bytes", "steps", "longest_eviction_pause_s"), 0))
                for key in ("rows_held", "rows_admitted", "rows_evicted", "bytes"):
                    mine[key] += got[key]
                mine["steps"] = max(mine["steps"], got["steps"])  # (each table's own steps; the most)
                mine["longest_eviction_pause_s"] = max(mine["longest_eviction_pause_s"],
                                                       got["longest_eviction_pause_s"])
        self.seconds += time.perf_counter() - t0
        self.curve.append((step, {server: int(f["rows_held"]) for server, f in sorted(per_server.items())}))
        self.last = dict(sorted(per_server.items()))

    def figures(self) -> dict[str, Any]:
        """``rows_held_curve``: [(steps done, {server: rows held})]; ``rows``: per server, rows
        held first, last and max, rows admitted and evicted, bytes, the table's steps and the
        longest eviction pause (seconds) at the last sample; ``stats_every`` and
        ``stats_ms``: the steps between samples, the mean milliseconds a sample took."""
        rows = {}
        for server, last in self.last.items():
            held = [h[server] for _, h in self.curve if server in h]
            rows[server] = {"held_first": held[0], "held_last": held[-1], "held_max": max(held),
                            "admitted": int(last["rows_admitted"]), "evicted": int(last["rows_evicted"]),
                            "bytes": int(last["bytes"]), "steps": int(last["steps"]),
                            "longest_eviction_pause_s": float(last["longest_eviction_pause_s"])}
        return {"rows_held_curve": self.curve, "rows": rows, "stats_every": self.every,
                "stats_ms": self.seconds / max(1, len(self.curve)) * 1e3}


def _progress(total: int, me: Worker, enabled: bool, lock_path: str | None = None) -> Any:
    """A tqdm bar on this trainer's own line: the trainers on one machine share its terminal,
    so the line is this trainer's index among them, and their bars write under one lock
    (``lock_path``'s, see :class:`~remote_module.demos.progress.TerminalLock`). Off (or no
    tqdm) when stderr is no terminal."""
    first_here = me.rank - me.local_rank  # launchers give a machine's ranks consecutive numbers
    line = sum(1 for p in me.layout[first_here:me.rank] if p.role == me.role)
    return progress_bar(total, enabled, lock_path=lock_path, desc=me.name, position=line, unit="step", leave=True,
                        dynamic_ncols=True)


def _trainers_barrier() -> None:
    """Wait for every trainer (over the trainers' process group)."""
    import torch.distributed as dist

    dist.barrier()


def _close_in_order(bar: Any, me: Worker) -> None:
    """Close the trainers' bars one by one in rank order: tqdm writes a closing bar on the line
    the terminal's cursor is on (the first bar's), then a newline, so closing the top bar first
    leaves the bars in order."""
    import torch.distributed as dist

    for rank in range(me.role_size):
        if rank == me.role_rank:
            bar.close()
        dist.barrier()  # over the trainers' process group


def _rank(args: argparse.Namespace) -> dict[str, Any] | None:
    # Ranks sharing a machine's cores: more intra-op threads than cores per rank only spin
    # (OpenMP waits busily after each parallel op) and slow down the other ranks' RPCs.
    torch.set_num_threads(args.threads)
    me = current_worker()
    if me.role == "ps":
        return None  # serves the tables' blocks; under torchrun the servers print nothing
    result = train(args)
    say(f"{me.name}: finished; waiting for every rank to finish")
    return result


def say(text: str) -> None:
    """One progress line on stdout, right away, in one write (ranks share the terminal, and
    ``print`` writes the line's end separately)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def plural(count: int, word: str) -> str:
    """``"1 trainer"``, ``"2 trainers"``."""
    return f"{count:,} {word}{'' if count == 1 else 's'}"


@contextmanager
def still(text: str, every: float = PLAIN_PROGRESS_EVERY, quiet: bool = False) -> Iterator[None]:
    """Say ``text`` now, then ``text (still, N s)`` every ``every`` seconds until the block ends
    (``quiet``: say nothing)."""
    if quiet:
        yield
        return
    say(text)
    done = threading.Event()
    start = time.monotonic()

    def remind() -> None:
        while not done.wait(every):
            say(f"{text} (still, {time.monotonic() - start:.0f} s)")

    thread = threading.Thread(target=remind, name="dlrm-demo-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def summary(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The table printed at the end: one line per trainer (the dict :func:`train` returns)."""
    sizes = " + ".join(f"{name} {rows:,}" for name, rows in TABLES.items())
    table_mb = sum(TABLES.values()) * DIM * 4 / 1e6
    if rows_lifetime(args):  # lazy: what the servers held, not what eager tables would
        held = next((r["rows"] for r in results if "rows" in r), None)
        held_text = ("" if held is None else
                     f"; at the end the servers held {sum(f['bytes'] for f in held.values()) / 1e6:.2f} MB: rows, "
                     "their optimizer state and bookkeeping")
        size = f"lazy: rows created as admitted{held_text}; eager, their weights alone would take {table_mb:.1f} MB"
    else:
        size = f"{table_mb:.1f} MB of weights"
    lines = [
        run_title(args, len(results)),
        f"tables: {sizes} rows x {DIM} floats ({size}), sliced over the servers",
        *_lifetime_lines(args),
        "",
        f"{'trainer':<10}{'loss first -> last':>19}{'train AUC':>11}{'held-out AUC':>14}{'steps/s':>9}"
        f"{'lookups/s':>11}{'pushed B/step':>15}{'p50 ms':>8}{'p99 ms':>8}",
    ]
    for r in results:
        lines.append(
            f"{r['trainer']:<10}{r['loss_first']:>10.3f} -> {r['loss_last']:<5.3f}{r['auc_train']:>11.3f}"
            f"{r['auc']:>14.3f}{r['steps_per_s']:>9.1f}{r['lookups_per_s']:>11,.0f}"
            f"{r['bytes_pushed_per_step']:>15,.0f}{r['lookup_p50_ms']:>8.2f}{r['lookup_p99_ms']:>8.2f}"
        )
    if results:
        r = results[0]
        if args.mode == "geo":
            pushes = ("geo: a trainer trains its cached rows itself; its steps send the next batch's lookups of the "
                      f"rows it has not cached, and every {GEO_PUSH_EVERY} steps (and at the end) the deltas of "
                      "the rows it trained since")
            pushed = "bytes of row deltas (ids and values) sent to the servers, per training step on average"
        else:
            pushes = "a step sends its pushes and the next batch's lookups together"
            pushed = ("bytes of gradients sent to the servers per step (the tables' pooled bags' gradient with the "
                      "lookup's ids, which the servers sum into rows)")
        lines += [
            "",
            f"train AUC: of the last {WINDOW} training batches, each scored before it was trained on. held-out AUC: "
            f"on {EVAL} held-out clicks; the hidden truth scores {r['auc_truth']:.3f} on them, "
            f"its dense features alone {r['auc_truth_dense_only']:.3f}.",
            f"lookups/s: ids looked up per second spent in the forward of the {len(TABLES)} tables; p50/p99: that "
            f"forward ({BATCH} bags of {BAG} ids per table), which waits for the lookups the last step sent.",
            f"pushed B/step: {pushed}.",
            "",
            f"per server ({r['trainer']}'s traffic; {pushes}):",
            f"{'server':<10}{'messages/step':>15}{'ids looked up/s':>17}{'rows pushed/s':>15}",
        ]
        for server, t in r.get("per_server", {}).items():
            lines.append(f"{server:<10}{t['messages_per_step']:>15.2f}{t['ids_per_s']:>17,.0f}"
                         f"{t['rows_pushed_per_s']:>15,.0f}")
    lines += _network_lines(results)
    lines += _rows_held_lines(results)
    return "\n".join(lines)


#: what the network lines of the summary count, in words
NETWORK_COUNTED = ("RPC payload: each message's pickle and tensor bytes, counted at the trainers' calls as sent and "
                   "as answered; not counted: TensorPipe's framing, TCP/IP headers and acknowledgements, "
                   "rpc_backend's heartbeats, DDP's all-reduce among the trainers")


def _network_lines(results: list[dict[str, Any]]) -> list[str]:
    """The summary's bytes per training step each way, per trainer and for all of them, and
    the rate they make at each trainer's steps/s: what the job's network must carry."""
    if not results:
        return []
    lines = [
        "",
        f"network between trainers and servers, per training step ({NETWORK_COUNTED}); MB/s: bytes per step x "
        "steps/s:",
        f"  {'trainer':<14}{'to servers B':>14}{'from servers B':>16}{'messages':>10}{'to MB/s':>9}{'from MB/s':>11}",
    ]
    rows = [(r["trainer"], r["bytes_to_servers_per_step"], r["bytes_from_servers_per_step"],
             r["messages_to_servers_per_step"], r["steps_per_s"]) for r in results]
    if len(rows) > 1:
        rows.append(("all trainers", sum(row[1] for row in rows), sum(row[2] for row in rows),
                     sum(row[3] for row in rows), None))
    for name, to, back, messages, rate in rows:
        if rate is None:  # all trainers: each at its own rate
            to_rate = sum(r[1] * r[4] for r in rows[:-1]) / 1e6
            back_rate = sum(r[2] * r[4] for r in rows[:-1]) / 1e6
        else:
            to_rate, back_rate = to * rate / 1e6, back * rate / 1e6
        # (indented: the lines that start with a trainer's name are the main table's)
        lines.append(f"  {name:<14}{to:>14,.0f}{back:>16,.0f}{messages:>10.2f}{to_rate:>9.2f}{back_rate:>11.2f}")
    return lines


def _lifetime_lines(args: argparse.Namespace) -> list[str]:
    """The summary's lines on --stream, --admit-after and --evict-after-steps (none without)."""
    if not rows_lifetime(args):
        return []
    lines = []
    if getattr(args, "stream", False):
        lines.append(f"ids: --stream: each table's {STREAM_HEAD} most popular ids all run long, the others from a "
                     f"window of {STREAM_WINDOW:,} ids sliding {STREAM_DRIFT} ids a step (new ids enter popular, "
                     "fade, stop)")
    admit_after, evict_after = getattr(args, "admit_after", 1), getattr(args, "evict_after_steps", None)
    admit = (f"a row stored once its id was looked up in {admit_after} of its table's steps"
             if admit_after > 1 else "a row stored at its id's first step")
    evict = ("never evicted" if evict_after is None else f"evicted after {evict_after} of its table's steps unstepped")
    lines.append(f"rows: lazy tables, {admit}, {evict}")
    return lines


def _rows_held_lines(results: list[dict[str, Any]]) -> list[str]:
    """The summary's rows held per server (from the trainer that sampled them; none without)."""
    r = next((r for r in results if "rows" in r), None)
    if r is None:
        return []
    rows = r["rows"]
    curve = r["rows_held_curve"]
    lines = [
        "",
        f"rows held per server, all {len(TABLES)} tables (table_stats() sampled by {r['trainer']} every "
        f"{plural(r['stats_every'], 'training step')}, from step {curve[0][0]} to {curve[-1][0]} as on the PNG's "
        f"step axis, {r['stats_ms']:.1f} ms a sample; table steps: the tables' own steps on the server by the end, "
        "which --evict-after-steps counts (sync: one per training step; async: one per trainer's push; "
        "half_async: one per merge); MB: rows, optimizer state, bookkeeping and admission sketch):",
        f"{'server':<10}{'table steps':>13}{'held first':>12}{'last':>9}{'max':>9}{'admitted':>10}{'evicted':>9}"
        f"{'MB':>7}{'longest eviction pause ms':>27}",
    ]
    for server, f in rows.items():
        lines.append(f"{server:<10}{f['steps']:>13,}{f['held_first']:>12,}{f['held_last']:>9,}{f['held_max']:>9,}"
                     f"{f['admitted']:>10,}{f['evicted']:>9,}{f['bytes'] / 1e6:>7.2f}"
                     f"{f['longest_eviction_pause_s'] * 1e3:>27.2f}")
    first, last = (sum(curve[i][1].values()) for i in (0, -1))
    lines.append(f"{'total':<10}{'':>13}{first:>12,}{last:>9,}{max(sum(h.values()) for _, h in curve):>9,}"
                 f"{sum(f['admitted'] for f in rows.values()):>10,}{sum(f['evicted'] for f in rows.values()):>9,}"
                 f"{sum(f['bytes'] for f in rows.values()) / 1e6:>7.2f}")
    drawn = "; ".join(f"{x['trainer']} {x['distinct_ids']:,}" for x in results if "distinct_ids" in x)
    lines.append(f"distinct ids drawn over the run, all tables: {drawn}")
    return lines


def plot(results: list[dict[str, Any]], path: str, title: str | None = None) -> str | None:
    """Write the loss and progressive-AUC curves to ``path`` (PNG), and the rows held per
    server over the run when they were sampled, every panel over the training steps, under
    ``title`` (:func:`run_title`); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    curve = next((r["rows_held_curve"] for r in results if r.get("rows_held_curve")), None)
    if curve is None:
        fig, (loss_ax, auc_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    else:
        fig, (loss_ax, auc_ax, rows_ax) = plt.subplots(1, 3, figsize=(15, 3.8))
        steps = [step for step, _ in curve]
        for server in curve[-1][1]:
            rows_ax.plot(steps, [held.get(server, 0) for _, held in curve], label=server, marker=".")
        rows_ax.set(xlabel="training step", ylabel="rows held (all tables)", title="rows held per server")
        rows_ax.set_ylim(bottom=0)
        rows_ax.legend()
    for r in results:
        loss_ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["trainer"], linewidth=0.8)
        steps, aucs = zip(*r["auc_curve"]) if r["auc_curve"] else ((), ())
        auc_ax.plot(steps, aucs, label=f"{r['trainer']} (held out: {r['auc']:.3f})")
    if results:
        auc_ax.axhline(results[0]["auc_truth"], color="grey", linestyle="--", label="hidden truth")
        auc_ax.axhline(results[0]["auc_truth_dense_only"], color="grey", linestyle=":", label="truth, dense only")
    loss_ax.set(xlabel="training step", ylabel="loss (binary cross-entropy)", title="training loss")
    auc_ax.set(xlabel="training step", ylabel="AUC", title=f"training AUC (last {WINDOW} batches) and held-out AUC")
    loss_ax.legend()
    auc_ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def run_title(args: argparse.Namespace, trainers: int) -> str:
    """The run in a line: what the summary's first line and the PNG's title say."""
    return (f"DLRM click model: {plural(args.servers, 'parameter server')}, {plural(trainers, 'trainer')}, "
            f"mode {args.mode}, {args.steps} steps of {BATCH} clicks per trainer")


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (argparse exits with a message naming the bad option)."""
    parser = argparse.ArgumentParser(prog="python -m remote_module.demos.dlrm",
                                     description="Train a small DLRM-style click model on parameter servers.")
    parser.add_argument("--mode", choices=MODES, default="async", help="parameter-server mode (default: async)")
    parser.add_argument("--servers", type=_at_least_one, default=2, help="parameter servers (default: 2)")
    parser.add_argument("--trainers", type=_at_least_one, default=None,
                        help="trainers (default: 2; under torchrun: the other ranks, WORLD_SIZE - servers)")
    parser.add_argument("--steps", type=_at_least_one, default=150, help="training steps per trainer (default: 150)")
    parser.add_argument("--threads", type=_at_least_one, default=None,
                        help="torch threads per rank (default: this machine's cores / its ranks, at least 1)")
    parser.add_argument("--transport", choices=TRANSPORTS, default=DEFAULT_TRANSPORT,
                        help="TensorPipe transport: uv sleeps when idle, shm (torch's defaults) busy-polls "
                             "(default: %(default)s)")
    parser.add_argument("--overlap", action="store_true",
                        help="async and half_async: send each batch's lookups one step earlier, so they overlap the "
                             "previous batch's compute (a read then misses this trainer's last push)")
    parser.add_argument("--stream", action="store_true",
                        help=f"ids drift over time: each table's {STREAM_HEAD} most popular ids stay, the others come "
                             f"from a window of {STREAM_WINDOW:,} ids sliding {STREAM_DRIFT} ids a step (new ids "
                             "appear, old ones stop); the held-out clicks are drawn where the stream ends")
    parser.add_argument("--admit-after", type=_at_least_one, default=1, metavar="K",
                        help="store a row only once its id was looked up in K of its table's steps (default: 1, "
                             "the first)")
    parser.add_argument("--evict-after-steps", type=_at_least_one, default=None, metavar="N",
                        help="drop a row not stepped in N of its table's steps (a table's step: sync, one per "
                             "training step; async, one per trainer's push; half_async, one per merge; default: never)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    parser.add_argument("--plot", default="dlrm-demo.png", metavar="PNG",
                        help="where to write the loss/AUC curves, and rows held (needs matplotlib; '' for none; "
                             "default: %(default)s)")
    parser.add_argument("--json", default="", metavar="PATH",
                        help="also write every trainer's figures to PATH as JSON: the summary's, each step's loss "
                             "and the training AUC curve, at full precision (under torchrun: by trainer0)")
    parser.epilog = ("With --stream, --admit-after above 1 or --evict-after-steps the tables are lazy "
                     "(init='lazy': a row is created when admitted, not up front), and trainer0 samples "
                     f"table_stats() about {STATS_SAMPLES} times: the summary and PNG show the rows each server "
                     "holds over the run.")
    args = parser.parse_args(argv)
    if args.mode == "geo" and (args.admit_after > 1 or args.evict_after_steps is not None):
        parser.error("--admit-after and --evict-after-steps are for --mode sync, async or half_async (geo trainers "
                     "train their rows locally and push deltas)")
    from remote_module.ps import MAX_ADMIT_AFTER

    if args.admit_after > MAX_ADMIT_AFTER:
        parser.error(f"argument --admit-after: must be at most {MAX_ADMIT_AFTER}, got {args.admit_after}")
    if args.overlap and args.mode not in ("async", "half_async"):
        parser.error(f"--overlap is for --mode async or half_async (a {args.mode} lookup cannot be sent a step early)")
    args.torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.torchrun:
        world = read_env()["world_size"]
        if args.servers >= world:
            parser.error(f"--servers {args.servers} leaves no trainer among torchrun's {world} processes: "
                         f"pass --servers below {world}, or start more processes (--nproc-per-node, --nnodes)")
        if args.trainers is not None and args.trainers != world - args.servers:
            parser.error(f"--trainers {args.trainers} does not match torchrun's {world} processes minus "
                         f"--servers {args.servers}; leave --trainers out under torchrun")
        args.trainers = world - args.servers
    elif args.trainers is None:
        args.trainers = 2
    if args.threads is None:
        here = int(os.environ.get("LOCAL_WORLD_SIZE", args.servers + args.trainers))
        args.threads = max(1, (os.cpu_count() or 1) // here)
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the demo; returns each trainer's figures (the dicts :func:`train` returns, in trainer
    order; under torchrun on trainer0 only, ``[]`` on the other ranks).

    Example::

        results = main(["--steps", "50", "--no-progress", "--plot", ""])
        results[0]["auc"], results[0]["steps_per_s"]
    """
    args = parse_args(argv)
    if args.torchrun:
        with init_from_env(roles={"ps": args.servers, "trainer": args.trainers}, transport=args.transport):
            mine = _rank(args)
            results = _gather(mine)
    else:
        print(f"Starting a local RPC world on loopback: {plural(args.servers, 'server')}, "
              f"{plural(args.trainers, 'trainer')}...", flush=True)
        # the trainers' bars share this terminal: they write under one lock (a file's)
        lock = tempfile.NamedTemporaryFile(prefix="dlrm-demo-bars-", suffix=".lock")
        args.terminal_lock = lock.name
        with lock:
            out = run_local(_rank, args.servers + args.trainers,
                            roles={"ps": args.servers, "trainer": args.trainers}, args=(args,), timeout=900,
                            progress=lambda message: say(f"  {message}"), transport=args.transport)
        results = [r for r in out if r is not None]
    if not results:
        return []
    print("\n" + summary(results, args), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"every trainer's figures (each step's loss, the AUC curves): {args.json}", flush=True)
    if args.plot:
        written = plot(results, args.plot, run_title(args, len(results)))
        rows = ", rows held per server" if any("rows_held_curve" in r for r in results) else ""
        print(f"loss and AUC curves{rows}: {written}" if written
              else "(install matplotlib, e.g. the project's `plot` extra, for a PNG of the loss and AUC curves)")
    return results


def _gather(mine: dict[str, Any] | None) -> list[dict[str, Any]]:
    """torchrun: every trainer's figures on trainer0 (over the trainers' process group), so one
    summary is printed and one PNG written; ``[]`` on the servers and the other trainers."""
    if mine is None:
        return []
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone if dist.get_rank() == 0 else []


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: run_local has stopped the ranks; one line, no traceback
        print("\ninterrupted", file=sys.stderr, flush=True)
        sys.exit(130)
