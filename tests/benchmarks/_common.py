"""What every benchmark's ``main`` does around its own measurements: the command line,
one OpenMP thread per spawned rank, interleaved timing rounds (wall time and the world's CPU
time over the same windows), and printing plus saving the results."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from typing import Any, Callable, Iterator

from tests.benchmarks._cpu import CpuMeter


def parse_args(description: str, default_json: str, argv: list[str] | None,
               transport: bool = True, extra: Callable[[argparse.ArgumentParser], Any] | None = None
               ) -> argparse.Namespace:
    """``--quick`` (small sizes, for a smoke run), ``--json PATH`` and ``--transport`` (the
    world's TensorPipe transport, ``rpc_backend``'s default unless given); ``extra(parser)``
    adds a benchmark's own options."""
    from rpc_backend import DEFAULT_TRANSPORT, TRANSPORTS

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes (for a smoke run)")
    parser.add_argument("--json", default=default_json)
    if transport:  # (not for a benchmark that compares the transports itself)
        parser.add_argument("--transport", choices=TRANSPORTS, default=DEFAULT_TRANSPORT,
                            help=f"the world's transport (default {DEFAULT_TRANSPORT})")
    if extra is not None:
        extra(parser)
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


def run_world(argv: list[str] | None, description: str, default_json: str, quick: dict, full: dict,
              rank_main: Callable[[dict], dict | None], roles: dict[str, int], timeout: float = 900
              ) -> tuple[dict, str]:
    """What a benchmark's ``main`` does before its figures: parse the command line, take the
    ``quick`` or ``full`` config (with the chosen transport), run ``rank_main(cfg)`` on a
    ``run_local`` world of ``roles`` with one OpenMP thread per rank, and return the one rank's
    results that is not None, with the path to publish them to."""
    from rpc_backend import run_local

    args = parse_args(description, default_json, argv)
    cfg = dict(quick if args.quick else full)
    cfg["transport"] = args.transport
    with one_thread_per_rank():
        out = run_local(rank_main, sum(roles.values()), roles=roles, args=(cfg,), transport=cfg["transport"],
                        timeout=timeout)
    return next(r for r in out if r is not None), args.json


def publish(results: dict, report: str, path: str) -> dict:
    """Print ``report`` (after the world's transport, when the config names one), write
    ``results`` to ``path`` as JSON; ``results``."""
    transport = results.get("config", {}).get("transport")
    if transport is not None:
        print(f"transport: {transport} (--transport to choose)")
    print(report)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwritten to {path}")
    return results


class Window:
    """One timed window: wall seconds and the CPU seconds of ``meter``'s processes over it.

    Example::

        with Window(meter) as w:
            work()
        w.seconds, w.cpu          # cpu: summed over the processes; None without a meter or off Linux

    The meter is read just outside the clock, so reading it costs the wall time nothing.
    """

    def __init__(self, meter: CpuMeter | None = None) -> None:
        self.meter = meter
        self.seconds = 0.0
        self.cpu: float | None = None
        self.each: list[float | None] = []  # (each process's, in the meter's order)

    def __enter__(self) -> Window:
        if self.meter is not None:
            self.meter.start()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self._start
        if self.meter is not None:
            self.each = self.meter.stop_each()
            self.cpu = None if any(v is None for v in self.each) else sum(self.each)  # type: ignore[arg-type]


def rounds(
    variants: dict[str, Callable[[], Any]],
    n: int,
    warmup: int,
    meter: CpuMeter | None = None,
    after: dict[str, Callable[[], Any]] | None = None,
    each: dict[str, list[list[float | None]]] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float | None]]]:
    """Seconds per round of each variant, ``n`` samples each (after ``warmup`` unmeasured
    rounds), and the CPU seconds ``meter``'s processes spent in each of those same rounds
    (summed over the processes; None without a meter or off Linux). The order of the variants
    rotates every round. ``after[name]`` runs after each round of variant ``name``, outside
    the clock and the meter (to let the round's work settle, say). ``each`` (a dict, filled
    in): each round's CPU seconds of each process apart, ``each[name][round][process]``."""
    after = after or {}
    for name, fn in variants.items():
        for _ in range(warmup):
            fn()
            if name in after:
                after[name]()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float | None]] = {name: [] for name in variants}
    items = list(variants.items())
    for r in range(n):
        for name, fn in items[r % len(items):] + items[: r % len(items)]:
            with Window(meter) as w:
                fn()
            samples[name].append(w.seconds)
            cpu[name].append(w.cpu)
            if each is not None:
                each.setdefault(name, []).append(list(w.each))
            if name in after:
                after[name]()
    return samples, cpu


def repeated(fn: Callable[[], Any], times: int) -> Callable[[], None]:
    """A callable that calls ``fn`` ``times`` times: one block of calls, for :func:`rounds`."""
    def run() -> None:
        for _ in range(times):
            fn()
    return run


def median_cpu(samples: list[float | None], ops: float = 1) -> float | None:
    """CPU seconds per operation: the median over rounds of a round's CPU seconds, over
    ``ops`` operations a round; None when any round's CPU is unknown (off Linux)."""
    if not samples or any(c is None for c in samples):
        return None
    return statistics.median(samples) / ops  # type: ignore[type-var]


def cpu_per_op(cpu: dict[str, list[float | None]], ops: float = 1) -> dict[str, float | None]:
    """:func:`median_cpu` of every variant of a :func:`rounds` result."""
    return {name: median_cpu(c, ops) for name, c in cpu.items()}


def cpu_cell(cpu: float | None, scale: float, width: int, decimals: int = 1) -> str:
    """``cpu * scale`` right-aligned in ``width`` columns, or ``-`` when unknown (off Linux)."""
    return f"{'-':>{width}}" if cpu is None else f"{cpu * scale:>{width}.{decimals}f}"


def messages_per_call(fn: Callable[[], Any], times: int) -> dict[str, float]:
    """Messages this process sends to each worker per call of ``fn`` (``times`` calls),
    counted at ``torch.distributed.rpc.rpc_async`` (what this package's calls go through;
    torch's own C++ messages, e.g. distributed autograd's, are not seen; rpc_backend's
    heartbeats, sent on a thread of their own once a second, are left out)."""
    import collections

    import torch.distributed.rpc as rpc

    from rpc_backend import watch

    counted: collections.Counter = collections.Counter()
    real = rpc.rpc_async

    def counting(to: Any, *args: Any, **kwargs: Any) -> Any:
        if not (args and args[0] is watch._beat):  # rpc_backend's heartbeats (1 a second): not the call's
            counted[to.name if isinstance(to, rpc.WorkerInfo) else str(to)] += 1
        return real(to, *args, **kwargs)

    rpc.rpc_async = counting
    try:
        for _ in range(times):
            fn()
    finally:
        rpc.rpc_async = real
    return {name: n / times for name, n in sorted(counted.items())}



def traffic_per_call(fn: Callable[[], Any], times: int, settle: Callable[[], Any] | None = None
                     ) -> dict[str, dict[str, float]]:
    """Per call of ``fn`` (``times`` calls), per worker: ``messages`` this process sent it,
    ``sent`` payload bytes, and ``received`` payload bytes of its answers, counted by
    ``rpc_backend.Traffic`` (each message's pickle and tensor bytes, at this process's
    ``rpc_async``/``rpc_sync``/``remote``; not TensorPipe's framing nor TCP/IP headers, not
    torch's own C++ messages such as distributed autograd's, not rpc_backend's heartbeats).
    ``settle()`` runs after the calls, still counted: to wait for the last answers (a table's
    ``flush()``)."""
    from rpc_backend import Traffic

    with Traffic() as traffic:
        for _ in range(times):
            fn()
        if settle is not None:
            settle()
    return {what: {name: n / times for name, n in sorted(getattr(traffic, what).items())}
            for what in ("messages", "sent", "received")}


#: what the benchmarks' bytes per step count, in words
BYTES_COUNTED = ("RPC payload, counted at the trainer's calls as sent and as answered: pickles and tensor bytes; "
                 "not TensorPipe's framing nor TCP/IP headers")
