"""Validated ``TensorPipeRpcBackendOptions``: bad values fail before ``init_rpc``, by name."""

from __future__ import annotations

import functools
import math
import numbers
import operator
import os
from typing import Any, Iterable, Mapping

import torch
import torch.distributed.rpc as rpc

DEFAULT_RPC_TIMEOUT = 60.0
DEFAULT_WORKER_THREADS = 16


#: The shortest timeout torch honours: it counts in whole milliseconds, and 0 ms means "no timeout".
MIN_SECONDS = 0.001
#: Timeouts must stay below this: torch holds milliseconds in a signed 32-bit int, so 2**31 ms
#: and more (infinity included) wrap into a negative figure.
MAX_SECONDS_EXCLUSIVE = 2**31 / 1000

#: Seconds a rank of a torchrun job may take to join its world (``init_from_env``: its peers'
#: arrival, the network choice, TensorPipe's and Gloo's connections) before it fails, naming
#: what it tried; see :func:`connect_timeout`.
DEFAULT_CONNECT_TIMEOUT = 300.0
#: The variable that sets that bound for every rank of a job (seconds).
CONNECT_TIMEOUT_VARIABLE = "RPC_BACKEND_CONNECT_TIMEOUT"

#: ``transport`` values of :func:`make_options`, ``run_local`` and ``init_from_env``.
#: ``"uv"``: TensorPipe's libuv transport (TCP, loopback included); its threads sleep while
#: nothing arrives. ``"shm"``: TensorPipe's defaults as a plain ``init_rpc`` gets them (shared
#: memory between processes of one machine, uv between machines), whose shared-memory reactor
#: busy-polls: every process keeps a core busy from ``init_rpc`` on, idle or not.
#: tutorials/performance.md has the measured costs of both.
TRANSPORTS = ("uv", "shm")
DEFAULT_TRANSPORT = "uv"


def positive_seconds(value: Any, what: str) -> float:
    """``value`` as float seconds, checked to be a real number in ``[0.001, 2**31 / 1000)``.

    Torch rounds timeouts to milliseconds: under 1 ms becomes 0 ("wait forever") and 2**31 ms
    or more overflows. Raises ``ValueError`` naming ``what`` and ``value`` for anything else
    (bool, str, None, nan, inf, 0, negatives, 0.0004, 2**31 / 1000); callers that accept
    ``None`` for "the agent's default" handle it before calling.

    Example::

        >>> positive_seconds(30, "rpc_timeout")
        30.0
        >>> positive_seconds(0.0004, "timeout")
        Traceback (most recent call last):
        ...
        ValueError: timeout must be a positive number of seconds in [0.001, 2147483.648), got 0.0004; ...
    """
    if type(value) is float and MIN_SECONDS <= value < MAX_SECONDS_EXCLUSIVE:  # (the usual case, checked at once)
        return value
    seconds = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None
    if seconds is None or not math.isfinite(seconds) or not MIN_SECONDS <= seconds < MAX_SECONDS_EXCLUSIVE:
        raise ValueError(
            f"{what} must be a positive number of seconds in [{MIN_SECONDS}, {MAX_SECONDS_EXCLUSIVE}), "
            f"got {value!r}; pass e.g. {what}=30 for 30 s (torch cannot express shorter, longer or "
            "infinite timeouts)"
        )
    return seconds


def connect_timeout(value: Any = None, env: Mapping[str, str] | None = None) -> float:
    """The bound, in seconds, on joining a torchrun job's world: ``value`` when given, else
    ``RPC_BACKEND_CONNECT_TIMEOUT`` from ``env`` (default: this process's environment), else
    :data:`DEFAULT_CONNECT_TIMEOUT` (300 s). Checked as :func:`positive_seconds`.

    Example::

        >>> connect_timeout(env={})
        300.0
        >>> connect_timeout(env={"RPC_BACKEND_CONNECT_TIMEOUT": "45"})
        45.0
        >>> connect_timeout(20, env={"RPC_BACKEND_CONNECT_TIMEOUT": "45"})
        20.0
    """
    if value is not None:
        return positive_seconds(value, "connect_timeout")
    raw = (os.environ if env is None else env).get(CONNECT_TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_CONNECT_TIMEOUT
    try:
        return positive_seconds(float(raw), CONNECT_TIMEOUT_VARIABLE)
    except ValueError:
        raise ValueError(
            f"{CONNECT_TIMEOUT_VARIABLE}={raw!r} is not a number of seconds in [{MIN_SECONDS}, "
            f"{MAX_SECONDS_EXCLUSIVE}); set it like {CONNECT_TIMEOUT_VARIABLE}=120, or unset it for "
            f"{DEFAULT_CONNECT_TIMEOUT:.0f} s"
        ) from None


def _device(value: Any, where: str) -> torch.device:
    if isinstance(value, bool) or not isinstance(value, (str, int, torch.device)):
        raise TypeError(f"{where}: expected a device such as 'cuda:0', 0 or torch.device, got {value!r}")
    try:
        return torch.device(value)
    except RuntimeError as exc:
        raise ValueError(f"{where}: {value!r} is not a device ({exc})") from None


def make_options(
    *,
    init_method: str | None = None,
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
    num_worker_threads: int = DEFAULT_WORKER_THREADS,
    device_maps: Mapping[str, Mapping[Any, Any]] | None = None,
    devices: Iterable[Any] | None = None,
    worker_names: Iterable[str] | None = None,
    transport: str = DEFAULT_TRANSPORT,
) -> rpc.TensorPipeRpcBackendOptions:
    """Check every option and build TensorPipe options.

    ``transport`` is ``"uv"`` (the default: idle ranks use no CPU) or ``"shm"`` (torch's own
    defaults, which busy-poll); see :data:`TRANSPORTS`. With ``"uv"``, CPU tensors travel
    through the connection itself (TensorPipe's ``basic`` channel) and CUDA tensors on the CUDA
    channels torch registered (see :func:`transport_kwargs`).

    ``device_maps`` maps a *peer* worker name to ``{local device: peer device}``, e.g.
    ``{"worker1": {"cuda:0": "cuda:1"}}``. With ``worker_names``, peers must be among them.

    Example::

        opts = make_options(rpc_timeout=20, device_maps={"ps0": {"cuda:0": "cuda:0"}})
    """
    rpc_timeout = positive_seconds(rpc_timeout, "rpc_timeout")
    chosen = transport_kwargs(transport)  # checks it
    num_worker_threads = positive_int(num_worker_threads, "num_worker_threads", wrong_type=ValueError)
    known = None if worker_names is None else set(worker_names)
    maps: dict[str, dict[torch.device, torch.device]] = {}
    for peer, mapping in (device_maps or {}).items():
        if not isinstance(peer, str):
            raise TypeError(f"device_maps keys are peer worker names, got {peer!r}")
        if known is not None and peer not in known:
            raise ValueError(f"device_maps names worker {peer!r}, which is not in the world ({sorted(known)})")
        if not isinstance(mapping, Mapping) or not mapping:
            raise TypeError(
                f"device_maps[{peer!r}] must be a non-empty dict of local -> remote device, got {mapping!r}"
            )
        where = f"device_maps[{peer!r}]"
        pairs = {_device(k, where): _device(v, where) for k, v in mapping.items()}
        if len(set(pairs.values())) != len(pairs):
            raise ValueError(f"{where} maps two local devices to the same remote device: {mapping!r}")
        maps[peer] = pairs
    device_list = None if devices is None else [_device(d, "devices") for d in devices]
    kwargs: dict[str, Any] = dict(rpc_timeout=rpc_timeout, num_worker_threads=num_worker_threads)
    if init_method is not None:
        kwargs["init_method"] = init_method
    if maps:
        kwargs["device_maps"] = maps
    if device_list is not None:
        kwargs["devices"] = device_list
    kwargs.update(chosen)
    return rpc.TensorPipeRpcBackendOptions(**kwargs)


#: The CPU channel of ``transport="uv"``: tensors inside the connection's own messages.
#: ``cma`` (cross-memory attach: one copy between processes of a machine) was faster for 64 MB
#: but slower for many small tensors, and ``mpt_uv`` slower still for those; see
#: tests/benchmarks/bench_transport.py and tutorials/performance.md.
UV_CPU_CHANNELS = ("basic",)
#: TensorPipe's CUDA channels, highest priority first; ``transport="uv"`` offers those this
#: build of torch registered (none in a CPU build).
CUDA_CHANNELS = ("cuda_ipc", "cuda_gdr", "cuda_xth", "cuda_basic")


@functools.lru_cache(maxsize=None)
def registered_channels(names: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``names`` that this torch registered as TensorPipe channels (the options
    refuse an unknown one with "Unknown channel")."""
    found = []
    for name in names:
        try:
            rpc.TensorPipeRpcBackendOptions(_channels=[name])
        except RuntimeError:
            continue
        found.append(name)
    return tuple(found)


def transport_kwargs(transport: str) -> dict[str, Any]:
    """TensorPipe's private ``_transports`` / ``_channels`` arguments for ``transport``.

    Empty for ``"shm"`` (torch's defaults). For ``"uv"``: the uv transport, the ``basic``
    channel for CPU tensors and every CUDA channel this torch registered, on every rank
    whether or not it sets device maps (torch gives a rank devices from its peers' maps too,
    and a CUDA tensor then needs a CUDA channel on both sides).
    """
    if not isinstance(transport, str) or transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "shm":
        return {}
    return {"_transports": ["uv"], "_channels": [*UV_CPU_CHANNELS, *registered_channels(CUDA_CHANNELS)]}


def positive_int(value: Any, what: str, *, wrong_type: type[Exception] = TypeError, message: str | None = None) -> int:
    """``value`` as a positive ``int``: the one positive-int check of both packages.

    Accepts what ``operator.index`` accepts (``int``, ``numpy.int64``, a 0-d integer tensor), as
    torch takes sizes; never a ``bool``. A non-integer raises ``wrong_type`` (``TypeError`` by
    default, as ``nn.Embedding`` does for a float size; ``ValueError`` where an API has always
    raised that), an integer below 1 ``ValueError``. ``message``, when given, is the error text
    for both, formatted with ``what`` and ``value``.

    Example::

        >>> positive_int(4, "num_servers")
        4
        >>> positive_int(0, "num_servers")
        Traceback (most recent call last):
        ...
        ValueError: num_servers must be a positive int, got 0
    """
    number = None
    # a bool never, nor a bool tensor / numpy bool, whose __index__ gives 0 or 1 (torch refuses
    # them as sizes too)
    if not isinstance(value, bool) and str(getattr(value, "dtype", "")) not in ("torch.bool", "bool"):
        try:
            number = operator.index(value)
        except TypeError:
            pass
    if number is not None and number >= 1:
        return number
    if message is not None:
        text = message.format(what=what, value=value)
    elif number is None and wrong_type is not ValueError:
        text = (f"{what} must be an int (or an integer such as numpy.int64), got {type(value).__name__} "
                f"{value!r}: pass a whole number as an int")
    else:
        text = f"{what} must be a positive int, got {value!r}"
    raise (wrong_type if number is None else ValueError)(text)
