"""Small worlds for RemotePipeline's failures that need processes of their own (run by
tests/pipeline/test_faults.py): stage workers frozen with SIGSTOP and killed with SIGKILL,
and a graceful ``rpc.shutdown()`` while a forward runs.

    python -m tests._faults.pipeline_world ROLE INIT_METHOD MODE

MODE ``faults`` (roles caller, h1, h2, h3), in turn on one world: a 3-stage pipeline on h1, h2,
h3 with stage 0 frozen, then its last stage frozen (each thawed afterwards), then its last stage
killed mid-forward; then a 2-stage pipeline on h1, h2 with stage 0 killed mid-forward. A proxy
on h2 is called during each fault. The caller leaves without a graceful shutdown (peers died).
Each faulty forward reports the stage its error blames (see :func:`blamed`) and the timeout it
ran with: a forward whose error blames a healthy stage (the machine was too slow for the
healthy stages to bring a micro-batch to the faulty one in time) is run again with its timeout
doubled (:func:`faulty_forward`), while the fault still holds.

MODE ``shutdown`` (roles caller, h1, h2): a forward running in a thread when the caller calls
``rpc.shutdown()``.

The caller prints one ``REPORT`` line with what it measured; the test judges it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time

from tests._deadlines import HANG_S
from tests._faults.frozen_host import phase, wait_until

ROLES = {"faults": ("caller", "h1", "h2", "h3"), "shutdown": ("caller", "h1", "h2")}
#: the pipeline's timeout in the fault phases (to start with: see :func:`faulty_forward`)
TIMEOUT = 3.0
#: the 2-stage pipeline's micro-batch (value) on which stage 0's host kills itself
KILL_AT = 2.0
#: the gate on which stage 0 holds the shutdown world's micro-batches until the caller's
#: rpc.shutdown() reaches its host (tests._faults.gates.release_at_shutdown): the forward is
#: outstanding at the shutdown whatever the machine's speed (a pause of 0.3 s per micro-batch
#: was a race on a loaded machine)
SHUTDOWN_GATE = "pipeline-shutdown"

_clock = time.monotonic


def attempt(fn) -> dict:
    """How ``fn()`` ended: ``ok`` (and ``value``), or the error's type and message; seconds."""
    start = _clock()
    try:
        value = fn()
    except Exception as exc:
        return {"ok": False, "type": type(exc).__name__, "message": str(exc), "seconds": _clock() - start}
    plain = value if isinstance(value, (bool, int, float, str, dict, type(None))) else repr(value)[:200]
    return {"ok": True, "value": plain, "seconds": _clock() - start}


def forward_equals(pipe, x, expected) -> bool:
    import torch

    return bool(torch.equal(pipe(x), expected))


def blamed(message: str) -> list | None:
    """``[stage, worker]`` a pipeline's error blames: the stage it was raised in (``[raised in
    pipeline stage i on worker 'w' ...]``), or the one the caller's own error names first (stage
    0, unanswered or unreachable); None when it names no stage."""
    found = re.search(r"\[raised in pipeline stage (\d+) on worker '([^']+)'", message) or re.match(
        r"pipeline stage (\d+) on worker '([^']+)'", message)
    return None if found is None else [int(found.group(1)), found.group(2)]


def faulty_forward(pipe, x, stage: int, worker: str) -> dict:
    """:func:`attempt` of ``pipe(x)`` while stage ``stage`` (on ``worker``) is faulty, with the
    pipeline's timeout TIMEOUT, doubled and run again while its error blames another, healthy
    stage (too slow on this machine to get the micro-batch to the faulty one in time), up to
    HANG_S. The outcome says the timeout it ran with, the stage blamed and the tries."""
    timeout, tries = TIMEOUT, 0
    while True:
        pipe.timeout = timeout
        outcome = attempt(lambda: pipe(x))
        tries += 1
        outcome.update(timeout=timeout, tries=tries, blamed=None if outcome["ok"] else blamed(outcome["message"]))
        healthy_blamed = outcome["blamed"] is not None and outcome["blamed"] != [stage, worker]
        if not healthy_blamed or 2 * timeout > HANG_S:
            return outcome
        timeout *= 2


def frozen(pipe, other, x, expected, stage: int, host: str, pid: int) -> dict:
    """Stop ``host`` during a forward with the pipeline's timeout, call ``other`` meanwhile,
    thaw it; then a forward with time enough must succeed."""
    import torch

    from tests._faults.frozen_host import wait_for_state

    os.kill(pid, signal.SIGSTOP)
    wait_for_state(pid, stopped=True)
    try:
        report = {"forward": faulty_forward(pipe, x, stage, host)}
        report["other"] = attempt(lambda: bool(torch.equal(other(x), x)))
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for_state(pid, stopped=False)
    pipe.timeout = HANG_S
    report["after"] = attempt(lambda: forward_equals(pipe, x, expected))
    return report


def killed(pipe, other, x, stage: int, host: str, pid: int, tag: str, value: float) -> dict:
    """``host`` kills itself when stage ``tag`` sees ``value`` during a forward; then another
    forward (the host now known dead) and a call on ``other``."""
    import torch
    import torch.distributed.rpc as rpc

    from tests._faults import stages as pfr
    from tests._faults.dead_host import wait_until_dead

    rpc.rpc_sync(host, pfr.configure, (tag,), {"die_on": value})
    report = {"forward": faulty_forward(pipe, x, stage, host)}
    wait_until_dead(pid)
    report["again"] = faulty_forward(pipe, x, stage, host)
    report["other"] = attempt(lambda: bool(torch.equal(other(x), x)))
    return report


def faults_caller() -> None:
    import torch
    import torch.distributed.rpc as rpc

    from remote_module import RemoteModule
    from remote_module.pipeline import RemotePipeline
    from tests._faults import stages as pfr
    from tests.proxy import _contract_remote as cr

    hosts = ("h1", "h2", "h3")
    pids = {h: rpc.rpc_sync(h, cr.pid) for h in hosts}
    # set-up, and the calls that must work: HANG_S (the faulty forwards set their own timeouts)
    three = RemotePipeline(
        [(f"{h}/cpu", pfr.Step, (f"p3-{i}", float(10**i)), None) for i, h in enumerate(hosts)],
        chunks=2, timeout=HANG_S,
    )
    other = RemoteModule("h2/cpu", torch.nn.Identity, timeout=HANG_S)
    x = torch.arange(2.0).reshape(2, 1)
    expected = x + 111.0
    report = {"timeout": TIMEOUT, "warm": attempt(lambda: forward_equals(three, x, expected))}
    report["frozen_first"] = phase(frozen, three, other, x, expected, 0, "h1", pids["h1"])
    report["frozen_last"] = phase(frozen, three, other, x, expected, 2, "h3", pids["h3"])
    # micro-batch 1 reaches stage 2 holding 1 + 1 + 10
    report["killed_last"] = phase(killed, three, other, x, 2, "h3", pids["h3"], "p3-2", 12.0)
    two = RemotePipeline(
        [("h1/cpu", pfr.Step, ("p2-0", 1.0), None), ("h2/cpu", pfr.Step, ("p2-1", 10.0), None)],
        chunks=4, timeout=HANG_S,
    )
    four = torch.arange(4.0).reshape(4, 1)
    report["two_warm"] = attempt(lambda: forward_equals(two, four, four + 11.0))
    report["killed_first"] = phase(killed, two, other, four, 0, "h1", pids["h1"], "p2-0", KILL_AT)
    print("REPORT " + json.dumps(report), flush=True)
    os._exit(0)


def shutdown_caller() -> dict:
    """A forward in a thread; ``rpc.shutdown()`` once every micro-batch was sent and stage 0
    started the first (held there until the shutdown reaches h1). The forward must answer,
    correctly."""
    import torch
    import torch.distributed.rpc as rpc

    from remote_module.pipeline import RemotePipeline, _pipeline
    from tests._faults import gates
    from tests._faults import stages as pfr

    pipe = RemotePipeline(
        [("h1/cpu", pfr.Step, ("s-0", 1.0), None), ("h2/cpu", pfr.Step, ("s-1", 10.0), None)],
        chunks=4, timeout=HANG_S,
    )
    x = torch.arange(4.0).reshape(4, 1)
    rpc.rpc_sync("h1", gates.release_at_shutdown, (SHUTDOWN_GATE,))
    rpc.rpc_sync("h1", pfr.configure, ("s-0",), {"gate": SHUTDOWN_GATE})
    sent = []
    send = _pipeline.call_async

    def counted(*args, **kwargs):
        fut = send(*args, **kwargs)
        sent.append(fut)
        return fut

    _pipeline.call_async = counted
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(attempt(lambda: forward_equals(pipe, x, x + 11.0))))
    thread.start()
    wait_until(lambda: len(sent) == 4, HANG_S, "the forward sent its 4 micro-batches")
    wait_until(lambda: rpc.rpc_sync("h1", pfr.counts, ("s-0",))["entered"] >= 1, HANG_S, "stage 0 started")
    outstanding = sum(not f.done() for f in sent)
    start = _clock()
    rpc.shutdown()
    shutdown_seconds = _clock() - start
    thread.join(HANG_S)
    return {"forward": box, "forward_alive": thread.is_alive(), "outstanding_at_shutdown": outstanding,
            "shutdown_seconds": shutdown_seconds}


def run_role(roles: tuple, role: str, init_method: str, mode: str, faults, shutdown) -> None:
    """Join the world ``roles`` as ``role``: a host serves until the caller is done (or is
    killed); the caller runs ``faults()`` (mode "faults") or prints ``shutdown()``'s report."""
    import torch.distributed.rpc as rpc

    from tests._faults.subworld import join

    join(role, init_method, roles, num_worker_threads=16)
    if role != "caller":
        rpc.shutdown()  # serves until the caller is done (or is killed)
    elif mode == "faults":
        faults()
    else:
        report = phase(shutdown)
        print("REPORT " + json.dumps(report), flush=True)


def main(role: str, init_method: str, mode: str) -> None:
    run_role(ROLES[mode], role, init_method, mode, faults_caller, shutdown_caller)


if __name__ == "__main__":
    main(*sys.argv[1:])
