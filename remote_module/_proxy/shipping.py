"""Shipping classes and functions the receiver cannot import by name, keeping their identity
where the receiver runs the same code.

A class (or factory) defined in ``__main__``, in a notebook, or inside a function is pickled
by reference as ``module.qualname``, which another process may not resolve. Those travel as
:func:`by_value_reduce` describes them: their wire name (``__main__`` and ``__mp_main__`` are
one name), a fingerprint of their code, and a by-value copy (cloudpickle). The receiver uses
**its own object of that name when it has one with the same fingerprint** (a same-script
world: torchrun, ``mp.spawn``, ``run_local``), so locks, singletons and class-level state
stay one; otherwise (a notebook, another script, a function's local class) it uses the copy.

The fingerprint (:func:`fingerprint`) is a SHA-256 of the wire module name, the qualified
name, the bytes of the defining module's file and the object's own source
(``inspect.getsource``): all read from files, so it is the same in every process that runs
the same script, whatever its hash seed. An object with neither a file nor source (``python
-c``, ``exec``), or one its module does not expose under its qualified name (a local class,
a redefined name), has no fingerprint and always travels as a copy.

The copy of a fingerprinted object is built once per process, a snapshot (same-code
receivers never read it; this keeps a ``__main__`` namedtuple output cheap on every call); an
object without a fingerprint is copied afresh each time it is sent. Importable classes still
travel by reference (smaller messages, the installed code).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import io
import pickle
import sys
import threading
import types
import weakref
from typing import Any

import cloudpickle
import torch
import torch.distributed.rpc as rpc

_MAIN_MODULES = ("__main__", "__mp_main__")
_CANDIDATES = (type, types.FunctionType)
_NO_FINGERPRINT = object()  # "not computed yet" in a decision


def importable_by_reference(obj: Any) -> bool:
    """True when ``pickle`` can send ``obj`` by name and another process can import that name."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", "")
    if module is None or module in _MAIN_MODULES or "<locals>" in qualname or "<lambda>" in qualname:
        return False
    try:
        if importlib.util.find_spec(module) is None:
            return False
    except (ImportError, ValueError):
        return False
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


# ---- identity: wire names, own objects, fingerprints ----------------------------------------


def _wire_module(name: str) -> str:
    return "__main__" if name in _MAIN_MODULES else name


def _own_object(module: str, qualname: str) -> Any:
    """This process's object called ``module.qualname``, never importing anything."""
    if "<" in qualname:
        return None
    obj = sys.modules.get(module)  # in spawn children sys.modules["__main__"] is __mp_main__
    try:
        for part in qualname.split("."):
            if obj is None:
                return None
            obj = getattr(obj, part, None)
    except Exception:
        return None
    return obj


_file_digests: dict[str, str | None] = {}


def _file_digest(module: Any) -> str | None:
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        return None
    if path not in _file_digests:
        try:
            with open(path, "rb") as f:
                _file_digests[path] = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            _file_digests[path] = None
    return _file_digests[path]


def fingerprint(obj: Any) -> str | None:
    """The code identity of a module-level class or function (see the module docstring).

    Example (every rank of ``torchrun --nproc-per-node=2 job.py`` prints the same value)::

        class Net(torch.nn.Module): ...
        print(fingerprint(Net))
    """
    module_name = getattr(obj, "__module__", None) or ""
    qualname = getattr(obj, "__qualname__", None) or ""
    file_digest = _file_digest(sys.modules.get(module_name))
    try:
        source: str | None = inspect.getsource(obj)
    except (OSError, TypeError):
        source = None
    if file_digest is None and source is None:
        return None
    h = hashlib.sha256()
    for part in (_wire_module(module_name), qualname, file_digest or "", source or ""):
        h.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:32]


# ---- per-object decisions (computed once per object, dropped with it) -----------------------


class _Decision:
    __slots__ = ("ref", "head", "fp", "payload")

    def __init__(self, ref: weakref.ref, head: tuple | None, fp: Any = _NO_FINGERPRINT) -> None:
        self.ref = ref
        self.head = head  # None: by reference; else (wire module, qualname, fingerprint or None)
        self.fp = fp
        self.payload: tuple | None = None  # cached (bytes or None, error) for fingerprinted objects


_decisions: dict[int, _Decision] = {}


def _remember(obj: Any, head: tuple | None, fp: Any = _NO_FINGERPRINT) -> _Decision:
    key = id(obj)

    def forget(ref: weakref.ref) -> None:
        entry = _decisions.get(key)
        if entry is not None and entry.ref is ref:
            del _decisions[key]

    decision = _Decision(weakref.ref(obj, forget), head, fp)
    _decisions[key] = decision
    return decision


def _decision(obj: Any) -> _Decision:
    decision = _decisions.get(id(obj))
    if decision is not None and decision.ref() is obj:
        return decision
    if importable_by_reference(obj):
        return _remember(obj, None)
    module_name = getattr(obj, "__module__", None) or ""
    module = _wire_module(module_name)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "")
    fp = fingerprint(obj) if _own_object(module, qualname) is obj else None
    _copy_module_by_value(module_name)
    return _remember(obj, (module, qualname, fp), fp)


def _copy_module_by_value(name: str) -> None:
    """Make cloudpickle copy what a non-importable module defines, as it does for ``__main__``.

    cloudpickle pickles anything in a module present in ``sys.modules`` by reference, which
    would send ``__mp_main__.Net`` (a spawned child's main script) or a dynamic module's class
    as a name inside its own copy: a receiver running other code would resolve it to its own.
    """
    if name == "__main__" or name not in sys.modules:
        return
    if name != "__mp_main__":
        try:
            if importlib.util.find_spec(name) is not None:
                return  # e.g. a local class of an importable module: cloudpickle copies it anyway
        except (ImportError, ValueError):
            pass
    try:
        cloudpickle.register_pickle_by_value(sys.modules[name])
    except (ValueError, TypeError):
        pass


def _fingerprint_of_own(obj: Any) -> str | None:
    decision = _decision(obj)
    if decision.fp is _NO_FINGERPRINT:
        decision.fp = fingerprint(obj)
    return decision.fp


# ---- the by-value copy --------------------------------------------------------------------

_rpc_types: list[type] = [torch.Tensor, torch.jit.ScriptModule]
if rpc.is_available():
    _rpc_types.append(rpc.PyRRef)
_RPC_TYPES = tuple(_rpc_types)
_local = threading.local()  # ids of the objects this thread is copying right now


def travels_with_rpc(cls: type) -> None:
    """Instances of ``cls`` inside a by-value copy are sent by the RPC pickler beside it.

    Tensors, RRefs and script modules already are; register classes that only the RPC
    pickler can send (e.g. with a reducer registered for RPC messages).

    Example::

        class Handle:                # a class that only the RPC pickler can send
            ...

        register_rpc_reducer(Handle, reduce_handle)  # (remote_module._core)
        travels_with_rpc(Handle)
    """
    global _RPC_TYPES
    if cls not in _RPC_TYPES:
        _RPC_TYPES = (*_RPC_TYPES, cls)


def _copying() -> set[int]:
    ids = getattr(_local, "ids", None)
    if ids is None:
        ids = _local.ids = set()
    return ids


class _Stash:
    """persistent_id half of the picklers below: RPC-only objects go beside the bytes."""

    def _init_stash(self) -> None:
        self.extras: list[Any] = []
        self._extra_index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, _RPC_TYPES):
            return None
        index = self._extra_index.get(id(obj))
        if index is None:
            index = self._extra_index[id(obj)] = len(self.extras)
            self.extras.append(obj)
        return index


class _CopyPickler(_Stash, cloudpickle.Pickler):
    """cloudpickle, except that nested non-importable objects keep their identity too."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._init_stash()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _CANDIDATES) and id(obj) not in _copying():
            reduced = by_value_reduce(obj)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)


class _ExtrasUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, extras: Any) -> None:
        super().__init__(file)
        self._extras = extras

    def persistent_load(self, pid: Any) -> Any:
        return self._extras[pid]


def _loads(payload: bytes, extras: Any) -> Any:
    return _ExtrasUnpickler(io.BytesIO(payload), extras).load()


def _copy(obj: Any) -> tuple[bytes | None, tuple, str | None]:
    """(cloudpickle bytes, RPC-only objects beside them, None) or (None, (), why it failed)."""
    ids = _copying()
    ids.add(id(obj))
    try:
        buf = io.BytesIO()
        pickler = _CopyPickler(buf)
        pickler.dump(obj)
        return buf.getvalue(), tuple(pickler.extras), None
    except Exception as exc:
        return None, (), f"{type(exc).__name__}: {exc}"
    finally:
        ids.discard(id(obj))


def _by_value(module: str, qualname: str, fp: str | None, payload: bytes | None, extras: Any,
              error: str | None = None) -> Any:
    """Receiver side of :func:`by_value_reduce`: the own object when it is the same code, else the copy."""
    if fp is not None:
        own = _own_object(module, qualname)
        if own is not None and isinstance(own, _CANDIDATES) and _fingerprint_of_own(own) == fp:
            return own
    if payload is None:
        raise pickle.UnpicklingError(
            f"{module}.{qualname} could not be copied by its sender ({error}) and this process has no "
            f"object of that name with the same code (run the same script on every worker, or make "
            f"{qualname} importable: define it in a module on the workers' path)"
        )
    obj = _loads(payload, extras)
    if isinstance(obj, _CANDIDATES):
        _remember(obj, (module, qualname, fp), fp)  # sent back, it is recognised as the original
    return obj


def by_value_reduce(obj: Any) -> tuple | None:
    """For a pickler's ``reducer_override``: how to send ``obj`` when it is a class or function
    another process cannot import by name; None for anything else (cheap: a type check, then
    a per-object cached decision).

    The receiver uses its own object of the same name when that is the same code (see
    :func:`fingerprint`), else a by-value copy. Raises ``pickle.PicklingError`` when the copy
    cannot be made and no receiver could have the same code.

    Example::

        class _Pickler(pickle.Pickler):
            def reducer_override(self, obj):
                reduced = by_value_reduce(obj)
                return NotImplemented if reduced is None else reduced
    """
    if not isinstance(obj, _CANDIDATES):
        return None
    decision = _decisions.get(id(obj))
    if decision is None or decision.ref() is not obj:
        decision = _decision(obj)
    head = decision.head
    if head is None:
        return None
    if head[2] is None:
        payload = _copy(obj)  # no identity: the copy is the object, so it is taken fresh each time
    else:
        # Same-script receivers never read the copy: built once per process (a snapshot).
        payload = decision.payload
        if payload is None:
            payload = decision.payload = _copy(obj)
    data, extras, error = payload
    if data is None and head[2] is None:
        raise pickle.PicklingError(f"cannot send {head[0]}.{head[1]} by value: {error}")
    return (_by_value, (*head, data, extras, error)) if error else (_by_value, (*head, data, extras))


# ---- constructors (RemoteModule(..., module_cls, args, kwargs)) ----------------------------


class _ConstructorPickler(_Stash, pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._init_stash()
        self.shipped = False

    def reducer_override(self, obj: Any) -> Any:
        reduced = by_value_reduce(obj)
        if reduced is None:
            return NotImplemented
        self.shipped = True
        return reduced


class ByValue:
    """A constructor call (``module_cls``, args, kwargs) in which something travels by value.

    ``payload`` is a pickle whose non-importable classes and functions went through
    :func:`by_value_reduce`; ``extras`` holds the tensors and RRefs it refers to, which the
    RPC pickler sends as usual.
    """

    __slots__ = ("payload", "name", "extras")

    def __init__(self, payload: bytes, name: str, extras: tuple = ()) -> None:
        self.payload = payload
        self.name = name
        self.extras = extras

    def load(self) -> tuple[Any, tuple, dict]:
        return _loads(self.payload, self.extras)

    def __reduce__(self) -> tuple:
        return ByValue, (self.payload, self.name, self.extras)


def pack_constructor(module_cls: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """What to send for ``module_cls(*args, **kwargs)``: as is, or one :class:`ByValue` when
    anything in it, at any depth, is a class or function the host cannot import by name."""
    buf = io.BytesIO()
    pickler = _ConstructorPickler(buf)
    try:
        pickler.dump((module_cls, args, kwargs))
    except Exception as exc:
        if not pickler.shipped:
            return module_cls, args, kwargs  # nothing needs a copy: RPC's pickler sends (or explains) it
        name = getattr(module_cls, "__qualname__", repr(module_cls))
        raise TypeError(
            f"cannot send the constructor of {name!r}: part of it travels by value and another part "
            f"cannot be pickled ({type(exc).__name__}: {exc}); pass picklable arguments"
        ) from exc
    if not pickler.shipped:
        return module_cls, args, kwargs
    name = getattr(module_cls, "__qualname__", repr(module_cls))
    return ByValue(buf.getvalue(), name, tuple(pickler.extras)), (), {}


def unpack_constructor(module_cls: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """Host side of :func:`pack_constructor`."""
    if isinstance(module_cls, ByValue):
        return module_cls.load()
    return module_cls, args, kwargs
