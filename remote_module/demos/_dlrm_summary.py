"""What the DLRM demo shows at the end (``remote_module/demos/dlrm.py``): the summary table
(:func:`summary`), the network and rows-held lines, and the PNG of its curves (:func:`plot`)."""

from __future__ import annotations

import argparse
from typing import Any

from remote_module.demos._dlrm_model import (
    BAG,
    BATCH,
    DIM,
    EVAL,
    GEO_PUSH_EVERY,
    STREAM_DRIFT,
    STREAM_HEAD,
    STREAM_WINDOW,
    TABLES,
    WINDOW,
    plural,
    rows_lifetime,
)


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
    lines += _checkpoint_lines(results)
    return "\n".join(lines)


def _checkpoint_lines(results: list[dict[str, Any]]) -> list[str]:
    """With --checkpoint: the saves, their size and time (the first trainer's: it saves the tables)."""
    figures = results[0].get("checkpoints") if results else None
    if not figures:
        return []
    per_save = figures["save_s"] / figures["saves"] if figures["saves"] else 0.0
    size = f"{figures['bytes'] / 1e6:.1f} MB each" if figures["bytes"] is not None else "none complete"
    resumed = f"resumed from step {figures['resumed_from']}; " if figures["resumed_from"] else ""
    written = (f"; the servers wrote the newest one's tables in {figures['write_s']:.2f} s in the background"
               if figures.get("write_s") is not None else "")
    if figures.get("incremental"):
        size = f"{figures['incremental']} of them incremental; the newest {figures['bytes'] / 1e6:.1f} MB" \
            if figures["bytes"] is not None else f"{figures['incremental']} of them incremental; none complete"
    return ["", f"checkpoints: {resumed}{plural(figures['saves'], 'save')}, {size}, training waited "
                f"{per_save:.3f} s per save on {results[0]['trainer']} (for the servers' snapshot and its own "
                f"file){written}; only a manifest and settings pass through the trainer"]


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

