"""The host object store: objects held on a worker by key, for every layer.

Calls name a host-side object by a key instead of sending an RRef each time (an RRef argument
costs a fork/confirm exchange, ~100 µs on loopback). A :class:`HostStore` holds objects

- *weakly*, under a key it picks (:meth:`HostStore.hold_weakly`): a proxied module, kept alive
  by its proxies' RRefs, whose entry disappears with it (:data:`host_objects`);
- *strongly*, under the caller's key (:meth:`HostStore.put`, :meth:`HostStore.setdefault`),
  until it is popped or released: a sharded module's shards (keyed by shard id), a
  parameter-server job or table (by name), a pipeline caller's inbox (by run).

A release of a key not stored yet can leave a *tombstone* (:meth:`HostStore.release` with
``tombstone=True``): the caller gave up on a call whose result had not arrived, and the late
result is then dropped on arrival instead of being kept forever. Each layer keeps its own store
(its own keys and messages); keys a store picks are never reused within a process.
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

import collections
import itertools
import threading
import weakref
from functools import lru_cache
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed.rpc as rpc
from torch import nn

from remote_module._core._torch_private import as_python_module


class HostStore:
    """Objects on this worker by key: weakly under keys the store picks, strongly under the
    caller's keys, with bounded tombstones for releases that arrive before what they release.
    Every method is thread-safe; :meth:`update` runs a function on an entry under the lock."""

    def __init__(self, max_tombstones: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        self._weak: dict[int, weakref.ref] = {}
        self._weak_key_by_id: dict[int, int] = {}  # by id(): objects need not be hashable
        self._strong: dict[Any, Any] = {}
        self._tombstones: collections.OrderedDict[Any, None] = collections.OrderedDict()
        self._max_tombstones = max_tombstones

    # ---- weakly, under keys the store picks ---------------------------------------------

    def hold_weakly(self, obj: Any) -> int:
        """The key of ``obj``, held weakly; the same key for the same live object."""
        with self._lock:
            key = self._weak_key_by_id.get(id(obj))
            ref = self._weak.get(key) if key is not None else None
            if ref is not None and ref() is obj:
                return key
            key, obj_id = next(self._keys), id(obj)
            while key in self._strong:  # a caller's key: never shadow it (nor be shadowed by it)
                key = next(self._keys)
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

    # ---- strongly, under the caller's keys ----------------------------------------------

    def put(self, key: Any, obj: Any) -> bool:
        """Hold ``obj`` under ``key``; False (``obj`` dropped) when ``key`` was released before
        it arrived; ``KeyError`` when ``key`` is already held (or is a key the store picked)."""
        with self._lock:
            if key in self._tombstones:
                del self._tombstones[key]
                return False
            if key in self._strong or key in self._weak:
                raise KeyError(key)
            self._strong[key] = obj
            return True

    def setdefault(self, key: Any, make: Callable[[], Any]) -> tuple[Any, bool]:
        """The object under ``key``, made with ``make()`` (under the lock) and held when there is
        none; and whether it was made (``KeyError`` for a key the store picked)."""
        with self._lock:
            obj = self._strong.get(key)
            if obj is None:
                if key in self._weak:
                    raise KeyError(key)
                obj = self._strong[key] = make()
                return obj, True
            return obj, False

    def update(self, key: Any, change: Callable[[Any], None]) -> bool:
        """``change(obj)`` under the store's lock when ``key`` is held (so no :meth:`pop` takes
        it half changed); whether it was."""
        with self._lock:
            obj = self._strong.get(key)
            if obj is None:
                return False
            change(obj)
            return True

    def pop(self, key: Any, default: Any = None) -> Any:
        """Stop holding ``key``'s object; the object (``default`` when none was held)."""
        with self._lock:
            return self._strong.pop(key, default)

    def release(self, keys: Iterable[Any], tombstone: bool) -> None:
        """Stop holding ``keys``; with ``tombstone``, a key not held yet is remembered (the
        oldest forgotten beyond the store's bound), so that a later :meth:`put` of it drops
        its object."""
        with self._lock:
            for key in keys:
                if self._strong.pop(key, None) is None and tombstone:
                    self._tombstones[key] = None
                    if len(self._tombstones) > self._max_tombstones:
                        self._tombstones.popitem(last=False)

    # ---- reading --------------------------------------------------------------------------

    def get(self, key: Any) -> Any:
        """The object under ``key``, strong or weak; None when there is none (callers say what
        is missing in their own words)."""
        obj = self._strong.get(key)
        if obj is not None:
            return obj
        ref = self._weak.get(key)
        return ref() if ref is not None else None

    def keys(self) -> set[Any]:
        """The keys held (weak ones whose object is alive, and strong ones)."""
        with self._lock:
            alive = {k for k, ref in list(self._weak.items()) if ref() is not None}
            return alive | set(self._strong)

    def __len__(self) -> int:
        return len(self.keys())

    def __iter__(self) -> Iterator[Any]:
        return iter(self.keys())


#: This process's store of proxied modules (weak entries).
host_objects = HostStore()


def hosted_module(key: int | rpc.RRef) -> nn.Module:
    """The module a proxy names by ``key`` (see :data:`host_objects`), or by its RRef (a
    scripted module, which the store cannot hold weakly); ``RuntimeError`` when it is gone."""
    if isinstance(key, rpc.PyRRef):
        return as_python_module(key.local_value())
    module = host_objects.get(key)
    if module is None:
        raise RuntimeError(
            f"the module behind this RemoteModule (key {key}) no longer exists on this worker: "
            "every RRef to it was deleted"
        )
    return module


@lru_cache(maxsize=64)
def host_device(device: str) -> torch.device:
    """``torch.device(device)``, cached (a device string arrives with every call)."""
    return torch.device(device)
