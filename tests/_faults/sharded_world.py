"""Small worlds for the sharded layer's failures that need processes of their own (run by
tests/sharded/test_faults.py): mesh workers that are slow, frozen with SIGSTOP and killed with
SIGKILL, bursts from several caller threads, and a graceful ``rpc.shutdown()`` mid-burst.

    python -m tests._faults.sharded_world ROLE INIT_METHOD MODE

MODE ``faults`` (roles caller, w1, w2, w3), in turn on one world, every phase on the mesh
[w1, w2, w3] with a ``LocalModule`` of :class:`tests._faults.stages.Step` (rank r adds
10**r; per-host pauses and kills set by tag):

- ``slow``: w2's shard is held (on a gate) past the timeout (run again with the timeout doubled
  while the error also names a healthy worker or w2's shard was not yet held: a machine too
  slow for the healthy ones to answer in time);
- ``burst``: forwards and ``full_tensor`` from 4 caller threads at once;
- ``frozen``: w2 stopped while a forward, ``full_tensor``, ``local_shards``, ``redistribute`` and a
  worker-to-worker fetch (w1 asking w2 for its piece) run concurrently; work on [w1, w3]
  meanwhile; then thawed;
- ``killed``: w3 kills itself in a forward; the same calls again; work on [w1, w2].

Each phase reports how every call ended and how many shards each worker held before and after
(once the late work ran), so the test can tell leaks. The caller leaves without a graceful
shutdown (a peer died).

MODE ``shutdown`` (roles caller, w1, w2): a thread runs forwards and fetches while the caller
calls ``rpc.shutdown()``, with RemoteTensors dropped just before; the hosts hold the second
forward until that shutdown reaches them.

The caller prints one ``REPORT`` line with what it measured; the test judges it.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time

from tests._deadlines import HANG_S
from tests._faults.frozen_host import phase, wait_until
from tests._faults.pipeline_world import attempt, run_role

ROLES = {"faults": ("caller", "w1", "w2", "w3"), "shutdown": ("caller", "w1", "w2")}
#: the timeout of every call to a faulty mesh in the fault phases (the slow phase's, to start
#: with); set-up and the calls that must work get HANG_S
TIMEOUT = 2.0
#: the gate on which the slow shard waits until the forward failed (it slept 3 s, 1 s past the
#: timeout: a loaded machine could deliver it in time); one key per try (a key opens once)
SLOW_GATE = "sharded-slow"
#: threads x forwards each in the burst
THREADS, PER_THREAD = 4, 13
#: the deadline of the world's own bookkeeping calls to live hosts (pids, counters, settings):
#: they must not fail, only outlast a loaded machine
BOOKKEEPING = HANG_S
#: the Step tag of the LocalModules here; rank r adds 10**r
TAG = "sf"
#: the gate on which the hosts hold the shutdown world's second forward until the caller's
#: rpc.shutdown() reaches them (tests._faults.gates.release_at_shutdown): it is still running
#: when the shutdown begins, however long the caller takes to get there (a pause of 1 s was
#: not enough at load 13)
SHUTDOWN_GATE = "sharded-shutdown"

_clock = time.monotonic


def step_args(rank: int) -> tuple:
    return (TAG, float(10**rank)), None


def expected(x, n: int):
    """What a ``Shard(0)`` output of the Step LocalModule on ``n`` workers gathers to when every
    worker got ``x`` as it is."""
    import torch

    return torch.cat([x + 10.0**r for r in range(n)])


def sharded_expected(x, n: int):
    """The same for ``x`` distributed ``Shard(0)`` over ``n`` workers."""
    import torch

    return torch.cat([part + 10.0**r for r, part in enumerate(torch.tensor_split(x, n))])


class World:
    """The caller's view of the faults world."""

    def __init__(self) -> None:
        import torch.distributed.rpc as rpc

        from tests.proxy import _contract_remote as cr

        self.mesh = ["w1", "w2", "w3"]
        self.pids = {w: rpc.rpc_sync(w, cr.pid, timeout=BOOKKEEPING) for w in self.mesh}

    def module(self, mesh: list[str], timeout: float = TIMEOUT):
        """A LocalModule of Steps on ``mesh``, created with HANG_S (set-up), then with
        ``timeout`` for its calls."""
        from torch.distributed.tensor import Shard

        from remote_module.sharded import LocalModule
        from tests._faults import stages as pfr

        lm = LocalModule(mesh, pfr.Step, step_args, out_placements=Shard(0), timeout=HANG_S)
        lm.timeout = timeout
        return lm

    def held(self, workers: list[str] | None = None) -> dict:
        import torch.distributed.rpc as rpc

        from tests.sharded import _remote as sr

        return {w: rpc.rpc_sync(w, sr.held_count, timeout=BOOKKEEPING) for w in workers or self.mesh}

    def counts(self, worker: str) -> dict:
        import torch.distributed.rpc as rpc

        from tests._faults import stages as pfr

        return rpc.rpc_sync(worker, pfr.counts, (TAG,), timeout=BOOKKEEPING)

    def configure(self, worker: str, **settings) -> None:
        import torch.distributed.rpc as rpc

        from tests._faults import stages as pfr

        rpc.rpc_sync(worker, pfr.configure, (TAG,), settings, timeout=BOOKKEEPING)

    def settled(self, workers: list[str], baseline: dict, ran: dict | None = None, seconds: float = HANG_S) -> dict:
        """Every Step forward on ``workers`` finished (and at least ``ran[w]`` were started on
        ``w``), then their held counts, polled until they are back at ``baseline`` (or
        ``seconds`` passed, a hang guard): the late outputs were dropped."""
        ran = ran or {}

        def done(w: str) -> bool:
            c = self.counts(w)
            return c["entered"] == c["left"] and c["entered"] >= ran.get(w, 0)

        wait_until(lambda: all(done(w) for w in workers), seconds, f"every shard forward on {workers} finished")
        gc.collect()
        deadline = _clock() + seconds
        while (now := self.held(workers)) != {w: baseline[w] for w in workers} and _clock() < deadline:
            time.sleep(0.05)
        return now


def concurrently(calls: dict) -> dict:
    """``attempt`` of every ``name: fn`` pair, each in its own thread, all started together."""
    results: dict = {}
    threads = [threading.Thread(target=lambda n=n, f=f: results.__setitem__(n, attempt(f))) for n, f in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    return {n: results.get(n, {"ok": False, "type": "Hang", "message": f"hang guard: no answer in {HANG_S:g} s"})
            for n in calls}


def peer_fetch(rt, new_index: int):
    """A worker-to-worker fetch only: mesh rank 0 (w1) alone is asked to rebuild its shard as
    ``Replicate`` from its peers' pieces, TIMEOUT for its fetches (the caller's own timeout is a
    hang guard, so the failure that comes is w1's, about the peer)."""
    from torch.distributed.tensor import Replicate

    from remote_module._core.fanout import call_all
    from remote_module.sharded import _host

    peers = list(zip(rt.mesh, rt._sids))
    new_sid = ("caller", -new_index, 0)
    call_all([(rt.mesh[0], _host._redistribute, (rt._sids[0], new_sid, rt.placement, Replicate(), 0, peers, TIMEOUT))],
             timeout=HANG_S)
    return True


def sharded_input(mesh: list[str], rows: int, start: float = 0.0):
    """``x`` and ``x`` distributed ``Shard(0)`` over ``mesh`` (HANG_S: set-up, and the default
    of its later calls; the calls that must fail give TIMEOUT)."""
    import torch
    from torch.distributed.tensor import Shard

    from remote_module.sharded import distribute

    x = torch.arange(start, start + rows).reshape(rows, 1)
    return x, distribute(x, mesh, Shard(0), timeout=HANG_S)


def slow(world: World, baseline: dict) -> dict:
    """w2's shard is held on a gate until the forward failed: past its timeout at any speed.
    The timeout starts at TIMEOUT and is doubled (the forward run again, held on a new key)
    while the error names a healthy worker too or w2's shard was not held yet when it came: the
    machine was too slow for the healthy workers, up to HANG_S."""
    import torch.distributed.rpc as rpc

    from tests._faults import gates

    lm = world.module(world.mesh)
    x, rt = sharded_input(world.mesh, 6)
    timeout, tries = TIMEOUT, 0
    while True:
        key = f"{SLOW_GATE}-{tries}"
        world.configure("w2", gate=key)
        lm.timeout = timeout
        try:
            outcome = attempt(lambda: lm(rt))  # noqa: F821
            held = rpc.rpc_sync("w2", gates.holding, (key,), timeout=BOOKKEEPING)
        finally:
            world.configure("w2")
            rpc.rpc_sync("w2", gates.release, (key,), timeout=BOOKKEEPING)
        tries += 1
        outcome.update(timeout=timeout, tries=tries, held=held)
        healthy_named = any(f"'{w}'" in outcome.get("message", "") for w in ("w1", "w3"))
        if outcome["ok"] or (held and not healthy_named) or 2 * timeout > HANG_S:
            break
        timeout *= 2
    report = {"forward": outcome}
    del rt  # ruff's F821 on the lambdas (here and below) comes from the del; they all ran before it
    report["held_after"] = world.settled(world.mesh, baseline)
    lm.timeout = HANG_S
    report["after"] = attempt(lambda: bool((lm(x).full_tensor() == expected(x, 3)).all()))
    return report


def burst(world: World, baseline: dict) -> dict:
    """THREADS threads, PER_THREAD forwards each on one LocalModule, each with its own input."""
    import torch

    lm = world.module(world.mesh, timeout=HANG_S)
    wrong: list = []
    errors: list = []
    start = threading.Barrier(THREADS)

    def run(t: int) -> None:
        start.wait()
        for i in range(PER_THREAD):
            x = torch.full((2, 1), 1000.0 * t + i)
            try:
                got = lm(x).full_tensor()
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            if not torch.equal(got, expected(x, 3)):
                wrong.append((t, i, got.reshape(-1).tolist()))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    began = _clock()
    for th in threads:
        th.start()
    for th in threads:
        th.join(HANG_S)
    return {"forwards": THREADS * PER_THREAD, "errors": errors[:3], "wrong": wrong[:3],
            "alive": sum(th.is_alive() for th in threads), "seconds": _clock() - began,
            "held_after": world.settled(world.mesh, baseline)}


def frozen(world: World, baseline: dict) -> dict:
    """w2 stopped; every call touching it runs at once, in threads; [w1, w3] work meanwhile."""
    from torch.distributed.tensor import Replicate

    from tests._faults.frozen_host import wait_for_state

    lm = world.module(world.mesh)
    healthy_mesh = ["w1", "w3"]
    healthy = world.module(healthy_mesh, timeout=HANG_S)
    x, rt = sharded_input(world.mesh, 6)
    pid = world.pids["w2"]
    entered = world.counts("w2")["entered"]
    os.kill(pid, signal.SIGSTOP)
    wait_for_state(pid, stopped=True)
    try:
        report = concurrently({
            "forward": lambda: lm(rt),  # noqa: F821
            "full_tensor": lambda: rt.full_tensor(timeout=TIMEOUT),  # noqa: F821
            "local_shards": lambda: rt.local_shards(timeout=TIMEOUT),  # noqa: F821
            "redistribute": lambda: rt.redistribute(Replicate(), timeout=TIMEOUT),  # noqa: F821
            "peer_fetch": lambda: peer_fetch(rt, 1),  # noqa: F821
        })
        for outcome in report.values():
            outcome["timeout"] = TIMEOUT
        hx, hrt = sharded_input(healthy_mesh, 4, 50.0)
        report["healthy"] = attempt(lambda: bool(
            (healthy(hrt).full_tensor() == sharded_expected(hx, 2)).all()  # noqa: F821
            and (healthy(hx).full_tensor() == expected(hx, 2)).all()
            and (hrt.redistribute(Replicate()).full_tensor() == hx).all()))  # noqa: F821
        del hrt
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for_state(pid, stopped=False)
    lm.timeout = HANG_S
    report["after"] = attempt(lambda: bool((lm(rt).full_tensor() == sharded_expected(x, 3)).all()  # noqa: F821
                                           and (rt.full_tensor() == x).all()))  # noqa: F821
    del rt
    # w2 ran the forward that reached it frozen (late) and the one after
    report["held_after"] = world.settled(world.mesh, baseline, ran={"w2": entered + 2})
    return report


def killed(world: World, baseline: dict) -> dict:
    """w3 kills itself in a forward; then the calls touching it; [w1, w2] work meanwhile."""
    from torch.distributed.tensor import Replicate

    from tests._faults.dead_host import wait_until_dead

    lm = world.module(world.mesh)
    survivors = ["w1", "w2"]
    healthy = world.module(survivors, timeout=HANG_S)
    x, rt = sharded_input(world.mesh, 6)
    world.configure("w3", die_on=float(x[-1]))  # w3's shard holds the last rows
    report = {"forward": attempt(lambda: lm(rt))}  # noqa: F821
    # (sent to w3 in any case: if the forward timed out first on a slow machine, w3 dies late)
    wait_until_dead(world.pids["w3"])
    report.update(concurrently({
        "again": lambda: lm(rt),  # noqa: F821
        "full_tensor": lambda: rt.full_tensor(timeout=TIMEOUT),  # noqa: F821
        "local_shards": lambda: rt.local_shards(timeout=TIMEOUT),  # noqa: F821
        "redistribute": lambda: rt.redistribute(Replicate(), timeout=TIMEOUT),  # noqa: F821
        "peer_fetch": lambda: peer_fetch(rt, 2),  # noqa: F821
    }))
    for name in ("forward", "again", "full_tensor", "local_shards", "redistribute", "peer_fetch"):
        report[name]["timeout"] = TIMEOUT
    hx, hrt = sharded_input(survivors, 4, 70.0)
    report["healthy"] = attempt(lambda: bool(
        (healthy(hrt).full_tensor() == sharded_expected(hx, 2)).all()  # noqa: F821
        and (hrt.redistribute(Replicate()).full_tensor() == hx).all()))  # noqa: F821
    del rt, hrt  # releases to the dead w3 must not hold up those to the survivors
    report["held_after"] = world.settled(survivors, baseline)
    return report


def faults_caller() -> None:
    world = World()
    baseline = world.held()
    report = {"timeout": TIMEOUT, "baseline": baseline}
    for name, run in (("slow", slow), ("burst", burst), ("frozen", frozen), ("killed", killed)):
        report[name] = phase(run, world, baseline)
        gc.collect()
    print("REPORT " + json.dumps(report), flush=True)
    os._exit(0)


def shutdown_caller() -> dict:
    """Forwards and fetches in a thread; ``rpc.shutdown()`` while one forward runs on the hosts,
    with 20 RemoteTensors dropped just before (their releases queued) and 5 after."""
    import torch
    import torch.distributed.rpc as rpc
    from torch.distributed.tensor import Shard

    from remote_module.sharded import LocalModule, _tensor, distribute
    from tests._faults import gates
    from tests._faults import stages as pfr

    caught: list[str] = []
    threading.excepthook = lambda args: caught.append(
        f"thread {args.thread.name}: {args.exc_type.__name__}: {args.exc_value}"
    )
    sys.unraisablehook = lambda u: caught.append(f"unraisable: {u.exc_type.__name__}: {u.exc_value}")
    mesh = ["w1", "w2"]
    lm = LocalModule(mesh, pfr.Step, step_args, out_placements=Shard(0), timeout=HANG_S)
    for w in mesh:
        rpc.rpc_sync(w, gates.release_at_shutdown, (SHUTDOWN_GATE,))
    dropped_before = [distribute(torch.ones(4, 1), mesh, Shard(0), timeout=HANG_S) for _ in range(20)]
    dropped_after = [distribute(torch.ones(4, 1), mesh, Shard(0), timeout=HANG_S) for _ in range(5)]
    ops: list[dict] = []  # one per call made by the thread, in order
    stop = threading.Event()

    def run() -> None:
        i = 0
        while not stop.is_set() and i < 200:
            if i == 1:  # the next forward is held until the shutdown (the first ran freely)
                for w in mesh:
                    rpc.rpc_sync(w, pfr.configure, (TAG,), {"gate": SHUTDOWN_GATE})
            x = torch.full((2, 1), float(i))
            op = {"kind": "forward", "made": _clock()}
            ops.append(op)
            box = {}
            # the answer's metadata: known on the caller without another call
            op.update(attempt(lambda: box.setdefault("out", lm(x)).shape == (4, 1)))
            if not op["ok"]:
                return
            fetch = {"kind": "full_tensor", "made": _clock()}
            ops.append(fetch)
            fetch.update(attempt(lambda: bool(torch.equal(box["out"].full_tensor(), expected(x, 2)))))
            if not fetch["ok"]:
                return
            i += 1

    def running_forward() -> int | None:
        """The index of a forward the hosts run now (made, sent, not answered), if any."""
        index = len(ops) - 1
        if index < 2 or ops[index]["kind"] != "forward" or "ok" in ops[index]:
            return None
        c = rpc.rpc_sync("w1", pfr.counts, (TAG,))
        return index if c["entered"] > c["left"] and "ok" not in ops[index] else None

    thread = threading.Thread(target=run, name="forwards")
    thread.start()
    found: list[int] = []
    wait_until(lambda: found.append(running_forward()) or found[-1] is not None, HANG_S,
               "a forward running on the hosts")
    in_flight = found[-1]
    dropped_before.clear()
    gc.collect()
    unanswered = "ok" not in ops[in_flight]
    start = _clock()
    rpc.shutdown()
    shutdown_seconds = _clock() - start
    stop.set()
    thread.join(HANG_S)
    dropped_after.clear()  # RPC is down: the releaser finds nothing to free
    gc.collect()
    releaser = _tensor._releaser._thread
    time.sleep(0.2)  # proving an absence (a crash of the releaser after the drop): nothing to poll
    for op in ops:
        op["made"] -= start
    return {"in_flight": in_flight, "unanswered_at_shutdown": unanswered, "ops": ops, "thread_alive": thread.is_alive(),
            "shutdown_seconds": shutdown_seconds, "caught": caught,
            "releaser_alive": releaser is not None and releaser.is_alive()}


def main(role: str, init_method: str, mode: str) -> None:
    run_role(ROLES[mode], role, init_method, mode, faults_caller, shutdown_caller)


if __name__ == "__main__":
    main(*sys.argv[1:])
