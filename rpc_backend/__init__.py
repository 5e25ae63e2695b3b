"""rpc_backend: start, configure and stop ``torch.distributed.rpc`` worlds.

Knows nothing of ``remote_module``; everything above builds on it.
"""

from rpc_backend.local import LocalWorldError, run_local
from rpc_backend.loopback import fresh_file_rendezvous, loopback_env, loopback_interface

__all__ = ["run_local", "LocalWorldError", "loopback_env", "loopback_interface", "fresh_file_rendezvous"]
