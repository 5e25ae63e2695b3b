"""The only place in ``rpc_backend`` that touches private ``torch.distributed.rpc`` APIs.

A torch upgrade that moves one of these breaks this file and nothing else in the package.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch.distributed.rpc as rpc

#: The ``timeout`` that makes ``rpc.shutdown(graceful=True)`` wait without a deadline. In torch
#: 2.13 (rpc/api.py, ``_all_gather``) this value (0) means "no timeout" for both the gather's
#: RPCs and its proceed signal; any other number bounds each of them.
UNBOUNDED_SHUTDOWN_TIMEOUT: float = rpc.constants.DEFAULT_SHUTDOWN_TIMEOUT


def is_rpc_initialized() -> bool:
    """True between ``rpc.init_rpc`` and ``rpc.shutdown`` in this process."""
    return rpc.is_available() and rpc.api._is_current_rpc_agent_set()


_world_hooks: list[Callable[[], None]] = []


def after_each_rpc_init(hook: Callable[[], None]) -> None:
    """Run ``hook()`` each time this process joins a new RPC world: inside ``rpc.init_rpc``,
    right after torch made the new agent current (before it returns, and before any call of
    the new world's is made here). Registered once per hook.

    torch 2.13 sets the agent once per world in ``torch.distributed.rpc.api._init_rpc_states``
    through ``_set_and_start_rpc_agent`` (looked up as a global of ``api`` at call time); that
    step is wrapped once per process. A hook must not fail: what it raises is logged.
    """
    if hook in _world_hooks:
        return
    _world_hooks.append(hook)
    if len(_world_hooks) > 1:  # the first hook wrapped the step already
        return
    api = rpc.api
    original = api._set_and_start_rpc_agent

    def set_and_start_rpc_agent(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        for run in list(_world_hooks):
            try:
                run()
            except Exception:
                logging.getLogger("rpc_backend").exception("a hook run at rpc.init_rpc failed")
        return result

    api._set_and_start_rpc_agent = set_and_start_rpc_agent
