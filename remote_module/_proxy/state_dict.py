"""state_dict plumbing for a proxy, both sides: pure functions, no RPC.

A proxy's state lives on its host. ``state_dict`` fetches CPU copies of the remote entries and
merges them under the proxy's prefix (:func:`merge_remote_state`). ``load_state_dict`` picks
the entries under that prefix (:func:`entries_under`) and sends them, keys unchanged, to the
host, which loads them with the module placed at that prefix (:func:`load_at`): missing and
unexpected keys and error messages name the full keys (``emb.weight``) and ``assign=True``
works as on a local model, so a model holding proxies checkpoints and restores like any model.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from torch import nn


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


def entries_under(state_dict: dict, prefix: str) -> tuple[OrderedDict, OrderedDict]:
    """The entries of ``state_dict`` under ``prefix`` and their ``_metadata``, keys unchanged.

    Example::

        >>> sd = OrderedDict({"emb.weight": 1, "mlp.bias": 2})
        >>> sd._metadata = {"": {"version": 1}, "emb": {"version": 2}}
        >>> state, metadata = entries_under(sd, "emb.")
        >>> dict(state), dict(metadata)
        ({'emb.weight': 1}, {'emb': {'version': 2}})
    """
    state = OrderedDict((k, v) for k, v in state_dict.items() if k.startswith(prefix))
    metadata: OrderedDict[str, Any] = OrderedDict()
    for key, value in (getattr(state_dict, "_metadata", None) or {}).items():
        if prefix == "" or key == prefix[:-1] or key.startswith(prefix):
            metadata[key] = dict(value) if isinstance(value, dict) else value
    return state, metadata


class _Mount(nn.Module):
    """The root of a host-side load: holds the module at its key path (through empty
    containers) and keeps the lists torch fills during the load."""

    def __init__(self) -> None:
        super().__init__()
        self.lists: tuple[list, list, list] | None = None

    def _load_from_state_dict(
        self, state_dict: Any, prefix: str, local_metadata: dict, strict: bool,
        missing_keys: list, unexpected_keys: list, error_msgs: list,
    ) -> None:
        # torch passes the same three lists to every module of one load, starting here.
        self.lists = (missing_keys, unexpected_keys, error_msgs)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


def _error_header(root: nn.Module) -> str:
    # nn.Module.load_state_dict's summary: "Error(s) in loading state_dict for <class>:\n\t" + msgs
    return f"Error(s) in loading state_dict for {type(root).__name__}:\n\t"


def load_at(
    module: nn.Module, state: dict, metadata: dict, prefix: str, assign: bool = False
) -> tuple[list[str], list[str], list[str]]:
    """Load ``state`` (keys under ``prefix``) into ``module`` as if ``module`` sat at ``prefix``
    in a model: ``(missing keys, unexpected keys, error messages)``, all naming full keys.

    Loads non-strictly (the caller's ``load_state_dict`` applies ``strict``), with ``assign``
    as ``nn.Module.load_state_dict``'s. A ``RuntimeError`` raised while loading (rather than
    torch's summary of the messages) becomes one message.

    Example (the host side of ``model.load_state_dict(sd)`` for a proxy at ``model.emb``)::

        >>> import torch
        >>> emb = nn.Embedding(3, 2)
        >>> missing, unexpected, errors = load_at(emb, {"emb.weight": torch.zeros(4, 2)}, {}, "emb.")
        >>> errors[0].split(":")[0]
        'size mismatch for emb.weight'
    """
    if prefix and not prefix.endswith("."):
        raise ValueError(f"prefix must be '' or end with '.', as nn.Module.load_state_dict passes it; got {prefix!r}")
    parts = prefix[:-1].split(".") if prefix else []
    root: nn.Module = _Mount() if parts else module
    parent = root
    for i, part in enumerate(parts):
        child = module if i == len(parts) - 1 else nn.Module()
        parent.add_module(part, child)
        parent = child
    sd: Any = OrderedDict(state)
    sd._metadata = OrderedDict(metadata)
    try:
        result = root.load_state_dict(sd, strict=False, assign=assign)
    except RuntimeError as exc:
        text, header = str(exc), _error_header(root)
        if not text.startswith(header):
            return [], [], [text]
        if isinstance(root, _Mount) and root.lists is not None:
            missing, unexpected, errors = root.lists
            return list(missing), list(unexpected), list(errors)
        return [], [], [text[len(header):]]  # joined again by the caller's summary: same text
    return list(result.missing_keys), list(result.unexpected_keys), []
