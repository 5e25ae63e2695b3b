"""Caller-side state_dict plumbing for a proxy: pure functions, no RPC.

A proxy's state lives on its host. ``state_dict`` fetches CPU copies of the remote entries and
merges them under the proxy's prefix; ``load_state_dict`` picks the entries under that prefix
and sends them to the host, reporting missing and unexpected keys with the prefix restored, so
a model holding proxies checkpoints and restores like any model.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


def merge_remote_state(
    destination: dict | None, prefix: str, remote_state: dict, remote_metadata: dict
) -> dict:
    """Add ``remote_state`` (keys relative to the remote module) to ``destination``.

    ``destination`` None starts a new ``OrderedDict`` with a ``_metadata`` attribute, as
    ``nn.Module.state_dict`` does. Returns the destination.

    Example::

        >>> sd = merge_remote_state(None, "emb.", {"weight": 1}, {"": {"version": 1}})
        >>> dict(sd), dict(sd._metadata)
        ({'emb.weight': 1}, {'emb': {'version': 1}})
    """
    if destination is None:
        destination = OrderedDict()
        destination._metadata = OrderedDict()  # type: ignore[attr-defined]
    metadata = getattr(destination, "_metadata", None)
    if metadata is not None:
        for key, value in remote_metadata.items():
            metadata[prefix[:-1] if key == "" else prefix + key] = value
    for key, value in remote_state.items():
        destination[prefix + key] = value
    return destination


def select_prefixed(state_dict: dict, prefix: str) -> tuple[OrderedDict, dict]:
    """The entries of ``state_dict`` under ``prefix`` (keys and metadata made relative)."""
    selected = OrderedDict((k[len(prefix):], v) for k, v in state_dict.items() if k.startswith(prefix))
    metadata: dict[str, Any] = {}
    for key, value in (getattr(state_dict, "_metadata", None) or {}).items():
        if prefix == "":
            metadata[key] = value
        elif key == prefix[:-1]:
            metadata[""] = value
        elif key.startswith(prefix):
            metadata[key[len(prefix):]] = value
    return selected, metadata
