"""Calls outstanding when the caller leaves the world gracefully (run by
tests/proxy/test_contract_faults.py): every one must still be answered.

Three ways to leave, three small worlds:

- ``python -m tests._faults.shutdown_calls ROLE INIT_METHOD MODE`` (ROLE caller or host): the
  caller calls ``rpc.shutdown()`` itself. MODE ``burst``: 2,000 cheap ``forward_async``
  calls, plus slow calls made from several threads, all outstanding at the shutdown. MODE
  ``exit_in_init``: a module constructor that raises ``SystemExit``, then the shutdown.
- :func:`leave_through_worker` under ``run_local``: the caller leaves through ``Worker``'s
  context exit.
- :func:`leave_at_function_end` under ``run_local``: the caller's function returns with the
  calls outstanding; ``run_local``'s own graceful shutdown follows.
"""

import json
import os
import sys
import threading
import time
from typing import Any

from tests._deadlines import HANG_S

ROLES = ("caller", "host")
CHEAP_CALLS = 2000
#: host seconds per cheap call: the calls share messages, and a burst keeps a queue on the
#: caller for most of a second
CHEAP_PAUSE = 0.0002
SLOW_THREADS, SLOW_CALLS_PER_THREAD, SLOW_SECONDS = 4, 25, 0.05
#: a shutdown that takes longer than this is reported as hung (a hang guard, tests/_deadlines.py;
#: also the deadline of the calls here, which must all be answered)
SHUTDOWN_LIMIT = HANG_S
#: the timeout of the constructor that raises SystemExit (it must fail at once, not at this)
EXIT_IN_INIT_TIMEOUT = HANG_S

_clock = time.monotonic


def summarize(futures: list, expected: list, *, settle_within: float = 0.0) -> dict:
    """How the calls behind ``futures`` ended, against the locally computed ``expected``."""
    import torch

    deadline = _clock() + settle_within
    while not all(f.done() for f in futures) and _clock() < deadline:
        time.sleep(0.01)
    report = {"calls": len(futures), "unsettled": sum(not f.done() for f in futures), "ok": 0, "wrong": 0,
              "failures": 0, "example_failures": []}
    for fut, want in zip(futures, expected):
        if not fut.done():
            continue
        try:
            got = fut.wait()
        except Exception as exc:
            report["failures"] += 1
            if len(report["example_failures"]) < 3:
                report["example_failures"].append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
            continue
        same = torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
        report["ok" if same else "wrong"] += 1
    return report


def cheap_proxy(host: str) -> tuple[Any, Any]:
    """A warmed proxy of a small linear layer on ``host`` that takes CHEAP_PAUSE per call (its
    channel coalesces from here on, see below) and a local copy of the module that computes what
    each call must return."""
    import torch

    import remote_module._proxy.channel as channel
    from remote_module import RemoteModule
    from tests.proxy import _contract_remote as cr

    # On a loaded machine one call's host time can jump past HEAVY_CALL_S (a preempted host),
    # and the channel then sends calls one per message for a while. These worlds are about
    # calls still queued on the caller at shutdown, so they keep every burst coalesced.
    channel.HEAVY_CALL_S = 0.01
    proxy = RemoteModule(f"{host}/cpu", cr.CountingLinear, (4, 4), {"pause": CHEAP_PAUSE}, timeout=SHUTDOWN_LIMIT)
    proxy.forward_async(torch.ones(1, 4)).wait()  # the channel knows the cost: it coalesces
    local = torch.nn.Linear(4, 4)
    local.load_state_dict(proxy.state_dict())
    return proxy, local


def cheap_burst(proxy: Any, local: Any) -> tuple[list, list]:
    """CHEAP_CALLS ``forward_async`` calls: the futures and what each must return."""
    import torch

    inputs = torch.randn(CHEAP_CALLS, 1, 4)
    with torch.no_grad():
        expected = [local(x) for x in inputs]
    return [proxy.forward_async(x) for x in inputs], expected


def slow_burst_from_threads(proxy: Any) -> tuple[list, list]:
    """SLOW_THREADS threads each make SLOW_CALLS_PER_THREAD slow ``forward_async`` calls on
    ``proxy`` (a ``Slow`` module)."""
    made: list[list] = [[] for _ in range(SLOW_THREADS)]

    def make_calls(t: int) -> None:
        for k in range(SLOW_CALLS_PER_THREAD):
            seconds = SLOW_SECONDS + (t * SLOW_CALLS_PER_THREAD + k) * 1e-6  # each call its own answer
            made[t].append((proxy.forward_async(seconds), seconds))

    threads = [threading.Thread(target=make_calls, args=(t,)) for t in range(SLOW_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pairs = [pair for per_thread in made for pair in per_thread]
    return [f for f, _ in pairs], [s for _, s in pairs]


def timed_shutdown() -> dict:
    """``rpc.shutdown()`` (graceful), reported as hung when it takes over SHUTDOWN_LIMIT."""
    import torch.distributed.rpc as rpc

    box: dict = {}

    def run() -> None:
        try:
            rpc.shutdown()
        except Exception as exc:
            box["error"] = f"{type(exc).__name__}: {exc}"

    start = _clock()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(SHUTDOWN_LIMIT)
    return {"completed": not thread.is_alive(), "seconds": _clock() - start, "error": box.get("error")}


def burst_then_shutdown() -> dict:
    from remote_module import RemoteModule
    from tests.proxy import _contract_remote as cr

    cheap, local = cheap_proxy("host")
    slow = RemoteModule("host/cpu", cr.Slow, timeout=SHUTDOWN_LIMIT)
    slow.forward_async(0.0).wait()  # cheap so far: the first slow calls queue behind two messages
    shared_before = {"cheap": cheap._channel.shared_messages, "slow": slow._channel.shared_messages}
    cheap_futures, cheap_expected = cheap_burst(cheap, local)
    slow_futures, slow_expected = slow_burst_from_threads(slow)
    outstanding = {"cheap": cheap._channel.outstanding(), "slow": slow._channel.outstanding()}
    report = {"shutdown": timed_shutdown()}
    report["cheap"] = summarize(cheap_futures, cheap_expected)
    report["slow"] = summarize(slow_futures, slow_expected)
    for kind, proxy in (("cheap", cheap), ("slow", slow)):
        report[kind]["outstanding_at_shutdown"] = outstanding[kind]
        report[kind]["shared_messages"] = proxy._channel.shared_messages - shared_before[kind]
    return report


def exit_in_init_then_shutdown() -> dict:
    import torch

    from remote_module import RemoteModule
    from tests.proxy import _contract_remote as cr

    start = _clock()
    try:
        RemoteModule("host/cpu", cr.ExitInInit, timeout=EXIT_IN_INIT_TIMEOUT)
        report = {"constructor": {"raised": None}}
    except BaseException as exc:  # what it raises is the point (SystemExit must not escape)
        report = {"constructor": {"raised": type(exc).__name__, "is_exception": isinstance(exc, Exception),
                                  "message": str(exc)[:300]}}
    report["constructor"]["seconds"] = _clock() - start
    report["constructor"]["timeout"] = EXIT_IN_INIT_TIMEOUT
    proxy = RemoteModule("host/cpu", torch.nn.Linear, (4, 4), timeout=HANG_S)
    local = torch.nn.Linear(4, 4)
    local.load_state_dict(proxy.state_dict())
    x = torch.randn(3, 4)
    report["host_still_works"] = bool(torch.equal(proxy(x), local(x)))
    report["shutdown"] = timed_shutdown()
    return report


def main(role: str, init_method: str, mode: str) -> None:
    import torch.distributed.rpc as rpc

    from tests._faults.subworld import join

    join(role, init_method, ROLES)
    if role == "host":
        rpc.shutdown()  # serves until the caller is done
        return
    report = {"burst": burst_then_shutdown, "exit_in_init": exit_in_init_then_shutdown}[mode]()
    print("REPORT " + json.dumps(report), flush=True)
    os._exit(0)


# ---- leaving under run_local (module level: run_local runs these on every rank) -------------


def leave_through_worker() -> dict | None:
    """Rank 0 makes a cheap burst inside ``with current_worker():`` and reports afterwards."""
    from rpc_backend import current_worker

    me = current_worker()
    if me.rank != 0:
        return None  # the host: serves until every rank is done
    with me:
        proxy, local = cheap_proxy(me.names[1])
        shared_before = proxy._channel.shared_messages
        futures, expected = cheap_burst(proxy, local)
        outstanding = proxy._channel.outstanding()
    report = summarize(futures, expected)
    report["outstanding_at_shutdown"] = outstanding
    report["shared_messages"] = proxy._channel.shared_messages - shared_before
    return report


def leave_at_function_end(report_path: str) -> None:
    """Rank 0 returns with a cheap burst outstanding; a thread that outlives the function
    (the process waits for it) writes what the calls came to once ``run_local``'s shutdown
    is over."""
    from rpc_backend import current_worker

    me = current_worker()
    if me.rank != 0:
        return
    proxy, local = cheap_proxy(me.names[1])
    shared_before = proxy._channel.shared_messages
    futures, expected = cheap_burst(proxy, local)
    outstanding = proxy._channel.outstanding()

    def write_report() -> None:
        report = summarize(futures, expected, settle_within=SHUTDOWN_LIMIT)
        report["outstanding_at_shutdown"] = outstanding
        report["shared_messages"] = proxy._channel.shared_messages - shared_before
        with open(report_path, "w") as f:
            json.dump(report, f)

    threading.Thread(target=write_report, name="report-after-shutdown", daemon=False).start()


if __name__ == "__main__":
    main(*sys.argv[1:])
