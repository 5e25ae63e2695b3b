"""The only place in ``rpc_backend`` that touches private ``torch.distributed.rpc`` APIs.

A torch upgrade that moves one of these breaks this file and nothing else in the package.
"""

from __future__ import annotations

import torch.distributed.rpc as rpc

#: The ``timeout`` that makes ``rpc.shutdown(graceful=True)`` wait without a deadline. In torch
#: 2.13 (rpc/api.py, ``_all_gather``) this value (0) means "no timeout" for both the gather's
#: RPCs and its proceed signal; any other number bounds each of them.
UNBOUNDED_SHUTDOWN_TIMEOUT: float = rpc.constants.DEFAULT_SHUTDOWN_TIMEOUT


def is_rpc_initialized() -> bool:
    """True between ``rpc.init_rpc`` and ``rpc.shutdown`` in this process."""
    return rpc.is_available() and rpc.api._is_current_rpc_agent_set()


def current_agent_token() -> int:
    """An identity of this process's current RPC agent (a new one per ``rpc.init_rpc``; 0 when
    RPC is not initialized), to tell one world from the next."""
    return id(rpc.api._get_current_rpc_agent()) if is_rpc_initialized() else 0
