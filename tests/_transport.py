"""TensorPipe options for the worlds the tests start themselves.

TensorPipe's shared-memory transport busy-polls: every rank of a world that has exchanged
messages burns about half a core while idle, and the test session keeps two long-lived worlds
(4 + 7 ranks) beside the short ones. On a 2-core machine that spinning costs the suite more
than the tests themselves, so test worlds use the uv transport (TCP on loopback, no spinning)
and the basic channel. ``REMOTE_MODULE_TEST_TRANSPORT=shm`` gives them TensorPipe's defaults.
The library's own defaults (``rpc_backend.make_options``) are not changed by this.
"""

from __future__ import annotations

import os
from typing import Any


def world_options(**kwargs: Any) -> Any:
    """``rpc.TensorPipeRpcBackendOptions(**kwargs)`` on the test worlds' transport."""
    import torch.distributed.rpc as rpc

    if os.environ.get("REMOTE_MODULE_TEST_TRANSPORT", "uv") == "uv":
        kwargs.setdefault("_transports", ["uv"])
        kwargs.setdefault("_channels", ["basic"])
    return rpc.TensorPipeRpcBackendOptions(**kwargs)
