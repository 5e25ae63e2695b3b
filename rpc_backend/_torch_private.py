"""The only place that touches private ``torch.distributed.rpc`` / TorchScript APIs.

A torch upgrade that moves one of these breaks this file and nothing else.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed.autograd as _dist_autograd
import torch.distributed.rpc as rpc


#: The ``timeout`` that makes ``rpc.shutdown(graceful=True)`` wait without a deadline. In torch
#: 2.13 (rpc/api.py, ``_all_gather``) this value (0) means "no timeout" for both the gather's
#: RPCs and its proceed signal; any other number bounds each of them.
UNBOUNDED_SHUTDOWN_TIMEOUT: float = rpc.constants.DEFAULT_SHUTDOWN_TIMEOUT


def is_rpc_initialized() -> bool:
    """True between ``rpc.init_rpc`` and ``rpc.shutdown`` in this process."""
    return rpc.is_available() and rpc.api._is_current_rpc_agent_set()


def register_rpc_reducer(cls: type, reducer: Callable[[Any], tuple]) -> None:
    """Make the RPC pickler serialize instances of exactly ``cls`` with ``reducer``.

    ``reducer(obj)`` returns a ``(callable, args)`` pair as ``__reduce__`` does. It applies only
    inside RPC messages; plain ``pickle`` keeps using the class's own ``__reduce_ex__``.
    Registering the same class twice keeps the first reducer (as torch does).
    """
    from torch.distributed.rpc.internal import _internal_rpc_pickler

    _internal_rpc_pickler._register_reducer(cls, reducer)


def device_map_to(worker: str | int) -> dict:
    """This worker's device map towards ``worker`` (empty when none is set)."""
    agent = rpc.api._get_current_rpc_agent()
    return dict(agent._get_device_map(agent.get_worker_info(worker)))


def interface_forward_schema(interface_cls: type) -> Any:
    """The TorchScript schema of ``forward`` on a ``@torch.jit.interface`` class."""
    qualified_name = torch._jit_internal._qualified_name(interface_cls)
    interface = torch.jit._state._python_cu.get_interface(qualified_name)
    return interface.getMethod("forward")


def is_jit_interface(cls: Any) -> bool:
    """True for classes decorated with ``@torch.jit.interface``."""
    return isinstance(cls, type) and bool(getattr(cls, "__torch_script_interface__", False))


def rpc_serialize(obj: Any) -> None:
    """Serialize ``obj`` exactly as an RPC message would (raises what sending would raise)."""
    from torch.distributed.rpc.internal import _internal_rpc_pickler

    _internal_rpc_pickler.serialize(obj)


def worker_names() -> list[str]:
    """The names of all workers in the current RPC world."""
    return sorted(w.name for w in rpc.api._get_current_rpc_agent().get_worker_infos())


def dist_autograd_contexts_exist() -> bool:
    """True when any distributed autograd context is alive in this process (~0.4 µs).

    Conservative for "is this thread recording?": a context held by another thread, or
    created here by an incoming message, also counts.
    """
    return int(_dist_autograd._get_debug_info()["num_autograd_contexts"]) != 0


def script_module_has_attribute(module: Any, name: str) -> bool:
    """True when the C++ object behind a ScriptModule has attribute ``name``."""
    return hasattr(module._c, name)
