"""What a ``forward`` call is on the wire: named records instead of positional tuples.

A message names its host object once (:class:`Target`) and carries one :class:`Call` or a
list of them; the host answers each call with an :class:`Answer`: the call's own result
(a :class:`remote_module._proxy.wire.Payload` of its output, or its
:class:`remote_module._core.errors.RemoteFailure`) and the seconds the host spent on it, from
which the caller's channel estimates what a message of such calls costs.

On the wire each record travels as a plain tuple (``record.wire()``) and is rebuilt with
``from_wire`` on arrival: a NamedTuple inside an RPC message makes the RPC pickler look its
class up by module and name on every message, which cost ~5 µs of CPU per record and side,
and on a 2-core host several times that in latency (measured on torch 2.13, loopback: a small
call took 0.80x of torch's RemoteModule's time with NamedTuple records, 0.72x with tuples).

Example (what a proxy sends for ``proxy(x)``)::

    Target(key=proxy.module_key, device="cpu", is_device_map_set=False)
    Call(payload=dumps(((x,), {}), inline=True), grad_enabled=True, inline=True)
"""

from __future__ import annotations

from typing import Any, NamedTuple

from remote_module._proxy.wire import Payload


class Target(NamedTuple):
    """The host-side module every call of one proxy names: by registry key, or by its RRef for
    a scripted module (whose Python wrapper the registry cannot hold weakly)."""

    key: Any
    device: str
    is_device_map_set: bool

    def wire(self) -> tuple:
        """This record as a plain tuple (what travels); ``Target._make`` rebuilds it."""
        return tuple(self)


class Call(NamedTuple):
    """One ``forward`` call: its pickled ``(args, kwargs)``, the caller's grad mode, whether
    small tensors travel inline (then the output comes back inlined too), and whether it may
    join a batch on the host (grad off and no distributed autograd context in the caller's
    process; see remote_module._proxy.batching)."""

    payload: Payload
    grad_enabled: bool
    inline: bool
    joinable: bool = False

    def wire(self) -> tuple:
        """This record as nested plain tuples (what travels)."""
        return (tuple(self.payload), self.grad_enabled, self.inline, self.joinable)

    @staticmethod
    def from_wire(sent: tuple) -> Call:
        """The record :meth:`wire` sent."""
        (data, side), grad_enabled, inline, joinable = sent
        return Call(Payload(data, side), grad_enabled, inline, joinable)


class Answer(NamedTuple):
    """The host's answer to one call: ``result`` (output payload or failure record) and the
    host's seconds spent on it."""

    result: Any
    seconds: float

    def wire(self) -> tuple:
        """This record as plain tuples (what travels); a failure record travels as itself."""
        result = self.result
        return (tuple(result) if type(result) is Payload else result, self.seconds)

    @staticmethod
    def from_wire(sent: tuple) -> Answer:
        """The record :meth:`wire` sent."""
        result, seconds = sent
        return Answer(Payload(*result) if type(result) is tuple else result, seconds)
