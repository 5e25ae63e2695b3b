"""What a ``forward`` call is on the wire: named records instead of positional tuples.

A message names its host object once (:class:`Target`) and carries one :class:`Call` or a
list of them; the host answers each call with an :class:`Answer`: the call's own result
(a :class:`remote_module._wire.Payload` of its output, or its
:class:`remote_module._errors.RemoteFailure`) and the seconds the host spent on it, from
which the caller's channel estimates what a message of such calls costs.

Example (what a proxy sends for ``proxy(x)``)::

    Target(key=proxy.module_key, device="cpu", is_device_map_set=False)
    Call(payload=dumps(((x,), {}), inline=True), grad_enabled=True, inline=True)
"""

from __future__ import annotations

from typing import Any, NamedTuple

from remote_module._wire import Payload


class Target(NamedTuple):
    """The host-side module every call of one proxy names: by registry key, or by its RRef for
    a scripted module (whose Python wrapper the registry cannot hold weakly)."""

    key: Any
    device: str
    is_device_map_set: bool


class Call(NamedTuple):
    """One ``forward`` call: its pickled ``(args, kwargs)``, the caller's grad mode, and
    whether small tensors travel inline (then the output comes back inlined too)."""

    payload: Payload
    grad_enabled: bool
    inline: bool


class Answer(NamedTuple):
    """The host's answer to one call: ``result`` (output payload or failure record) and the
    host's seconds spent on it."""

    result: Any
    seconds: float
