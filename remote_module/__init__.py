"""remote_module: run ``nn.Module``s on other processes and machines over torch RPC.

``RemoteModule`` is a drop-in replacement for ``torch.distributed.nn.RemoteModule``.
"""

from remote_module._core import CallTimeout, RemoteModuleError
from remote_module._proxy import PICKLED_ATTRIBUTES, UNSUPPORTED_METHODS
from remote_module.remote_module import RemoteModule

__all__ = ["RemoteModule", "RemoteModuleError", "CallTimeout", "PICKLED_ATTRIBUTES", "UNSUPPORTED_METHODS"]
__version__ = "0.1.0"
