"""remote_module: run ``nn.Module``s on other processes and machines over torch RPC.

``RemoteModule`` is a drop-in replacement for ``torch.distributed.nn.RemoteModule``;
``clip_grad_norm_(ctx, model.parameters(), max_norm)`` is torch's gradient clipping for a model
trained inside a ``torch.distributed.autograd`` context (whose gradients are not in ``.grad``).
"""

from remote_module._core import CallTimeout, RemoteModuleError
from remote_module._proxy import PICKLED_ATTRIBUTES, UNSUPPORTED_METHODS, clip_grad_norm_
from remote_module.remote_module import RemoteModule

__all__ = [
    "RemoteModule", "RemoteModuleError", "CallTimeout", "PICKLED_ATTRIBUTES", "UNSUPPORTED_METHODS", "clip_grad_norm_",
]
__version__ = "0.1.0"
