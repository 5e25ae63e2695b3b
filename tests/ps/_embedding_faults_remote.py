"""What tests/ps/test_embedding_faults.py runs on its trainers and servers (tables built by
tests/ps/_embedding_edge_cases_remote.table)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from tests._deadlines import HANG_S
from tests.ps._embedding_edge_cases_remote import _objects, attempt, table


def prepare(name: str, ids: list[int] | None, **kwargs: Any) -> bool:
    """A table kept here, with a lookup of ``ids`` backpropagated (its gradient waits for a step)."""
    t = table(name, **kwargs)
    if ids is not None:
        t(torch.tensor(ids)).pow(2).sum().backward()
    return True


def set_timeout(name: str, seconds: float | None) -> bool:
    """The timeout of the object kept as ``name`` (a table, a collection, a PSModel; the first
    of a tuple) from now on: the tests set the one they test only while the fault holds."""
    obj = _objects[name]
    (obj[0] if isinstance(obj, tuple) else obj).timeout = seconds
    return True


def with_timeout(name: str, seconds: float | None, fn, *args: Any) -> Any:
    """:func:`set_timeout`, then ``fn(*args)``."""
    set_timeout(name, seconds)
    return fn(*args)


def timed(name: str, what: str, timeout: float, ids: list[int] | None = None) -> dict:
    """``what`` ("lookup", "eval", "step", "backward", "rows") on table ``name`` with ``timeout``: how it ended."""
    t = _objects[name]
    t.timeout = timeout
    ids_t = torch.tensor(ids if ids is not None else [1, 15])
    def evaluate() -> torch.Tensor:
        with torch.no_grad():
            return t(ids_t.reshape(1, -1))

    return attempt({
        "lookup": lambda: t(ids_t.reshape(1, -1)).detach(),
        "eval": evaluate,  # records nothing: of a table one server holds, one call waited for here
        "step": lambda: (t.step(), t.flush()),  # (async: the step returns with its pushes in flight; flush lands them)
        "backward": lambda: t(ids_t).pow(2).sum().backward(),
        "rows": lambda: t.state_dict()["weight"],
    }[what])


def waiters(name: str) -> int:
    """On a server: the sync lookups of table ``name`` still waiting."""
    from remote_module.ps.tables.server import _handlers

    table = _handlers._table(name)
    with table.lock:
        return len(table.sync.waiters)


def shutdown_during_lookups(name: str, path: str) -> bool:
    """Threads looking up table ``name`` while this trainer's RPC agent is shut down (not
    gracefully: the servers of these worlds wait in their own shutdown); each thread's last
    outcome is written to ``path`` as JSON once all have ended (or a hang guard's time passed)."""
    import json

    import torch.distributed.rpc as rpc

    t = table(name, servers=["ps0"], rows=200, seed=None)
    outcomes: dict[int, dict] = {}
    started = threading.Barrier(4)

    def look(k: int) -> None:
        started.wait()
        while True:
            outcome = attempt(lambda: t(torch.arange(200)).shape)
            if not outcome["ok"]:
                outcomes[k] = outcome
                return

    def run() -> None:
        threads = [threading.Thread(target=look, args=(k,), daemon=True) for k in range(3)]
        for th in threads:
            th.start()
        started.wait()
        time.sleep(0.2)
        rpc.shutdown(graceful=False)
        deadline = time.monotonic() + HANG_S  # a hang guard for them all
        for th in threads:
            th.join(timeout=max(0.0, deadline - time.monotonic()))
        with open(path + ".tmp", "w") as f:
            json.dump({"ended": [not th.is_alive() for th in threads], "outcomes": list(outcomes.values())}, f)
        import os

        os.replace(path + ".tmp", path)

    threading.Thread(target=run, daemon=True).start()
    return True


def prepare_collection(name: str, **kwargs: Any) -> bool:
    """A collection of two plain sum bags over ps0 and ps1 (planned and pushed packed), kept
    here, with a lookup backpropagated (its gradients wait for a step)."""
    from remote_module.ps import ShardedEmbeddingBagCollection

    ebc = ShardedEmbeddingBagCollection({k: table(f"{name}-{k}", bag="sum", keep=False, **kwargs) for k in "ab"})
    _objects[name] = ebc
    ebc({"a": torch.tensor([[1, 15]]), "b": torch.tensor([[2, 16]])})["a"].sum().backward()
    return True


def timed_collection(name: str, what: str, timeout: float) -> dict:
    """``what`` ("forward", "eval", "step") on collection ``name`` with ``timeout``: how it ended."""
    ebc = _objects[name]
    ebc.timeout = timeout
    feats = {"a": torch.tensor([[1, 15]]), "b": torch.tensor([[2, 16]])}

    def evaluate() -> dict:
        with torch.no_grad():
            return ebc(feats)

    return attempt({"forward": lambda: ebc(feats)["a"].sum().backward(), "eval": evaluate,
                    "step": lambda: (ebc.step(), ebc.flush())}[what])
