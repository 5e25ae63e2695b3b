"""What a trainer of the DLRM demo measures (``remote_module/demos/dlrm.py``): its curves as
it trains (:class:`Curves`), the rows the servers hold (:class:`RowsHeld`), the held-out AUCs
(:class:`HeldOut`) and the dict of figures a trainer returns (:func:`figures`)."""

from __future__ import annotations

import argparse
import time
from collections import deque
from typing import Any, NamedTuple

import torch

from remote_module.demos._dlrm_model import BAG, BATCH, EVAL, STATS_SAMPLES, TABLES, WINDOW, Batch, Truth, auc
from rpc_backend import Traffic, Worker


class Curves:
    """What a trainer records as it trains: each forward's lookup latency, each step's loss,
    the progressive AUC (each batch scored before it is trained on) and, when the run watches
    its rows' lifetime, the ids drawn per table."""

    def __init__(self, lifetime: bool) -> None:
        self.latencies: list[float] = []
        self.losses: list[float] = []
        self.recent: deque = deque(maxlen=WINDOW)
        self.auc_curve: list[tuple[int, float]] = []
        self.drawn: list[list[torch.Tensor]] = [[] for _ in TABLES] if lifetime else []  # ids drawn, per table

    def timed_lookup(self, ebc: Any, batch: Batch) -> dict[str, torch.Tensor]:
        """The tables' forward on ``batch``, its latency recorded."""
        t0 = time.perf_counter()
        out = ebc(dict(zip(TABLES, batch.ids)))
        self.latencies.append(time.perf_counter() - t0)
        return out

    def note_ids(self, batch: Batch) -> None:
        """Keep ``batch``'s distinct ids per table (when the run watches its rows' lifetime)."""
        for seen, ids in zip(self.drawn, batch.ids):
            seen.append(ids.unique())

    def record(self, step: int, steps: int, scores: torch.Tensor, loss: torch.Tensor, batch: Batch) -> bool:
        """Record step ``step``'s loss and scores; whether the progressive AUC was scored now
        (every 5 steps, and at the last)."""
        self.losses.append(loss.item())
        self.recent.append((scores.detach(), batch.clicks))
        if step % 5 == 0 or step == steps:
            self.auc_curve.append((step, auc(torch.cat([s for s, _ in self.recent]),
                                             torch.cat([c for _, c in self.recent]))))
            return True
        return False


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


class HeldOut(NamedTuple):
    """The AUCs on the held-out clicks: the model's, the hidden truth's, and its dense part's."""

    auc: float
    auc_truth: float
    auc_truth_dense_only: float

    @classmethod
    def score(cls, truth: Truth, ebc: Any, dense: Any, step: int | None) -> HeldOut:
        """Score ``EVAL`` held-out clicks (--stream: of the step after the last, the ids in use now)."""
        held_out = truth.batch(torch.Generator().manual_seed(999), EVAL, step=step)
        with torch.no_grad():
            out = ebc(dict(zip(TABLES, held_out.ids)))
            scores = dense.module(held_out.dense, [out[name] for name in TABLES])
        return cls(auc(scores, held_out.clicks), auc(truth.logit(held_out.ids, held_out.dense), held_out.clicks),
                   auc(truth.logit(held_out.ids, held_out.dense, sparse=False), held_out.clicks))


def server_traffic(traffic: Traffic, servers: list[str]) -> tuple[int, int, int]:
    """The bytes this trainer's calls sent to the servers and got back, and its messages to them."""
    return (sum(traffic.sent[s] for s in servers), sum(traffic.received[s] for s in servers),
            sum(traffic.messages[s] for s in servers))


def figures(me: Worker, args: argparse.Namespace, tables: dict[str, Any], ebc: Any, traffic: tuple[int, int, int],
             curves: Curves, held_out: HeldOut, elapsed: float, held: RowsHeld | None) -> dict[str, Any]:
    """The dict :func:`train` returns (``traffic``: bytes to and from the servers, messages)."""
    to_servers, from_servers, messages = traffic
    per_server = {server: dict(t) for server, t in sorted(ebc.traffic.items())}
    lat = torch.tensor(curves.latencies, dtype=torch.float64)
    losses = curves.losses
    k = max(1, len(losses) // 10)
    return {
        "trainer": me.name,
        "steps": args.steps,
        "loss_first": sum(losses[:k]) / k,  # mean of the first tenth of the steps
        "loss_last": sum(losses[-k:]) / k,  # ... and of the last tenth
        "auc": held_out.auc,  # held out
        "auc_train": curves.auc_curve[-1][1],  # progressive: the last WINDOW batches, each scored before it trained
        "auc_truth": held_out.auc_truth,
        "auc_truth_dense_only": held_out.auc_truth_dense_only,
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
        "auc_curve": curves.auc_curve,
        # with --stream, --admit-after or --evict-after-steps: the distinct ids this trainer drew
        # (all tables); trainer0 also: the rows on the servers (see RowsHeld.figures)
        **({"distinct_ids": sum(int(torch.cat(seen).unique().numel()) for seen in curves.drawn)}
           if curves.drawn else {}),
        **(held.figures() if held is not None else {}),
    }
