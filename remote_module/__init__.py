"""remote_module: run ``nn.Module``s on other processes and machines over torch RPC.

``RemoteModule`` is a drop-in replacement for ``torch.distributed.nn.RemoteModule``;
``clip_grad_norm_(ctx, model.parameters(), max_norm)`` is torch's gradient clipping for a model
trained inside a ``torch.distributed.autograd`` context (whose gradients are not in ``.grad``).

Every rank of a world runs one build of this package: its handlers travel by name, so the
version and the names of its module-level functions and classes are declared here
(``rpc_backend.declare_build``) and compared when a world forms through ``rpc_backend``, or at
the first call to each peer after a plain ``rpc.init_rpc`` (``rpc_backend/builds.py``); a rank of
another build fails with ``rpc_backend.BuildMismatch`` naming both.
"""

from remote_module._core import CallTimeout, RemoteModuleError
from remote_module._proxy import PICKLED_ATTRIBUTES, UNSUPPORTED_METHODS, BatchPolicy, clip_grad_norm_
from remote_module.remote_module import RemoteModule
from rpc_backend.builds import declare_build

__all__ = [
    "RemoteModule", "RemoteModuleError", "CallTimeout", "BatchPolicy", "PICKLED_ATTRIBUTES", "UNSUPPORTED_METHODS",
    "clip_grad_norm_",
]
__version__ = "0.1.0"

declare_build("remote_module", __version__)
