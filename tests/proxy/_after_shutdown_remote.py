"""Rank function for tests/proxy/test_after_shutdown.py: a proxy on the agent's default timeout,
used once, then used again after a graceful ``rpc.shutdown()``."""

import torch
import torch.distributed.rpc as rpc


def use_after_shutdown() -> list | None:
    """On rank 0: ``[(type name, message)]`` of forward, forward_async and training after shutdown."""
    if rpc.get_worker_info().id != 0:
        return None
    from remote_module import RemoteModule

    proxy = RemoteModule("worker1/cpu", torch.nn.Linear, (2, 2))  # timeout=None: the agent's
    proxy(torch.ones(2))
    rpc.shutdown()
    found = []
    for attempt in (
        lambda: proxy(torch.ones(2)),
        lambda: proxy.forward_async(torch.ones(2)).wait(),
        lambda: proxy.training,
    ):
        try:
            attempt()
            found.append(("no error", ""))
        except Exception as exc:
            found.append((type(exc).__name__, str(exc)))
    return found


def warnings_after_shutdown() -> list | None:
    """On rank 0: a proxy used under no_grad only (so it never warned of training outside dist
    autograd), then called with grad on after ``rpc.shutdown()``: ``(error type, warnings)``
    per call. A call that cannot run records nothing and must not warn."""
    if rpc.get_worker_info().id != 0:
        return None
    import warnings

    from remote_module import RemoteModule

    proxy = RemoteModule("worker1/cpu", torch.nn.Linear, (2, 2))
    with torch.no_grad():
        proxy(torch.ones(2))
    rpc.shutdown()
    found = []
    for attempt in (lambda: proxy(torch.ones(2)), lambda: proxy.forward_async(torch.ones(2)).wait()):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            try:
                attempt()
                kind = "no error"
            except Exception as exc:
                kind = type(exc).__name__
        found.append((kind, [str(w.message)[:60] for w in got if "autograd context" in str(w.message)]))
    return found
