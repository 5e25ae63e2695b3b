"""Holding objects on a worker by a small integer key, weakly or strongly.

Calls name a host-side object by a key instead of sending an RRef each time (an RRef argument
costs a fork/confirm exchange, ~100 µs on loopback). A proxied module is held *weakly*: the
proxies' RRefs keep it alive and its entry disappears with it. A server-side table or other
state that only the registry keeps alive is held *strongly* until it is released.

One registry per host process (:data:`objects`); keys are never reused within a process.

Example (host-side handlers)::

    from remote_module._registry import objects

    def _create_table(rows: int) -> int:
        return objects.hold(torch.zeros(rows, 8))        # strong: lives until released

    def _lookup_rows(key: int, ids: torch.Tensor) -> torch.Tensor:
        return objects.get(key)[ids]
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any


class Registry:
    """Objects by key; weak entries vanish with their object, strong ones on :meth:`release`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        self._weak: dict[int, weakref.ref] = {}
        self._strong: dict[int, Any] = {}
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

    def hold(self, obj: Any) -> int:
        """A new key for ``obj``, held strongly until :meth:`release`."""
        with self._lock:
            key = next(self._keys)
            self._strong[key] = obj
            return key

    def get(self, key: int, what: str = "object") -> Any:
        """The object behind ``key``; ``LookupError`` saying why when it is gone."""
        obj = self._strong.get(key)
        if obj is not None:
            return obj
        ref = self._weak.get(key)
        obj = ref() if ref is not None else None
        if obj is None:
            raise LookupError(
                f"the {what} with key {key} no longer exists on this worker "
                "(its last reference was released or deleted)"
            )
        return obj

    def release(self, key: int) -> bool:
        """Drop a strong entry; True when there was one."""
        with self._lock:
            return self._strong.pop(key, None) is not None

    def keys(self) -> set[int]:
        """The keys currently held (weak entries whose object is alive, and strong ones)."""
        with self._lock:
            alive = {k for k, ref in list(self._weak.items()) if ref() is not None}
            return alive | set(self._strong)


#: This process's registry.
objects = Registry()
