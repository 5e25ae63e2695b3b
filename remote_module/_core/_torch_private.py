"""The only place in ``remote_module`` that touches private ``torch.distributed.rpc`` /
TorchScript APIs (``rpc_backend`` has its own). A torch upgrade that moves one of these breaks
this file and nothing else in the package.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed.autograd as _dist_autograd
import torch.distributed.rpc as rpc


def is_rpc_initialized() -> bool:
    """True between ``rpc.init_rpc`` and ``rpc.shutdown`` in this process."""
    return rpc.is_available() and rpc.api._is_current_rpc_agent_set()


def current_rpc_agent() -> Any:
    """This process's RPC agent (one object per RPC world), or None outside ``rpc.init_rpc`` /
    ``rpc.shutdown``."""
    api = rpc.api
    return api._get_current_rpc_agent() if rpc.is_available() and api._is_current_rpc_agent_set() else None


def register_rpc_reducer(cls: type, reducer: Callable[[Any], tuple], *, replace: bool = False) -> None:
    """Make the RPC pickler serialize instances of exactly ``cls`` with ``reducer``.

    ``reducer(obj)`` returns a ``(callable, args)`` pair as ``__reduce__`` does. It applies only
    inside RPC messages; plain ``pickle`` keeps using the class's own ``__reduce_ex__``.
    Registering the same class twice keeps the first reducer (as torch does), unless
    ``replace``: then ``reducer`` wins over one registered before (e.g. torch's own reducer for
    script modules, registered when ``torch.distributed.nn`` was imported first); a later
    registration by torch keeps it, since torch keeps the first.
    """
    from torch.distributed.rpc.internal import _internal_rpc_pickler

    if replace:
        _internal_rpc_pickler._class_reducer_dict[cls] = reducer
    else:
        _internal_rpc_pickler._register_reducer(cls, reducer)


def device_map_to(worker: str | int) -> dict:
    """This worker's device map towards ``worker`` (empty when none is set)."""
    agent = rpc.api._get_current_rpc_agent()
    return dict(agent._get_device_map(agent.get_worker_info(worker)))


def interface_forward_schema(interface_cls: type) -> Any:
    """The TorchScript schema of ``forward`` on a ``@torch.jit.interface`` class."""
    qualified_name = torch._jit_internal._qualified_name(interface_cls)
    interface = torch.jit._state._python_cu.get_interface(qualified_name)
    return interface.getMethod("forward")


def is_jit_interface(cls: Any) -> bool:
    """True for classes decorated with ``@torch.jit.interface``."""
    return isinstance(cls, type) and bool(getattr(cls, "__torch_script_interface__", False))


def worker_names() -> list[str]:
    """The names of all workers in the current RPC world."""
    return sorted(w.name for w in rpc.api._get_current_rpc_agent().get_worker_infos())


def dist_autograd_contexts_exist() -> bool:
    """True when any distributed autograd context is alive in this process (~0.4 µs).

    Conservative for "is this thread recording?": a context held by another thread, or
    created here by an incoming message, also counts.
    """
    return int(_dist_autograd._get_debug_info()["num_autograd_contexts"]) != 0


def in_dist_autograd_context() -> bool:
    """True when this thread is inside a ``torch.distributed.autograd.context()`` (what RPC
    calls made here record into). torch has no public query: ``_current_context()`` raises
    ``RuntimeError`` when there is none."""
    try:
        _dist_autograd._current_context()
    except RuntimeError:
        return False
    return True


def script_module_has_attribute(module: Any, name: str) -> bool:
    """True when the C++ object behind a ScriptModule has attribute ``name``."""
    return hasattr(module._c, name)


def rpc_class_reducers() -> dict:
    """The RPC pickler's table of per-class reducers (the live dict: later registrations show).

    ``register_rpc_reducer`` adds to it; remote_module._proxy.wire applies the same reducers in its
    own pickler so an object travels exactly as RPC would send it.
    """
    from torch.distributed.rpc.internal import _internal_rpc_pickler

    return _internal_rpc_pickler._class_reducer_dict


def rref_types() -> tuple[type, ...]:
    """The classes the RPC pickler sends with the RRef fork protocol."""
    return (rpc.PyRRef, rpc.RRef) if rpc.is_available() else ()


_shutdown_hooks: list[Callable[[], None]] = []


def before_rref_deletion_at_shutdown(hook: Callable[[], None]) -> None:
    """Run ``hook()`` in a graceful ``rpc.shutdown``, after every worker has reached shutdown
    and before this process deletes its user RRefs (the agent still serves then).

    torch 2.13's graceful shutdown runs ``_wait_all_workers``, then
    ``_delete_all_user_and_unforked_owner_rrefs()`` (looked up as a global of
    ``torch.distributed.rpc.api`` at call time), then ``agent.join``; the RRef-deletion step
    is wrapped once per process. Each hook is registered once; a failing hook is logged and
    the deletion still runs.
    """
    if hook in _shutdown_hooks:
        return
    _shutdown_hooks.append(hook)
    if len(_shutdown_hooks) > 1:  # the first hook wrapped the deletion step already
        return
    api = rpc.api
    original = api._delete_all_user_and_unforked_owner_rrefs

    def delete_all_user_and_unforked_owner_rrefs(*args: Any, **kwargs: Any) -> Any:
        import logging

        for run in list(_shutdown_hooks):
            try:
                run()
            except Exception:
                logging.getLogger("remote_module").exception("a shutdown hook failed")
        return original(*args, **kwargs)

    api._delete_all_user_and_unforked_owner_rrefs = delete_all_user_and_unforked_owner_rrefs


def is_async_execution(fn: Any) -> bool:
    """True for functions decorated with ``@rpc.functions.async_execution`` (they return a
    ``Future`` that RPC waits for on the host before answering)."""
    return hasattr(fn, "_wrapped_async_rpc_function")


def jit_exception_origin(exc: BaseException) -> tuple[str, str] | None:
    """``(python class name, original message)`` of the exception TorchScript code raised, for
    the ``torch.jit.Error`` this thread caught last (e.g. ``("builtins.ValueError", "bad")``);
    None for other exceptions or when torch did not record one.

    torch keeps both per thread when it turns a TorchScript exception into ``torch.jit.Error``,
    so call this in the ``except`` block that caught ``exc``; the error's own text, which ends
    with ``"<class name>: <message>"``, must agree (else the record is another error's).
    """
    if not isinstance(exc, torch.jit.Error):
        return None
    name = torch._C._get_caught_jit_exception_class_name()
    message = torch._C._get_caught_jit_exception_original_msg()
    if not name or not str(exc).rstrip().endswith(f"{name}: {message}".rstrip()):
        return None
    return name, message


def script_class_name(module: Any) -> str | None:
    """The qualified Python class name a ScriptModule was scripted from (None for others)."""
    if not isinstance(module, torch.jit.ScriptModule):
        return None
    name = module._c._type().qualified_name()
    parts = [p for p in name.split(".") if p != "__torch__" and not p.startswith("___torch_mangle_")]
    return ".".join(parts)


def as_python_module(value: Any) -> Any:
    """``value`` as a callable ``nn.Module``: the TorchScript object an RRef typed with an
    interface holds (``torch._C.ScriptModule``) wrapped as a ``RecursiveScriptModule`` (~30 µs);
    anything else as it is."""
    if isinstance(value, torch._C.ScriptModule):
        return torch.jit._recursive.wrap_cpp_module(value)
    return value


def embedding_bag_parts(
    weight: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, mode: str,
    per_sample_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's embedding_bag kernel with what ``F.embedding_bag`` drops: ``(output, bag sizes,
    max indices)``; for ``mode="max"`` the index into ``weight`` of each element's maximum
    (undocumented ``torch.embedding_bag``; ``mode``: "sum", "mean" or "max")."""
    out, _, sizes, max_indices = torch.embedding_bag(
        weight, indices, offsets, False, {"sum": 0, "mean": 1, "max": 2}[mode], False, per_sample_weights)
    return out, sizes, max_indices


def backward_accumulates(accumulator: Any) -> bool:
    """Whether the backward pass under way (called from a ``backward`` of an autograd Function)
    will run ``accumulator``, a leaf's ``AccumulateGrad`` node, i.e. write that leaf's
    ``.grad``: not under ``torch.autograd.grad()`` (which returns gradients instead) or a
    ``backward(inputs=...)`` that leaves the leaf out. True where torch cannot tell."""
    try:
        return bool(torch._C._will_engine_execute_node(accumulator))
    except RuntimeError as exc:  # torch refuses leaf nodes under autograd.grad(), which sets no .grad
        return "autograd.grad" not in str(exc)
    except AttributeError:
        return True


def dcp_storage_info(relative_path: str, offset: int, length: int) -> Any:
    """Where ``torch.distributed.checkpoint``'s file reader finds one saved item: ``length``
    bytes (one ``torch.save`` of a tensor chunk) at ``offset`` in the file ``relative_path``
    under the checkpoint's directory (a ``.metadata`` file's ``storage_data`` values)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


def _zip_writer_without_crc() -> Callable[[Any], Any] | None:
    """A maker of torch's zip writer over a file-like object that computes no CRC-32 of its
    records (``PyTorchFileWriter(f, compute_crc32=False, alignment)``), or None where this
    torch has not the pieces :func:`save_without_record_crc` uses (``serialization._save``)."""
    import inspect

    import torch.serialization

    save = getattr(torch.serialization, "_save", None)
    alignment = getattr(torch.serialization, "_get_storage_alignment", None)
    writer = getattr(torch._C, "PyTorchFileWriter", None)
    try:
        fits = (save is not None and alignment is not None and writer is not None and list(
            inspect.signature(save).parameters) == ["obj", "zip_file", "pickle_module", "pickle_protocol",
                                                    "_disable_byteorder_record"])
    except (TypeError, ValueError):
        fits = False
    return (lambda f: writer(f, False, alignment())) if fits else None


_ZIP_WITHOUT_CRC = _zip_writer_without_crc()


def save_without_record_crc(value: Any, f: Any) -> bool:
    """``torch.save(value, f)`` (a file-like ``f``) with torch's zip writer computing no CRC-32
    of each record, as ``torch.serialization.set_crc32_options(False)`` has it for every save in
    the process: for this one only. False (nothing written) where this torch lacks the pieces."""
    import pickle

    import torch.serialization

    if _ZIP_WITHOUT_CRC is None:
        return False
    try:
        writer = _ZIP_WITHOUT_CRC(f)
    except TypeError:  # (a torch whose writer takes other arguments)
        return False
    torch.serialization._save(value, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()
    f.flush()
    return True


def storage_address(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage (its ``StorageImpl``): the same while its data is,
    another once its data is replaced (``.data =``, a cast there and back), unless the old
    storage was freed and its address reused (hold it to rule that out)."""
    return tensor.untyped_storage()._cdata


def post_accumulate_grad_hooks(tensor: torch.Tensor) -> dict:
    """The hooks registered on ``tensor`` with ``register_post_accumulate_grad_hook`` (torch
    keeps them on the tensor, by handle id); empty where this torch keeps them elsewhere."""
    return getattr(tensor, "_post_accumulate_grad_hooks", None) or {}


#: ``profiler_enabled()``: whether torch's autograd profiler (``torch.profiler.profile``,
#: ``torch.autograd.profiler``) is recording in this thread (torch's own function, called
#: directly: a step asks it once per table)
profiler_enabled: Callable[[], bool] = torch.autograd._profiler_enabled


def global_optimizer_step_hooks() -> tuple[dict, dict] | None:
    """torch.optim's registries of global step hooks, ``(pre, post)`` (dicts torch changes in
    place: ``register_optimizer_step_pre_hook`` / ``_post_hook``); None where this torch keeps
    them elsewhere."""
    from torch.optim import optimizer

    pre = getattr(optimizer, "_global_optimizer_pre_hooks", None)
    post = getattr(optimizer, "_global_optimizer_post_hooks", None)
    return None if pre is None or post is None else (pre, post)


def in_torch_save(frame: Any) -> bool:
    """Whether ``torch.save`` is on the stack from ``frame`` outwards (its private ``_save``, or
    ``_legacy_save`` for ``_use_new_zipfile_serialization=False``; False where this torch names
    them otherwise). At most 64 frames are looked at."""
    codes = {getattr(getattr(torch.serialization, f, None), "__code__", None) for f in ("_save", "_legacy_save")}
    codes.discard(None)
    for _ in range(64):
        if frame is None or not codes:
            return False
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False
