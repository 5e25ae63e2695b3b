"""TensorPipe options for the worlds the tests start themselves.

They use the library's default transport (``rpc_backend.make_options``: uv, which does not
spin when idle), as ``run_local`` and ``init_from_env`` do: the session keeps two long-lived
worlds (4 + 7 ranks) beside the short ones, and on 2 cores spinning ranks would cost the
suite more than the tests themselves. ``REMOTE_MODULE_TEST_TRANSPORT=shm`` runs them on
torch's defaults instead (shared memory, busy-polling).
"""

from __future__ import annotations

import os
from typing import Any


def chosen_transport() -> str:
    """The transport of the test worlds: ``$REMOTE_MODULE_TEST_TRANSPORT`` or the default."""
    from rpc_backend.options import DEFAULT_TRANSPORT, TRANSPORTS

    name = os.environ.get("REMOTE_MODULE_TEST_TRANSPORT", DEFAULT_TRANSPORT)
    if name not in TRANSPORTS:
        raise ValueError(f"REMOTE_MODULE_TEST_TRANSPORT must be one of {TRANSPORTS}, got {name!r}")
    return name


def world_options(**kwargs: Any) -> Any:
    """``rpc.TensorPipeRpcBackendOptions(**kwargs)`` on the test worlds' transport."""
    import torch.distributed.rpc as rpc

    from rpc_backend.options import transport_kwargs

    for key, value in transport_kwargs(chosen_transport()).items():
        kwargs.setdefault(key, value)
    return rpc.TensorPipeRpcBackendOptions(**kwargs)
