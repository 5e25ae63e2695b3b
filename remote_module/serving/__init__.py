"""Serving: one module on several replicas with failover (:class:`ReplicatedModule`), and
host-side batching of concurrent calls (:class:`~remote_module.BatchPolicy`, which any
``RemoteModule`` takes too)."""

from remote_module._proxy import BatchPolicy
from remote_module.serving._replicas import ReplicatedModule

__all__ = ["ReplicatedModule", "BatchPolicy"]
