"""The only place in ``rpc_backend`` that touches private ``torch.distributed.rpc`` APIs.

A torch upgrade that moves one of these breaks this file and nothing else in the package.
"""

from __future__ import annotations

import torch.distributed.rpc as rpc


def is_rpc_initialized() -> bool:
    """True between ``rpc.init_rpc`` and ``rpc.shutdown`` in this process."""
    return rpc.is_available() and rpc.api._is_current_rpc_agent_set()
