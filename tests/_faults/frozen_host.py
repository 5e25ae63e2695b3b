"""A small world whose host is frozen, thawed and then killed (run by
tests/proxy/test_contract_faults.py).

    python -m tests._faults.frozen_host ROLE INIT_METHOD

ROLE is caller (rank 0), victim (rank 1: frozen with SIGSTOP twice, then SIGKILLed mid-burst)
or survivor (rank 2). The caller runs three phases on one world and prints one ``REPORT``
line; each phase's facts are measured here and judged by the test:

- ``frozen``: a burst of ``forward_async`` calls on a warmed proxy while the victim is
  stopped, a blocking ``forward`` behind them, then SIGCONT and calls that work again;
- ``blocking_callbacks``: the same burst with callbacks that block forever or wait on the
  same proxy;
- ``killed``: the victim is SIGKILLed while answers to a burst are still arriving; a
  survivor keeps working.

The caller leaves without a graceful shutdown (a peer is dead).
"""

import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import traceback

from tests._deadlines import HANG_S

ROLES = ("caller", "victim", "survivor")
#: seconds per call in the frozen phases
FROZEN_TIMEOUT = 2.0
#: the blocking ``forward`` made behind the frozen burst
BLOCKING_TIMEOUT = 3.0
#: seconds per call in the killed phase: a dead host fails calls with its death's own error,
#: never at this deadline (a hang guard: a call that reaches it fails as a CallTimeout)
KILLED_TIMEOUT = HANG_S
BURST = 1000
#: the channel's limit on a call's host time for sharing messages, raised here (from 1 ms): on
#: a loaded machine a preempted host's calls cost more, and the channel would then send the
#: bursts one call per message; this world is about bursts of shared messages
HEAVY_CALL_S = 0.01

_clock = time.monotonic


class _Stderr:
    """This process's file descriptor 2, kept in a file: torch reports a future's callback
    that raised there (in C++), so what it says can be counted."""

    CALLBACK_RAISED = "error when running the callback"

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile()
        os.dup2(self.file.fileno(), 2)

    def callbacks_that_raised(self) -> int:
        self.file.seek(0)
        return self.file.read().decode(errors="replace").count(self.CALLBACK_RAISED)


class _ErrorLog(logging.Handler):
    """Keeps what ``remote_module`` logs at ERROR (e.g. a future settled twice)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def process_state(pid: int) -> str:
    """The one-letter state of ``pid`` ("T" stopped, "R"/"S" running, "Z" dead)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def thread_states(pid: int) -> list[str]:
    """The one-letter state of every thread of ``pid`` (a stop signal stops the thread that
    takes it first, the others only once that thread runs: on a loaded machine they may still
    answer calls for a while)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended (ESRCH mid-read)
            continue
    return states


def wait_for_state(pid: int, stopped: bool, seconds: float = HANG_S) -> None:
    """Until every thread of ``pid`` is stopped (``stopped``) or none is (``seconds``: a hang guard)."""
    deadline = _clock() + seconds
    while (all(s in "Tt" for s in thread_states(pid)) if stopped
           else all(s not in "Tt" for s in thread_states(pid))) is False:
        if _clock() > deadline:
            raise AssertionError(f"hang guard: process {pid} did not become {'stopped' if stopped else 'running'}: "
                                 f"thread states {thread_states(pid)}")
        time.sleep(0.01)


def wait_until(predicate, seconds: float, what: str) -> None:
    """Poll ``predicate`` until it holds; ``seconds`` is a hang guard (tests/_deadlines.py)."""
    deadline = _clock() + seconds
    while not predicate():
        if _clock() > deadline:
            raise AssertionError(f"hang guard: not within {seconds} s: {what}")
        time.sleep(0.01)


def attempt(fn) -> dict:
    start = _clock()
    try:
        value = fn()
    except Exception as exc:
        return {"ok": False, "type": type(exc).__name__, "message": str(exc), "seconds": _clock() - start}
    return {"ok": True, "seconds": _clock() - start, "value": value}


class Tracker:
    """Futures of one burst: when each was made and settled, how often its callback ran."""

    def __init__(self) -> None:
        self.futures = []
        self.made: list[float] = []
        self.settled: list[float | None] = []
        self.callbacks: list[int] = []

    def add(self, make) -> int:
        i = len(self.futures)
        self.made.append(_clock())
        self.settled.append(None)
        self.callbacks.append(0)
        fut = make()
        self.futures.append(fut)
        fut.add_done_callback(lambda _, i=i: self._done(i))  # first: later ones may block
        return i

    def _done(self, i: int) -> None:
        self.callbacks[i] += 1
        if self.settled[i] is None:
            self.settled[i] = _clock()

    def all_settled(self) -> bool:
        return all(t is not None for t in self.settled)

    def outcome(self, i: int) -> dict:
        try:
            self.futures[i].wait()
        except Exception as exc:
            return {"ok": False, "type": type(exc).__name__, "message": str(exc)}
        return {"ok": True}

    def summary(self) -> dict:
        """Lateness of every settlement (seconds after the call was made) and the errors."""
        outcomes = [self.outcome(i) for i in range(len(self.futures))]
        after = [s - m for s, m in zip(self.settled, self.made) if s is not None]
        failures = [o for o in outcomes if not o["ok"]]
        return {
            "calls": len(self.futures),
            "unsettled": sum(s is None for s in self.settled),
            "ok": sum(o["ok"] for o in outcomes),
            "failure_types": sorted({o["type"] for o in failures}),
            "unsent": sum("before it was sent" in o["message"] for o in failures),
            "sent": sum("sent to worker 'victim'" in o["message"] for o in failures),
            "naming_victim": sum("'victim'" in o["message"] for o in failures),
            "example_failures": sorted({o["message"].split("\n")[0] for o in failures})[:4],
            "earliest": min(after, default=None),
            "latest": max(after, default=None),
            "slowest": sorted(range(len(after)), key=lambda i: -after[i])[:5],  # call indices
            "callback_counts": sorted(set(self.callbacks)),
        }


def warm(proxy, x) -> None:
    """Answered calls until the channel counts them cheap: it then coalesces (the first
    calls cost more, and one slow answer on a loaded machine raises the running average)."""
    from remote_module._proxy import channel

    deadline = _clock() + HANG_S
    while True:
        proxy.forward_async(x).wait()
        if proxy._channel.cost < channel.HEAVY_CALL_S / 2:
            return
        if _clock() > deadline:
            raise AssertionError(f"hang guard: calls still cost {proxy._channel.cost * 1e3:.2f} ms on the host")


def frozen_burst(proxy, x, pid: int, log: _ErrorLog, stderr: _Stderr, blockers: dict | None) -> dict:
    """Freeze the host, make BURST calls (with ``blockers``: index -> callback), a blocking
    call behind them; thaw it and check that the proxy works again."""
    import torch

    warm(proxy, x)
    module = proxy.get_module_rref()
    ran_before = module.rpc_sync().ran()
    sent_before = proxy._channel.calls_sent
    os.kill(pid, signal.SIGSTOP)
    wait_for_state(pid, stopped=True, seconds=HANG_S)
    proxy.timeout = FROZEN_TIMEOUT
    burst = Tracker()
    for i in range(BURST):
        burst.add(lambda: proxy.forward_async(x))
        if blockers and i in blockers:
            burst.futures[i].add_done_callback(blockers[i])
    proxy.timeout = BLOCKING_TIMEOUT
    blocking = attempt(lambda: proxy(x))
    wait_until(burst.all_settled, HANG_S, "every call of the frozen burst settled")
    report = {"burst": burst.summary(), "blocking": blocking}
    report["blocking"].pop("value", None)
    # the host was frozen until every outcome was in: no answer from it ended a call
    report["still_frozen"] = all(s in "Tt" for s in thread_states(pid))

    os.kill(pid, signal.SIGCONT)
    wait_for_state(pid, stopped=False, seconds=HANG_S)
    proxy.timeout = HANG_S
    # The host now runs what reached it while frozen (its late answers are dropped here):
    # wait until it did, so late answers have had their chance to settle something twice.
    # (+ the blocking call, unless it timed out waiting behind the burst and was never sent:
    # on a loaded machine the burst's 2 s deadlines can take longer than its 3 s to settle)
    sent = proxy._channel.calls_sent - sent_before + ("before it was sent" not in blocking.get("message", ""))
    wait_until(lambda: module.rpc_sync().ran() >= ran_before + sent, HANG_S, "the host ran the calls sent to it")
    local = torch.nn.Linear(4, 4)
    local.load_state_dict(proxy.state_dict())
    again = [proxy.forward_async(x) for _ in range(64)]
    report["works_again"] = bool(torch.equal(proxy(x), local(x))) and all(
        torch.equal(f.wait(), local(x)) for f in again
    )
    report["callback_counts_after_thaw"] = burst.summary()["callback_counts"]
    report["errors_logged"] = list(log.messages)
    report["callbacks_that_raised"] = stderr.callbacks_that_raised()
    return report


def killed_mid_burst(proxy, slow, survivor, x, pid: int) -> dict:
    """SIGKILL the host once answers to a burst are arriving; what every call saw."""
    import torch

    from tests._faults.dead_host import wait_until_dead

    proxy.timeout = slow.timeout = KILLED_TIMEOUT
    burst = Tracker()
    for i in range(400):
        burst.add(lambda: proxy.forward_async(x))
        if i % 8 == 0:
            burst.add(lambda: slow.forward_async(0.05))
        if i == 200:
            wait_until(lambda: any(s is not None for s in burst.settled), HANG_S, "a first answer")
            os.kill(pid, signal.SIGKILL)
            outstanding_at_kill = sum(s is None for s in burst.settled)
    wait_until_dead(pid, seconds=HANG_S)
    after_death = Tracker()
    for _ in range(64):
        after_death.add(lambda: proxy.forward_async(x))
    wait_until(lambda: burst.all_settled() and after_death.all_settled(), KILLED_TIMEOUT + HANG_S,
               "every call to the killed host settled")
    local = torch.nn.Linear(4, 4)
    local.load_state_dict(survivor.state_dict())
    survivor_async = [survivor.forward_async(x) for _ in range(64)]
    return {
        "outstanding_at_kill": outstanding_at_kill,
        "burst": burst.summary(),
        "after_death": after_death.summary(),
        "blocking": {k: v for k, v in attempt(lambda: proxy(x)).items() if k != "value"},
        "survivor_works": bool(torch.equal(survivor(x), local(x))) and all(
            torch.equal(f.wait(), local(x)) for f in survivor_async
        ),
    }


def phase(run, *args) -> dict:
    """``run(*args)``'s report, or the traceback of what went wrong in it."""
    try:
        return run(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def caller() -> None:
    import torch
    import torch.distributed.rpc as rpc

    from remote_module import RemoteModule
    from remote_module._proxy import channel
    from tests.proxy import _contract_remote as cr

    channel.HEAVY_CALL_S = HEAVY_CALL_S
    stderr = _Stderr()
    log = _ErrorLog()
    logging.getLogger("remote_module").addHandler(log)
    x = torch.randn(2, 4)
    # set-up and the calls that must work: HANG_S (each phase sets the timeouts it tests)
    proxy = RemoteModule("victim/cpu", cr.CountingLinear, (4, 4), timeout=HANG_S)
    slow = RemoteModule("victim/cpu", cr.Slow, timeout=HANG_S)
    survivor = RemoteModule("survivor/cpu", torch.nn.Linear, (4, 4), timeout=HANG_S)
    pid = rpc.rpc_sync("victim", cr.pid)
    report = {"frozen_timeout": FROZEN_TIMEOUT, "blocking_timeout": BLOCKING_TIMEOUT,
              "killed_timeout": KILLED_TIMEOUT, "burst": BURST}
    report["frozen"] = phase(frozen_burst, proxy, x, pid, log, stderr, None)

    release = threading.Event()
    inner: list[dict] = []
    returned: list[bool] = []

    def block_forever(_):  # until the phase is over (HANG_S at most)
        release.wait(HANG_S)
        returned.append(True)

    def call_same_proxy(_):
        inner.append(attempt(lambda: proxy.forward_async(x).wait()))

    def call_same_proxy_blocking(_):
        inner.append(attempt(lambda: proxy(x)))

    blockers = {0: block_forever, 1: call_same_proxy, 2: call_same_proxy_blocking, 3: block_forever,
                500: block_forever, 501: call_same_proxy}
    report["blocking_callbacks"] = phase(frozen_burst, proxy, x, pid, log, stderr, blockers)
    # every other call settled while these callbacks were blocked: none of them had returned
    report["blocking_callbacks"]["blockers_returned"] = len(returned)
    release.set()
    os.kill(pid, signal.SIGCONT)  # in case the phase failed while the host was stopped
    deadline = _clock() + HANG_S
    while len(inner) < 3 and _clock() < deadline:
        time.sleep(0.01)
    report["blocking_callbacks"]["inner"] = [{k: v for k, v in a.items() if k != "value"} for a in inner]

    report["killed"] = phase(killed_mid_burst, proxy, slow, survivor, x, pid)
    print("REPORT " + json.dumps(report), flush=True)
    os._exit(0)


def main(role: str, init_method: str) -> None:
    from tests._faults.subworld import join_and_serve

    join_and_serve(role, init_method, ROLES, caller)


if __name__ == "__main__":
    main(*sys.argv[1:])
