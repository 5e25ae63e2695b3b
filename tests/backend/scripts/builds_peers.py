"""How often rpc_backend.builds asks a peer for its builds, in worlds of one rank (run by
tests/backend/test_builds_peers.py; prints one JSON object of outcomes).

``builds._rpc_async`` is replaced by :class:`Peers`, which answers the questions in this process
(this process's builds, or another build's), when the scenario releases them: so what is
counted is the questions, whatever the machine's speed. Every scenario allocates between its
calls, as a program does (the identity of a world must not depend on what memory is reused).

    python3 tests/backend/scripts/builds_peers.py RENDEZVOUS_DIR
"""

import _thread
import json
import sys
import threading

import torch
import torch.distributed.rpc as rpc

import remote_module  # noqa: F401 - declares its build, as a job's script does
import rpc_backend
from remote_module._proxy.calls import RemoteCalls
from rpc_backend import builds

GATE_S = 300.0  # tests/_deadlines.py HANG_S


class Peers:
    """What ``builds._rpc_async`` sends, answered here: ``asked`` lists (peer, packages)."""

    def __init__(self, other_build: bool = False) -> None:
        self.asked: list[tuple[str, list[str]]] = []
        self.other_build = other_build
        self.held: list[tuple[torch.futures.Future, list]] = []
        self.released = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, name, fn, args, timeout=0):
        assert fn is builds.answer_builds, fn
        sent = torch.futures.Future()
        with self.lock:
            self.asked.append((name, list(args[0])))
            if not self.released.is_set():
                self.held.append((sent, list(args[0])))
                return sent
        sent.set_result(self.answer(args[0]))
        return sent

    def answer(self, packages):
        answer = builds.answer_builds(packages)
        if self.other_build:
            for build in answer["builds"].values():
                build["version"] = "9.9-other"
        return answer

    def release(self) -> None:
        with self.lock:
            self.released.set()
            held, self.held = self.held, []
        for sent, packages in held:
            sent.set_result(self.answer(packages))


def world(directory: str, n: int) -> None:
    options = rpc_backend.make_options(init_method=f"file://{directory}/rendezvous{n}", rpc_timeout=GATE_S)
    rpc.init_rpc("w0", rank=0, world_size=1, rpc_backend_options=options)


def churn(junk: list) -> None:
    junk.append([torch.zeros(3) for _ in range(5)])  # ordinary allocations between two calls


def outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except builds.BuildMismatch as exc:
        return f"BuildMismatch: {exc}"


def burst(peers: Peers) -> dict:
    """16 threads' first calls at once, and 200 more calls: one question."""
    start = threading.Barrier(17)
    results = []

    def first():
        start.wait(GATE_S)
        results.append(outcome(lambda: builds.check_peer("peer1", GATE_S)))

    threads = [threading.Thread(target=first) for _ in range(16)]
    for t in threads:
        t.start()
    start.wait(GATE_S)
    junk: list = []
    for _ in range(50):
        churn(junk)
    peers.release()
    for t in threads:
        t.join(GATE_S)
    for _ in range(200):
        churn(junk)
        results.append(outcome(lambda: builds.check_peer("peer1", GATE_S)))
    return {"questions": len(peers.asked), "outcomes": sorted(set(results))}


def remembered(peers: Peers) -> dict:
    """A mismatch found is raised at every later call in the world, without asking again."""
    peers.release()
    junk: list = []
    seen = []
    for _ in range(100):
        churn(junk)
        seen.append(outcome(lambda: builds.check_peer("peer1", GATE_S)).split(":")[0])
    return {"questions": len(peers.asked), "outcomes": sorted(set(seen))}


def formed(peers: Peers) -> dict:
    """A world compared when it formed asks nobody; a package declared later, once per peer."""
    peers.release()
    builds.world_checked(["rpc_backend", "remote_module"])
    junk: list = []
    for _ in range(100):
        churn(junk)
        builds.check_peer("peer1", GATE_S)
    before = len(peers.asked)
    builds.declare_build("late_package_of_this_test", "1.0", names=lambda: ["late_package_of_this_test.m:f(x)"])
    for _ in range(50):
        churn(junk)
        builds.check_peer("peer1", GATE_S)
        builds.check_peer("peer2", GATE_S)
    return {"before": before, "asked": peers.asked}


def handler_thread_proxy(peers: Peers) -> dict:
    """A proxy whose first call ran on an RPC handler thread (no wait) still checks later."""
    proxy = type("Proxy", (), {"_host_info": rpc.WorkerInfo("peer1", 1), "on": "peer1",
                               "_timeout_s": lambda self: GATE_S})()
    done = threading.Event()
    first = []

    def on_handler_thread():  # a thread Python did not start, as torch's handler threads
        first.append(outcome(lambda: RemoteCalls._dest(proxy)))
        done.set()

    _thread.start_new_thread(on_handler_thread, ())
    assert done.wait(GATE_S)
    peers.release()  # the answer: another build
    return {"first": first[0], "later": outcome(lambda: RemoteCalls._dest(proxy)), "questions": len(peers.asked)}


def main(directory: str) -> None:
    found = {}
    scenarios = [("burst", burst, False), ("remembered", remembered, True), ("formed", formed, False),
                 ("handler_thread_proxy", handler_thread_proxy, True), ("next_world", burst, False)]
    for n, (label, scenario, other) in enumerate(scenarios):
        peers = Peers(other)
        builds._rpc_async = peers
        world(directory, n)
        try:
            found[label] = scenario(peers)
        except Exception as exc:  # noqa: BLE001 - reported, the next scenario runs
            found[label] = f"{type(exc).__name__}: {exc}"
        finally:
            rpc.shutdown()
    print(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1])
