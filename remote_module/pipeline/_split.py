"""split_sequential: a RemotePipeline cut from a local ``nn.Sequential``."""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Sequence

from torch import nn

from remote_module.pipeline._balance import balance_by_parameters, check_balance
from remote_module.pipeline._pipeline import RemotePipeline


class _Sharing(NamedTuple):
    """Two layers of a Sequential holding the same state: ``first < last`` (indices)."""

    first: int
    last: int
    what: str  # says what they share, naming both layers


def _state(layer: nn.Module) -> dict[int, tuple[str, str]]:
    """id -> (kind, name inside ``layer``) of every parameter, buffer and submodule holding
    either, of ``layer`` (``""``: the layer itself)."""
    found: dict[int, tuple[str, str]] = {}
    for name, module in layer.named_modules(remove_duplicate=False):
        if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
            found.setdefault(id(module), ("module", name))
    for kind, tensors in (("parameter", layer.named_parameters(remove_duplicate=False)),
                          ("buffer", layer.named_buffers(remove_duplicate=False))):
        for name, t in tensors:
            found.setdefault(id(t), (kind, name))
    return found


def _sharings(layers: list[tuple[str, nn.Module]]) -> list[_Sharing]:
    """Every later layer that holds state (a parameter, a buffer, a module with either) that an
    earlier layer holds too, with the first earlier one; in layer order. A module without
    parameters or buffers (``ReLU``) used twice is not listed: its copies behave alike."""
    owners: dict[int, tuple[int, str, str]] = {}  # id -> (layer index, kind, name inside it)
    out = []
    for index, (layer_name, layer) in enumerate(layers):
        state = _state(layer)
        clash = None  # with the earliest layer; modules come first, so the largest shared unit is named
        for ident, (kind, name) in state.items():
            if ident in owners and (clash is None or owners[ident][0] < clash[0][0]):
                clash = (owners[ident], kind, name)
        if clash is not None:
            (first, _, first_name), kind, name = clash
            first_layer = layers[first][0]
            if kind == "module" and name == "" and first_name == "":
                what = (f"the same {type(layer).__name__} is layer {first} ({first_layer!r}) "
                        f"and layer {index} ({layer_name!r})")
            else:
                here = f"{layer_name}.{name}" if name else layer_name
                there = f"{first_layer}.{first_name}" if first_name else first_layer
                what = f"layer {index} ({layer_name!r}) shares {kind} {here!r} with layer {first} (as {there!r})"
            out.append(_Sharing(first, index, what))
        for ident, (kind, name) in state.items():
            owners.setdefault(ident, (index, kind, name))
    return out


def _unique_sizes(layers: list[tuple[str, nn.Module]]) -> list[int]:
    """Parameters per layer, a parameter shared by several layers counted at its first."""
    seen: set[int] = set()
    sizes = []
    for _, layer in layers:
        size = 0
        for p in layer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                size += p.numel()
        sizes.append(size)
    return sizes


def split_sequential(
    sequential: nn.Sequential,
    remote_devices: Sequence[str],
    balance: Sequence[int] | None = None,
    chunks: int = 1,
    *,
    timeout: float | None = None,
) -> RemotePipeline:
    """A :class:`RemotePipeline` whose stage ``i`` is a copy of a slice of ``sequential`` on
    ``remote_devices[i]``.

    ``balance`` gives the layers per stage; by default the cut makes the stages hold as equal
    a number of parameters as possible, and a layer without parameters stays with the layer
    before it. Each stage is an ``nn.Sequential`` of the slice's layers under their original
    names, so a stage's ``state_dict`` keys are those of ``sequential`` (``2.weight``) and
    ``pipe.state_dict()`` is ``sequential.state_dict()`` with ``stages.<i>.`` in front. The
    weights are copied to the hosts when the pipeline is made; ``sequential`` itself is not
    changed or used afterwards.

    Layers that share state (the same module used twice, ``Sequential(lin, Tanh(), lin)``, or a
    submodule, parameter or buffer held by two layers, e.g. tied weights) stay on one stage,
    with everything between them, so that they keep sharing it as in ``sequential``; a
    ``balance`` that cuts between them raises ``ValueError`` naming them. A parameter-free
    module used twice (one ``ReLU`` object) may be cut: its copies behave alike.

    What one layer returns is what the next receives, as in ``nn.Sequential``, also across a
    cut: a tuple (an ``LSTM``'s ``(output, (h, c))``) is passed on as one argument.

    Example (worker0 drives; worker1 and worker2 only join RPC and wait)::

        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        pipe = split_sequential(model, ["worker1/cpu", "worker2/cpu"], chunks=4)
        # pipe.stages[0] holds layers 0-1 (or 0-3), pipe.stages[1] the rest
        out = pipe(torch.randn(32, 16))            # equal to model(x)
    """
    if not isinstance(sequential, nn.Sequential):
        raise TypeError(f"split_sequential takes an nn.Sequential, got {type(sequential).__name__}")
    if isinstance(remote_devices, str):
        raise TypeError(
            f"remote_devices must be a list of remote devices, one per stage, got the string {remote_devices!r}"
        )
    devices = list(remote_devices)
    if not devices:
        raise ValueError("remote_devices is empty: give one remote device (e.g. 'worker1/cpu') per stage")
    layers = list(sequential._modules.items())
    if len(layers) < len(devices):
        raise ValueError(
            f"cannot split an nn.Sequential of {len(layers)} layers into {len(devices)} stages: "
            "each stage needs at least one layer"
        )
    sharings = _sharings(layers)
    joined = {b for s in sharings for b in range(s.first + 1, s.last + 1)}  # no stage starts there
    if balance is None:
        try:
            counts = balance_by_parameters(_unique_sizes(layers), len(devices), joined)
        except ValueError as exc:
            if not sharings:
                raise
            shared = "; ".join(f"{s.what} (layers {s.first}..{s.last} stay on one stage)" for s in sharings)
            raise ValueError(f"{exc}. Layers that share state: {shared}") from None
    else:
        counts = check_balance(balance, len(layers), len(devices))
        starts = [sum(counts[:k]) for k in range(1, len(counts))]
        for s in sharings:
            cut = next((b for b in starts if s.first < b <= s.last), None)
            if cut is not None:
                raise ValueError(
                    f"balance {counts!r} puts layers {s.first} and {s.last} of the nn.Sequential on different "
                    f"stages, but {s.what}: each stage would train its own copy and they would drift apart "
                    f"from the local model. Keep layers {s.first}..{s.last} on one stage"
                    + _suggestion(layers, len(devices), joined)
                )
    stages = []
    start = 0
    for device, count in zip(devices, counts):
        part = OrderedDict(layers[start:start + count])
        stages.append((device, nn.Sequential, (part,), None))
        start += count
    return RemotePipeline(stages, chunks, timeout=timeout, unpack_tuples=False)


def _suggestion(layers: list[tuple[str, nn.Module]], stages: int, joined: set[int]) -> str:
    """How to choose a balance that keeps shared layers together (the end of an error message)."""
    try:
        counts = balance_by_parameters(_unique_sizes(layers), stages, joined)
    except ValueError:
        return ": there are too few groups of layers for that many stages; use fewer remote devices"
    return f" (e.g. balance={counts!r}, which is what balance=None chooses)"
