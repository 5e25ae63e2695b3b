"""The host object store: objects held on a worker by a small integer key.

Calls name a host-side object by a key instead of sending an RRef each time (an RRef argument
costs a fork/confirm exchange, ~100 µs on loopback). A proxied module is held *weakly*: the
proxies' RRefs keep it alive and its entry disappears with it.

One store per host process (:data:`host_objects`); keys are never reused within a process.
:func:`hosted_module` is how every layer finds the module a proxy names (by key, or by the RRef
of a scripted module), and :func:`host_device` the ``torch.device`` of a device string.

Example (host-side handlers in an importable module)::

    from remote_module._core import host_objects, hosted_module

    def _keep(module: nn.Module) -> int:
        return host_objects.hold_weakly(module)   # the caller's RRef keeps it alive

    def _weight_norm(key: int) -> float:
        return hosted_module(key).weight.norm().item()
"""

from __future__ import annotations

import itertools
import threading
import weakref
from functools import lru_cache
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

from remote_module._core._torch_private import as_python_module


class Registry:
    """Objects by key, held weakly: an entry vanishes with its object."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        self._weak: dict[int, weakref.ref] = {}
        self._weak_key_by_id: dict[int, int] = {}  # by id(): objects need not be hashable

    def hold_weakly(self, obj: Any) -> int:
        """The key of ``obj``, held weakly; the same key for the same live object."""
        with self._lock:
            key = self._weak_key_by_id.get(id(obj))
            ref = self._weak.get(key) if key is not None else None
            if ref is not None and ref() is obj:
                return key
            key, obj_id = next(self._keys), id(obj)
            weak, by_id = self._weak, self._weak_key_by_id

            def forget(_: Any) -> None:
                # Runs when the object is collected: plain dict operations, no lock (the
                # collector may run while this thread holds it).
                weak.pop(key, None)
                if by_id.get(obj_id) == key:
                    by_id.pop(obj_id, None)

            weak[key] = weakref.ref(obj, forget)
            by_id[obj_id] = key
            return key

    def get(self, key: int, what: str = "object") -> Any:
        """The object behind ``key``; ``LookupError`` saying why when it is gone."""
        ref = self._weak.get(key)
        obj = ref() if ref is not None else None
        if obj is None:
            raise LookupError(
                f"the {what} with key {key} no longer exists on this worker "
                "(its last reference was released or deleted)"
            )
        return obj

    def keys(self) -> set[int]:
        """The keys of the objects currently held (alive)."""
        with self._lock:
            alive = {k for k, ref in list(self._weak.items()) if ref() is not None}
            return alive


#: This process's store.
host_objects = Registry()


def hosted_module(key: int | rpc.RRef) -> nn.Module:
    """The module a proxy names by ``key`` (see :data:`host_objects`), or by its RRef (a
    scripted module, which the store cannot hold weakly); ``RuntimeError`` when it is gone."""
    if isinstance(key, rpc.PyRRef):
        return as_python_module(key.local_value())
    try:
        return host_objects.get(key, "module")
    except LookupError:
        raise RuntimeError(
            f"the module behind this RemoteModule (key {key}) no longer exists on this worker: "
            "every RRef to it was deleted"
        ) from None


@lru_cache(maxsize=64)
def host_device(device: str) -> torch.device:
    """``torch.device(device)``, cached (a device string arrives with every call)."""
    return torch.device(device)
