"""What a table's rows cost its servers in memory (issue 45, item 3): resident memory per row's
bytes, and what makes it up.

    python -m tests.benchmarks.bench_table_memory            # 8,000,000 x 16 over 2 servers (about 1 minute)
    python -m tests.benchmarks.bench_table_memory --quick    # 400,000 x 16, not graded

An eager ``ShardedEmbeddingBag`` (float32, SGD, async) over ps0 and ps1, trained by one trainer
for a few hundred steps of 256 bags x 8 uniform ids. Each server's resident set (``VmRSS`` from
``/proc/self/status``, after ``malloc_trim``) is read before the table exists (after a warm-up
table with a block on each server, so the table code is loaded), once it is created, after the
steps, and after the table gave a delta (``delta_state_dict``, whole the first time: every
later delta follows it) and then a small one. The figures: the growth over the rows' own bytes
(``rows x dim x 4``, each server its share), while the table has never given a delta (target at
most 1.05) and once it has (at most 1.18). Then a lazy table of 100,000,000 rows, filled by
training to about ``lazy_fill`` rows held: resident bytes per row held, beside the bytes per
row the servers count (``table_stats()["bytes"]``: the rows' values, their optimizer state and
their bookkeeping, a row's stepped flag, version once kept and a lazy block's id-to-slot index;
not the storage grown by doubling ahead of the rows, nor the allocator's). Writes JSON
(bench-table-memory-results.json by default).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.rpc as rpc

from rpc_backend import current_worker
from tests.benchmarks._admission_hosts import server_memory, trimmed_rss
from tests.benchmarks._common import publish, run_world
from tests.benchmarks.bench_remote_module import _verdict

SERVERS = ["ps0", "ps1"]
FULL = {"rows": 8_000_000, "dim": 16, "bags": 256, "ids_per_bag": 8, "steps": 300, "lazy_rows": 100_000_000,
        "lazy_fill": 1_000_000, "seed": 0}
QUICK = {**FULL, "rows": 400_000, "steps": 20, "lazy_fill": 50_000}


def rss_bytes() -> int:
    """(On a server) this process's resident set, after handing freed heap back
    (``_admission_hosts.trimmed_rss``: what the process holds, not what its allocator keeps
    cached), or as it is where glibc's ``malloc_trim`` is missing."""
    trimmed = trimmed_rss()
    return server_memory()["VmRSS"] if trimmed is None else trimmed


def _rss() -> dict[str, int]:
    return {s: rpc.rpc_sync(s, rss_bytes) for s in SERVERS}


def _train(table: Any, cfg: dict, steps: int, high: int, gen: torch.Generator) -> None:
    for _ in range(steps):
        ids = torch.randint(0, high, (cfg["bags"] * cfg["ids_per_bag"],), generator=gen)
        offsets = torch.arange(0, ids.numel(), cfg["ids_per_bag"])
        table(ids, offsets).pow(2).sum().backward()
        table.step()
    table.flush()


def trainer_main(cfg: dict) -> dict:
    from remote_module.ps import ShardedEmbeddingBag

    sgd = (torch.optim.SGD, {"lr": 0.1})
    gen = torch.Generator().manual_seed(cfg["seed"])
    warm = ShardedEmbeddingBag(64, cfg["dim"], SERVERS, name="memory-warm-up", optimizer=sgd, mode="sum",
                               min_block_size=1)  # (a block on each server: the table code loaded there)
    _train(warm, cfg, 1, 64, gen)
    warm.delta_state_dict("warm-up")
    out: dict[str, Any] = {"config": cfg}
    before = _rss()
    table = ShardedEmbeddingBag(cfg["rows"], cfg["dim"], SERVERS, name="memory-eager", optimizer=sgd, mode="sum")
    created = _rss()
    _train(table, cfg, cfg["steps"], cfg["rows"], gen)
    trained = _rss()
    whole = table.delta_state_dict("bench")  # the first delta: the whole table
    del whole
    _train(table, cfg, 10, cfg["rows"], gen)
    small = table.delta_state_dict("bench")
    after_delta = _rss()
    row_bytes = cfg["dim"] * 4
    share = {s: c * row_bytes for s, (_, c) in zip(SERVERS, _shares(table))}
    out["eager"] = {
        "rss_MB": {"before": _mb(before), "created": _mb(created), "trained": _mb(trained),
                   "after_deltas": _mb(after_delta)},
        "rows_bytes_MB": {s: v / 2**20 for s, v in share.items()},
        "never_gave_a_delta": {s: (trained[s] - before[s]) / share[s] for s in SERVERS},
        "after_a_delta": {s: (after_delta[s] - before[s]) / share[s] for s in SERVERS},
        "small_delta_rows": int(small["ids"].numel()),
        "servers_count_bytes": {s: st["bytes"] for s, st in table.table_stats()["per_server"].items()},
    }
    del table
    lazy = ShardedEmbeddingBag(cfg["lazy_rows"], cfg["dim"], SERVERS, name="memory-lazy", optimizer=sgd, mode="sum",
                               init="lazy")
    lazy_before = _rss()
    steps = 0
    while _held(lazy) < cfg["lazy_fill"] and steps < 10 * cfg["lazy_fill"]:
        _train(lazy, cfg, 50, cfg["lazy_rows"], gen)
        steps += 50
    lazy_after = _rss()
    held = _held(lazy)
    counted = lazy.table_stats()["bytes"]
    grown = sum(lazy_after[s] - lazy_before[s] for s in SERVERS)
    out["lazy"] = {"rows_held": held, "steps": steps, "rss_growth_MB": grown / 2**20,
                   "rss_bytes_per_row": grown / held, "row_values_bytes": row_bytes,
                   "servers_count_bytes_per_row": counted / held}
    return out


def _shares(table: Any) -> list[tuple[str, int]]:
    """Each server's rows of an eager table: ``(server, rows)``."""
    per = table.table_stats()["per_server"]
    return [(s, per[s]["rows_held"]) for s in SERVERS]


def _held(table: Any) -> int:
    return table.table_stats()["rows_held"]


def _mb(d: dict[str, int]) -> dict[str, float]:
    return {k: v / 2**20 for k, v in d.items()}


def rank_main(cfg: dict) -> dict | None:
    if current_worker().role != "trainer":
        return None
    return trainer_main(cfg)


def ratios(r: dict) -> dict[str, float]:
    """The eager table's resident growth over its rows' bytes, the larger server's."""
    e = r["eager"]
    return {"eager SGD table, server RSS growth / rows' bytes, never gave a delta (target <= 1.05)":
            max(e["never_gave_a_delta"].values()),
            "eager SGD table, server RSS growth / rows' bytes, after deltas (target <= 1.18)":
            max(e["after_a_delta"].values())}


def report(r: dict) -> str:
    cfg, e, lz = r["config"], r["eager"], r["lazy"]
    lines = ["", f"eager table {cfg['rows']:,} x {cfg['dim']} float32, SGD, over {len(SERVERS)} servers; "
             f"{cfg['steps']} steps of {cfg['bags']} bags x {cfg['ids_per_bag']} ids",
             f"{'server':<8}{'rows MB':>10}{'RSS before':>12}{'created':>10}{'trained':>10}{'deltas':>10}"
             f"{'x rows, no delta (<= 1.05)':>30}{'x rows, after (<= 1.18)':>26}"]
    for s in SERVERS:
        rss = e["rss_MB"]
        lines.append(f"{s:<8}{e['rows_bytes_MB'][s]:>10.1f}{rss['before'][s]:>12.1f}{rss['created'][s]:>10.1f}"
                     f"{rss['trained'][s]:>10.1f}{rss['after_deltas'][s]:>10.1f}{e['never_gave_a_delta'][s]:>30.3f}"
                     f"{e['after_a_delta'][s]:>26.3f}")
    lines += [f"a delta after 10 more steps: {e['small_delta_rows']:,} rows",
              "", f"lazy table {cfg['lazy_rows']:,} rows x {cfg['dim']}, {lz['rows_held']:,} rows held after "
              f"{lz['steps']} steps: {lz['rss_bytes_per_row']:.1f} resident bytes per row held "
              f"({lz['row_values_bytes']} of them the row's values); the servers count "
              + f"{lz['servers_count_bytes_per_row']:.1f} bytes per row (values, bookkeeping, a lazy "
              "block's id-to-slot index), the rest is storage grown by doubling ahead of the rows and the "
              "allocator's", "", "ratios (the larger server's)"]
    width = max(map(len, r["ratios"]))
    lines += [f"  {name:<{width}}{v:>7.3f}{_verdict(name, v)}" for name, v in r["ratios"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    results, path = run_world(argv, "remote_module table memory benchmark", "bench-table-memory-results.json",
                              QUICK, FULL, rank_main, {"trainer": 1, "ps": 2})
    results["ratios"] = ratios(results)
    return publish(results, report(results), path)


if __name__ == "__main__":
    main()
