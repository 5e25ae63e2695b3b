"""Heartbeat benchmark: what watching for lost peers costs an idle rank (rpc_backend/watch.py).

    python -m tests.benchmarks.bench_watch            # N = 4 and 8, 20 s windows, 3 repeats
    python -m tests.benchmarks.bench_watch --quick    # N = 4, one 5 s window

For each world size N, local worlds of N processes (``run_local``, the ``uv`` transport, whose
idle processes sleep) idle through a window with heartbeats on (every second, the default)
and off (``lost_after=math.inf``), on and off alternating. Each rank reads its own process's
CPU clock (every thread: the heartbeat thread, TensorPipe's, the RPC handlers') across the
window, after a warm-up in which every pair has exchanged heartbeats. Prints, per N, the
median over repeats of the CPU per rank per second (a core is 1.0) on and off and their
difference, which is what the heartbeats cost: each rank sends N-1 heartbeats a second and
answers N-1.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from rpc_backend import current_worker, run_local
from rpc_backend.watch import current_watcher

WARM_S = 3.0


def idle(window: float) -> float:
    """CPU seconds this process used per second of an idle ``window`` (after a warm-up)."""
    me = current_worker()
    watcher = current_watcher()
    deadline = time.monotonic() + 60
    while watcher is not None and len(watcher.known_to()) < me.world_size - 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(WARM_S)
    cpu0, t0 = time.process_time(), time.monotonic()
    time.sleep(window)
    return (time.process_time() - cpu0) / (time.monotonic() - t0)


def measure(n: int, window: float, watching: bool) -> list[float]:
    return run_local(idle, n, args=(window,), lost_after=None if watching else math.inf, heartbeat=None)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    sizes, window, repeats = ((4,), 5.0, 1) if args.quick else ((4, 8), 20.0, 3)
    results: dict = {}
    for n in sizes:
        on, off = [], []
        for _ in range(repeats):
            off.append(statistics.median(measure(n, window, False)))
            on.append(statistics.median(measure(n, window, True)))
        results[n] = {"on": statistics.median(on), "off": statistics.median(off)}
        results[n]["cost"] = results[n]["on"] - results[n]["off"]
        print(f"N={n}: CPU per rank, heartbeats on {results[n]['on'] * 1000:.2f} ms/s, off "
              f"{results[n]['off'] * 1000:.2f} ms/s: the heartbeats cost {results[n]['cost'] * 1000:.2f} ms/s "
              f"per rank ({n - 1} sent and {n - 1} answered a second; medians of {repeats})", flush=True)
    return results


if __name__ == "__main__":
    main()
