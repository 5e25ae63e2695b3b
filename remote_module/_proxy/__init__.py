"""What only ``RemoteModule`` uses: the proxy's machinery, imported by ``remote_module.remote_module``.

- ``calls``: the calling half of a proxy (blocking calls, futures, the call contract);
- ``call_records``: the records a call and its answer travel as;
- ``context_grads``: gradients inside a distributed autograd context (``clip_grad_norm_``, the
  handle's warning when ``.grad`` is read there);
- ``channel``: the coalescing channel (several small calls in one message);
- ``codegen``: rendering ``forward``/``forward_async`` from the module's real signature;
- ``creation``: creating the module on its host;
- ``idioms``: freezing, casting and deep-copying a proxy as torch does a local module (the
  ``remote_requires_grad`` handle, the casts a model's ``_apply`` makes);
- ``_host`` and ``_host_calls``: the handlers that run on the host (creation, description,
  ``state_dict``, ``requires_grad``, casts, deep copies; the forward calls);
- ``pickling``: what travels when a proxy is itself sent (``PICKLED_ATTRIBUTES``);
- ``shipping``: sending classes defined in ``__main__`` or a script by value;
- ``state_dict`` and ``module_state``: ``state_dict``/``load_state_dict`` plumbing;
- ``unsupported``: the ``nn.Module`` methods a proxy refuses (one table);
- ``wire``: the format of small calls inlined in a message;
- ``batching``: joining concurrent calls on the host (``BatchPolicy``).

The layers above the proxy (``pipeline``, ``sharded``, ``ps``, ``serving``) use ``RemoteModule`` and the
names listed in ``__all__`` here, never these modules.
"""

from remote_module._proxy.batching import BatchPolicy, checked_policy
from remote_module._proxy.context_grads import clip_grad_norm_
from remote_module._proxy.pickling import PICKLED_ATTRIBUTES
from remote_module._proxy.unsupported import UNSUPPORTED_METHODS

__all__ = ["PICKLED_ATTRIBUTES", "UNSUPPORTED_METHODS", "clip_grad_norm_", "BatchPolicy", "checked_policy"]
