"""The warning for a forward whose gradients only distributed autograd could carry.

Outside a ``torch.distributed.autograd.context()`` nothing is recorded across RPC: a remote
forward (a ``RemoteModule`` proxy, a ``RemotePipeline``, a sharded ``LocalModule``) run with
gradients enabled returns tensors with no history, so ``loss.backward()`` reaches neither the
parameters on the hosts nor the tensors given to the forward, and a local optimizer never
changes them: training goes on with no error and those parameters never move. The forward
warns once per object (a ``UserWarning``) when it records gradients that way: grad mode on,
trainable parameters on the hosts (known locally, from when the object was made: no message
is sent to find out) or an input that requires grad (a tensor in a tuple, list or dict too),
and no context in this thread. It is silent under ``torch.no_grad()`` /
``torch.inference_mode()``, for hosts without trainable parameters given inputs without grad,
and inside a context.

An object that warns declares ``self._warned_untrained = False`` where it declares its other
state (its ``__init__``; a ``RemoteModule`` proxy wherever one is built, see
``remote_module._proxy.calls.RemoteCalls._declare_process_state``), and its ``__getstate__``
starts from :func:`unwarned_state`.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any

import torch

from remote_module._core._torch_private import in_dist_autograd_context, is_rpc_initialized

#: The attribute each object that warns declares: False until it warned (a copy starts at False:
#: see unwarned_state).
FLAG = "_warned_untrained"

_claim = threading.Lock()  # which of several threads that pass records_outside_context at once warns

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # remote_module/
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _holds_grad_input(value: Any) -> bool:
    """Whether ``value`` is, or holds in its tuples, lists and dicts (an LSTM's ``(h0, c0)``), a
    tensor or sharded RemoteTensor (which says whether its shards require grad) that requires
    grad: RPC carries nested tensors, so a gradient to any of them is cut outside a context.
    Each container is looked into once (a list that holds itself is fine)."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if isinstance(v, (tuple, list, dict)):
            if id(v) not in seen:
                seen.add(id(v))
                stack.extend(v.values() if isinstance(v, dict) else v)
        elif getattr(v, "requires_grad", False) is True:
            return True
    return False


def records_outside_context(owner: Any, trainable: bool, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether a forward of ``owner`` now would record gradients that no one can carry back:
    not yet warned, grad mode on, ``trainable`` (its host modules have parameters that require
    grad) or an input requiring grad (nested in tuples, lists, dicts too), and no distributed
    autograd context here. Never before ``rpc.init_rpc`` or after ``rpc.shutdown()``: such a
    forward fails without running (and records nothing), so the one warning is kept."""
    if owner._warned_untrained or not torch.is_grad_enabled():
        return False
    if not trainable and not any(_holds_grad_input(v) for v in (*args, *(kwargs or {}).values())):
        return False
    return is_rpc_initialized() and not in_dist_autograd_context()


def user_stacklevel() -> int:
    """The ``stacklevel`` that points at the first frame outside this package and torch (the
    user's call, however many ``nn.Module.__call__`` layers and generated methods lie between)."""
    level, frame = 2, sys._getframe(2)  # 1: warn_untrained, 2: its caller
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_PACKAGE) or name.startswith(_TORCH) or name.startswith("<remote_module")):
            break
        frame, level = frame.f_back, level + 1
    return level


def warn_untrained(owner: Any, what: str, kind: str, handle: str) -> None:
    """Warn (once per ``owner``) that ``what`` ran recording gradients outside a distributed
    autograd context; ``kind`` names the class, ``handle`` what the user calls it in code.
    Threads that all passed :func:`records_outside_context` at once race here: the first to
    set ``owner._warned_untrained`` warns, the others do not."""
    with _claim:
        if owner._warned_untrained:
            return
        owner._warned_untrained = True
    warnings.warn(
        f"{what} ran with gradients enabled outside a torch.distributed.autograd context: nothing is "
        "recorded across RPC there, so loss.backward() reaches neither its parameters on the hosts nor "
        "the tensors given to it, and a local optimizer never changes them. To train it, run the forward "
        "and the backward inside `with torch.distributed.autograd.context() as ctx:` with "
        f"`dist_autograd.backward(ctx, [loss])`, and step `DistributedOptimizer(optimizer_class, "
        f"{handle}.remote_parameters(), ...)` with `.step(ctx)`; for inference, run it under "
        f"`torch.no_grad()` or `torch.inference_mode()`. (Shown once per {kind}.)",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def unwarned_state(owner: Any) -> dict:
    """``owner``'s pickled state (a copy of its ``__dict__``) with the once-warned flag back at
    False: a copy that arrives elsewhere (over RPC, or ``copy.deepcopy``) is another object,
    which warns on its own, as a proxy does (``remote_module._proxy.pickling.IGNORED_ATTRIBUTES``).
    For ``__getstate__`` of a pipeline or LocalModule."""
    state = owner.__dict__.copy()
    state[FLAG] = False
    return state
