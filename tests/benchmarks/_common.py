"""What every benchmark's ``main`` does around its own measurements: the command line,
one OpenMP thread per spawned rank, interleaved timing rounds, and printing plus saving the
results."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from typing import Any, Callable, Iterator


def parse_args(description: str, default_json: str, argv: list[str] | None) -> argparse.Namespace:
    """``--quick`` (small sizes, for a smoke run) and ``--json PATH``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes (for a smoke run)")
    parser.add_argument("--json", default=default_json)
    return parser.parse_args(argv)


@contextlib.contextmanager
def one_thread_per_rank() -> Iterator[None]:
    """``OMP_NUM_THREADS=1`` while ranks are spawned (they inherit the environment, so it is in
    place before they import torch); the caller's value afterwards."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def publish(results: dict, report: str, path: str) -> dict:
    """Print ``report``, write ``results`` to ``path`` as JSON; ``results``."""
    print(report)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwritten to {path}")
    return results


def rounds(variants: dict[str, Callable[[], Any]], n: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per round of each variant, ``n`` samples each (after ``warmup`` unmeasured
    rounds); the order of the variants rotates every round."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    items = list(variants.items())
    for r in range(n):
        for name, fn in items[r % len(items):] + items[: r % len(items)]:
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return samples
