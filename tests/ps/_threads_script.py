"""Run by tests/ps/test_table_threads.py in a process of its own (a hang takes its world
down): threads of one trainer looking up one sharded table with grad on, as fast as they
can, for a few seconds. Prints one JSON line: per thread, lookups done and whether it ended."""

from __future__ import annotations

import json
import sys
import threading
import time

from tests._deadlines import HANG_S, SETUP_S

THREADS, SECONDS = 4, 3.0


def body() -> dict | None:
    import torch

    from remote_module.ps import ShardedEmbedding, ShardedEmbeddingBag
    from rpc_backend import current_worker

    if current_worker().role != "trainer":
        return None
    servers = current_worker().workers("ps")
    emb = ShardedEmbedding(100, 4, servers, name="threads-emb")
    bag = ShardedEmbeddingBag(100, 4, servers, name="threads-bag", mode="sum")
    done = [0] * THREADS
    start = threading.Barrier(THREADS)
    stop = time.monotonic() + SECONDS

    def run(k: int) -> None:
        start.wait()
        ids = torch.tensor([[k, 1, 2]])
        while True:  # at least once, however late this thread started
            emb(ids).sum().backward()
            bag(ids).sum().backward()
            done[k] += 1
            if time.monotonic() >= stop:
                break

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=SECONDS + HANG_S)  # a hang guard: a deadlocked thread is reported as not ended
    emb.zero_grad()
    bag.zero_grad()
    return {"lookups": done, "ended": [not t.is_alive() for t in threads]}


if __name__ == "__main__":
    from rpc_backend import run_local

    out = run_local(body, 2, roles={"ps": 1, "trainer": 1}, rpc_timeout=SETUP_S)
    print(json.dumps(out[1]))
    sys.stdout.flush()
