"""Timeouts and deadlines: the one place a timeout is normalised and turned into torch's argument.

Every layer takes ``timeout=`` the same way: ``None`` means the RPC agent's default (whose 0
means "none"), anything else is checked seconds in ``[0.001, 2**31 / 1000)``
(:func:`rpc_backend.options.positive_seconds`). Inside the package "no limit" is
``math.inf``; torch's RPC functions spell it ``0``, which :func:`rpc_timeout_argument` writes.

Example (any worker after ``rpc.init_rpc``)::

    from remote_module._core import rpc_timeout_argument, timeout_seconds

    seconds = timeout_seconds(None)            # the agent's default, e.g. 60.0
    deadline = time.monotonic() + seconds
    rpc.rpc_async("worker1", fn, timeout=rpc_timeout_argument(deadline - time.monotonic()))
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch.distributed.rpc as rpc

from remote_module._core.errors import CallTimeout
from rpc_backend.options import positive_seconds


def agent_timeout_seconds() -> float:
    """The RPC agent's default timeout in seconds (``math.inf`` when it has none).

    Raises torch's ``RuntimeError`` when this process has no agent (before ``init_rpc``, after
    ``shutdown``); callers that can say more about what to do catch it."""
    seconds = rpc.get_rpc_timeout()
    return seconds if seconds > 0 else math.inf


def timeout_seconds(timeout: float | None) -> float:
    """``timeout`` checked, in seconds (``None``: the agent's default; ``math.inf``: none).

    Example::

        >>> timeout_seconds(2)
        2.0
    """
    if timeout is None:
        return agent_timeout_seconds()
    return positive_seconds(timeout, "timeout")


def rpc_timeout_argument(remaining: float) -> float:
    """torch RPC's ``timeout`` argument for ``remaining`` seconds: ``0`` (torch's "none") for
    ``math.inf``, otherwise at least 1 ms (torch counts whole milliseconds, and 0 ms would mean
    "none")."""
    return 0 if remaining == math.inf else max(remaining, 0.001)


def wait_for_earlier_calls(proxies: Sequence[Any], deadline: float, name: Callable[[int, Any], str],
                           within: str) -> None:
    """Keep program order before a layer calls the hosts of ``proxies`` (RemoteModules) by
    other means than the proxies themselves: wait until every call this thread made earlier
    on each proxy was answered. A proxy whose earlier calls were not answered by ``deadline``
    (``time.monotonic()``) fails the whole with a :class:`CallTimeout` naming it
    (``name(index, proxy)``) and the timeout (``within``).

    Example (a pipeline's forward, before it sends its micro-batches)::

        wait_for_earlier_calls(stages, made + seconds, lambda i, s: f"pipeline stage {i} on worker {s.on!r}",
                               f"the pipeline's timeout ({seconds:g} s)")
    """
    for index, proxy in enumerate(proxies):
        if not proxy._earlier_calls_done(deadline):
            raise CallTimeout(
                f"{name(index, proxy)}: earlier calls this thread made on its proxy were not answered within {within}"
            )
