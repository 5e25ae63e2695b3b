"""PSModel: a trainer's view of a model whose parameters live, sliced into blocks, on
parameter servers."""

from __future__ import annotations

import hashlib
import math
import numbers
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.func import functional_call

from remote_module._core import (
    call_all,
    is_rpc_initialized,
    nested_seconds,
    timeout_seconds,
    user_stacklevel,
)
from remote_module.ps._optimizer import (
    PSOptimizer,
    changed_group_lr,
    class_defaults,
    watch_local_optimizers,
)
from remote_module.ps._options import TrainingOptions
from remote_module.ps._placement import Block, RoundRobin, block_name, block_of, check_servers, place, slice_blocks
from remote_module.ps._steps import InFlight, SteppedTable, report_unpushed, run_push_plans, wait_for_earlier
from remote_module.ps.dense import _server
from remote_module.ps.dense._checkpoints import PSCheckpoints
from remote_module.ps.dense._pushes import DensePushes
from rpc_backend.watch import add_status


def _step_line(model: PSModel) -> str:
    """What this trainer's heartbeats say of ``model``: the step it is at."""
    return f"step {model._step} of PSModel {model.name!r}"


def _dc_asgd_lambda(value: Any, ps_mode: str) -> float | None:
    """``dc_asgd`` checked: None (off), or a finite real number >= 0 (any ``numbers.Real`` but
    bool, as the other numeric settings: numpy's scalars too) with ``ps_mode="async"``."""
    if value is None:
        return None
    try:
        lam = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None
    except OverflowError:  # an int too large for a float
        lam = None
    if lam is None or not math.isfinite(lam) or lam < 0:
        raise ValueError(f"dc_asgd must be a finite number >= 0 (DC-ASGD's lambda) or None, got {value!r}")
    if ps_mode != "async":
        raise ValueError(f"dc_asgd={value!r} needs ps_mode='async' (it compensates the delay of an async "
                         f"gradient), got ps_mode={ps_mode!r}")
    return lam


def _tables_in(model: nn.Module, ps_mode: str, num_trainers: int) -> dict[str, SteppedTable]:
    """The sharded tables inside ``model`` by qualified name, checked to train in ``ps_mode``
    with ``num_trainers`` (their rows live on their own servers; the PSModel steps them)."""
    # nominal: a module subclassing SteppedTable (the tables), never one that only has its
    # members (isinstance of a runtime_checkable protocol with data members tries hasattr on
    # Python <= 3.11, so a wrapper forwarding attribute reads, as torch.compile's, would count)
    tables = {qual: m for qual, m in model.named_modules() if SteppedTable in type(m).__mro__}
    for qual, table in tables.items():
        if table.ps_mode != ps_mode or table.num_trainers != num_trainers:
            raise ValueError(
                f"table {qual!r} trains with ps_mode={table.ps_mode!r}, num_trainers={table.num_trainers}, but the "
                f"PSModel with ps_mode={ps_mode!r}, num_trainers={num_trainers}: build the table with the same ones"
            )
    return tables


class _Pulled(torch.autograd.Function):
    """``value`` in the forward pass, its gradient passed to ``param`` in the backward pass: a
    forward runs on the values it pulled (a tensor of its own, which no later pull writes
    into), and the gradient still accumulates in the parameter users hold."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


#: per PSModel, held while a forward writes the pulled values and runs the module on its own
#: copy of them: functional_call installs that copy on the module for the call, so two threads
#: in one PSModel's forward at once would see (and could leave behind) each other's tensors.
#: Kept outside the object, which stays picklable and deep-copyable as a module.
_forward_locks: "weakref.WeakKeyDictionary[nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()
_forward_locks_guard = threading.Lock()


def _call_names(module: nn.Module) -> dict[str, nn.Parameter]:
    """Every parameter of ``module`` by each name it has, but a module registered under several
    names counted once (under its first name)."""
    seen, out = set(), {}
    for mname, m in module.named_modules(remove_duplicate=False):
        for pname, p in m._parameters.items():
            if p is not None and (id(m), pname) not in seen:
                seen.add((id(m), pname))
                out[f"{mname}.{pname}" if mname else pname] = p
    return out


def _forward_lock(model: nn.Module) -> threading.RLock:
    with _forward_locks_guard:
        lock = _forward_locks.get(model)
        if lock is None:
            lock = _forward_locks[model] = threading.RLock()
        return lock


class _PlacedBlock:
    """One block of one parameter, as a trainer sees it."""

    __slots__ = ("param", "pname", "block", "name", "server")

    def __init__(self, param: str, block: Block, server: str) -> None:
        self.pname, self.block, self.server = param, block, server
        self.name = block_name(param, block.index)


def _steps_left(unpushed: list[int]) -> str | int:
    return f"{unpushed[0]} local optimizer step(s)" if unpushed[0] else 0


class PSModel(PSCheckpoints, DensePushes, InFlight, nn.Module):
    """A local model trained on parameter servers: its parameters are sliced into blocks
    (:func:`slice_blocks`) spread over ``servers`` (by ``split_method``), where a
    ``torch.optim`` optimizer per block applies the trainers' gradients.

    Before each ``forward`` the parameters are fetched from the servers (the last step's
    answers brought them: one round trip per step; or :meth:`pull`); after
    ``loss.backward()``, :meth:`step` pushes the gradients, block by block (blocks for different
    servers concurrently), and clears the local ones. ``ps_mode``: ``"sync"`` (each step
    averages all ``num_trainers`` trainers' gradients, applied once), ``"async"`` (each push
    applied on arrival), ``"half_async"`` (pushes summed and applied every
    ``half_async_merge_every`` pushes or ``half_async_merge_s`` seconds), ``"geo"`` (each trainer
    steps a local copy with its own optimizer and every ``geo_push_every`` optimizer steps pushes
    ``local - last pulled``, added on the servers divided by ``num_trainers``). As torch's
    optimizers, the servers (geo: the local optimizer) skip a parameter whose gradient is None:
    no momentum, no weight decay, no step count; a ``step()`` without any gradient is no
    optimizer step (geo: it does not count towards a push).

    ``dc_asgd`` (async only; None: off): DC-ASGD's ``lambda``; each server applies a trainer's
    gradient ``g`` as ``g + lambda * g * g * (w_now - w_sent)``, ``w_sent`` the block's value it
    last sent that trainer to compute gradients at, by a forward's pull or a push's answer (it
    keeps one copy of its blocks per trainer; ``pull()``, ``state_dict()`` and forwards under
    no_grad leave it).

    ``forward`` runs the model on the values it pulled, kept for its own graph: a later pull
    (another trainer's update arriving in async mode) never changes what an earlier forward's
    graph saved, so two forwards before one ``backward()`` give torch's gradients at the values
    each used. The parameters stay the same objects (``model.parameters()``, hooks), receive
    the gradients, and show the last pulled values; a pull writes them in place as an optimizer
    does, so a graph built on them directly (``model.module(x)``) raises torch's in-place error.
    Non-contiguous parameters (``channels_last``, ``.t()``) keep their strides.

    Servers run no code of their own (they join RPC and wait). The first trainer to attach
    initialises the blocks with its model's values; every trainer must build the same model,
    servers, ps_mode and slicing (checked: a mismatch is a ``ValueError``). Buffers (e.g.
    BatchNorm's running statistics) stay local to each trainer.

    ``state_dict()`` has the local model's own keys with the servers' current values;
    :meth:`optimizer_state_dict` the servers' optimizer state per parameter (geo: this trainer's
    optimizer state and its progress since its last push). Both load onto any number of servers
    (re-sliced), and training continues as it would have.

    Example (ranks ps0, ps1 only join RPC and wait; trainer0 and trainer1 run)::

        model = PSModel(nn.Linear(784, 10), ["ps0", "ps1"], name="mnist", num_trainers=2, ps_mode="sync")
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)   # pulls the current parameters first
            loss.backward()
            model.step()                          # pushes the gradients
    """

    def __init__(
        self,
        model: nn.Module,
        servers: Sequence[str],
        *,
        name: str,
        num_trainers: int,
        ps_mode: str = "sync",
        optimizer: tuple[type, dict] = (torch.optim.SGD, {"lr": 0.1}),
        split_method: Callable[[Sequence[str], Sequence[str]], Sequence[str]] = RoundRobin(),
        min_block_size: int = 8192,
        slice_var_up: bool = True,
        geo_push_every: int = 100,
        half_async_merge_every: int = 4,
        half_async_merge_s: float = 0.1,
        timeout: float | None = None,
        dc_asgd: float | None = None,
    ) -> None:
        super().__init__()
        self._start_trainer_state()
        # the values the last step's answers brought, and until when the next forward may use them
        self._ready: tuple | None = None
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        options = TrainingOptions(name, ps_mode, num_trainers, optimizer, timeout, geo_push_every,
                                  half_async_merge_every, half_async_merge_s, naming="the job")
        dc_asgd = _dc_asgd_lambda(dc_asgd, ps_mode)
        if not is_rpc_initialized():
            raise RuntimeError("PSModel needs torch.distributed.rpc: call rpc.init_rpc(...) first")
        self.module = model
        self._tables = _tables_in(model, ps_mode, options.num_trainers)
        self.servers = check_servers(servers)
        self.name, self.ps_mode, self.num_trainers = name, ps_mode, options.num_trainers
        self.optimizer = optimizer
        self.geo_push_every = options.geo_push_every
        self.timeout = options.timeout
        self._trainer = rpc.get_worker_info().name
        self._step = 0
        # a peer that loses this trainer names the step it was at (rpc_backend/watch.py)
        add_status(_step_line, owner=self)
        self._slots = self._layout(split_method, min_block_size, slice_var_up)
        self._slots_by_server = self._grouped_slots()
        #: DC-ASGD's lambda (None: off; async only)
        self.dc_asgd = dc_asgd
        self._spec = _server.JobSpec(ps_mode, options.num_trainers, (optimizer[0], dict(optimizer[1])),
                                     options.half_async_merge_every, options.half_async_merge_s,
                                     self._layout_digest(), dc_asgd)
        self._attach()
        self._start_training()

    def _start_training(self) -> None:
        """(Construction, once attached) The optimizers (the servers' stand-in; geo, the local
        one), the first pull, the watch on local optimizers and the hooks of nested loads."""
        optimizer = self.optimizer
        #: the servers' optimizer as a torch.optim.Optimizer: LR schedulers drive it, and the next
        #: push carries its lr, momentum, betas and weight_decay (geo: it drives the local optimizer)
        self.ps_optimizer = PSOptimizer(self._params().values(), class_defaults(*self._spec.optimizer),
                                        f"PSModel {self.name!r}")
        self._sent_settings: dict | None = None  # what the servers last took (None: send at the next step)
        # geo: the trainer's own optimizer (none for a model whose parameters are all tables')
        self._local_opt = (optimizer[0](self._params().values(), **optimizer[1])
                           if self.ps_mode == "geo" and self._params() else None)
        self._pulled: dict[str, torch.Tensor] = {}
        # geo: local optimizer steps whose deltas were not pushed yet (flush() pushes them; a
        # model gone with some warns)
        self._geo_unpushed = unpushed = [0]
        if self._local_opt is not None:
            weakref.finalize(self, report_unpushed, f"PSModel {self.name!r}", partial(_steps_left, unpushed))
        self._pull(record=True)  # (DC-ASGD: even a first push has the values it ran on)
        # a local optimizer over the parameters whose lr a scheduler changes warns once (the
        # servers step them with ps_optimizer's settings): see _local_optimizer_stepped
        self._warned_lr = False
        self._step_done: set = set()  # the parts stepped by a step() that failed part-way (None: the dense part)
        # the blocks a failed step's servers applied, and the gradients put back then: its retry
        # leaves those blocks out while no gradient came since (DensePushes._applied_already)
        self._took: tuple | None = None
        # geo: the local values an optimizer state load restored, kept for the model's load after it
        self._geo_restored: dict | None = None
        self._nested_keys: set | None = None  # a holding model's load: the keys it gave this one (_nested_load)
        watch_local_optimizers(self)
        # a model holding this one: its load_state_dict() reaches the local model through these
        self.register_load_state_dict_pre_hook(self._nested_load)
        self.register_load_state_dict_post_hook(self._nested_loaded)

    # ---- layout ---------------------------------------------------------------------

    def _params(self) -> "OrderedDict[str, nn.Parameter]":
        # less the tables' zero-size grad markers: the tables step their own rows
        markers = {id(t.grad_marker) for t in self._tables.values()}
        return OrderedDict((n, p) for n, p in self.module.named_parameters() if id(p) not in markers)

    def _layout(self, split_method: Any, min_block_size: int, slice_var_up: bool) -> list[_PlacedBlock]:
        blocks = [(pname, b) for pname, p in self._params().items()
                  for b in slice_blocks(p.shape, len(self.servers), min_block_size, slice_var_up)]
        chosen = place(split_method, [block_name(pname, b.index) for pname, b in blocks], self.servers)
        return [_PlacedBlock(pname, b, s) for (pname, b), s in zip(blocks, chosen)]

    def _layout_digest(self) -> str:
        """A digest of the blocks' layout (names, shapes, dtypes, offsets, servers): every
        trainer of the job must build the same (the servers compare it)."""
        params = self._params()
        return hashlib.sha256(repr([
            (s.name, tuple(params[s.pname].shape), str(params[s.pname].dtype), s.block.offset, s.block.size,
             s.server) for s in self._slots
        ]).encode()).hexdigest()

    def _by_server(self) -> dict[str, list[_PlacedBlock]]:
        """The blocks of each server, in layout order (the layout is fixed)."""
        return self._slots_by_server

    def _grouped_slots(self) -> dict[str, list[_PlacedBlock]]:
        """(Construction) :meth:`_by_server`: a server's blocks of one dtype together (they travel
        packed)."""
        grouped: dict[str, list[_PlacedBlock]] = {s: [] for s in self.servers}
        for slot in self._slots:
            grouped[slot.server].append(slot)
        params = self._params()
        for slots in grouped.values():
            order: dict = {}
            slots.sort(key=lambda s: order.setdefault(params[s.pname].dtype, len(order)))
        return grouped

    def _block_values(self, slot: _PlacedBlock, tensor: torch.Tensor | None = None) -> torch.Tensor:
        """Slot's elements of its parameter (or of ``tensor``, e.g. its gradient), flat in
        row-major order whatever the parameter's strides (a copy only where they need one)."""
        t = self._params()[slot.pname].detach() if tensor is None else tensor
        return block_of(t, slot.block).reshape(-1)

    def _seconds(self) -> float:
        return timeout_seconds(self.timeout)

    def _attach(self) -> None:
        # an earlier PSModel of this name in this process (a cell run again right after a step):
        # its last step's pushes land first, so the servers' step below counts them
        wait_for_earlier(self.name, self.timeout, f"PSModel {self.name!r}")
        calls = []
        for server, slots in self._by_server().items():
            blocks = {s.name: self._block_values(s).clone() for s in slots}
            calls.append((server, _server._attach, (self.name, self._spec, self._trainer, blocks)))
        # sync: a trainer attaching to a job under way (its PSModel built again, or restarted)
        # starts at the job's step; servers one step apart (a step cut short) meet again when it
        # pushes the lower one, which the server that has it takes as a retry (a server holding no
        # block of this job never advances, so it does not count)
        answers = call_all(calls, timeout=self.timeout)
        self._step = min((version for (_, _, (_, _, _, blocks)), (_, version) in zip(calls, answers) if blocks),
                         default=0)

    # ---- pull / push ----------------------------------------------------------------

    def _assembled(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each parameter whose blocks are all in ``values`` (flat, by block name), as a new
        tensor of the parameter's shape, dtype, device and strides (``channels_last`` stays so)."""
        params = self._params()
        whole: dict[str, list[_PlacedBlock]] = {}
        for slot in self._slots:
            whole.setdefault(slot.pname, []).append(slot)
        out = {}
        with torch.no_grad():
            for pname, slots in whole.items():
                if all(s.name in values for s in slots):
                    full = torch.empty_like(params[pname], requires_grad=False)
                    for s in slots:
                        part = block_of(full, s.block)
                        part.copy_(values[s.name].view(part.shape))
                    out[pname] = full
        return out

    def _write(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``values`` (flat blocks by name) into the local parameters, in place as an
        optimizer writes them (their version counters advance, so a graph that saved one of
        them raises torch's in-place error instead of using the new values); the parameters
        written, assembled (:meth:`_assembled`)."""
        params = self._params()
        assembled = self._assembled(values)
        with torch.no_grad():
            for pname, full in assembled.items():
                params[pname].copy_(full)
        return assembled

    # ---- one tensor per message ----------------------------------------------------------

    def _packable(self, slots: list[_PlacedBlock]) -> bool | list[int]:
        """How a server's blocks ``slots`` (a server's, in :meth:`_by_server` order: those of one
        dtype together) travel: ``True``, one flat tensor (they share a dtype); else the number
        of blocks of each dtype in turn, one flat tensor per dtype."""
        params = self._params()
        runs: list[int] = []
        last = None
        for s in slots:
            dtype = params[s.pname].dtype
            if runs and dtype == last:
                runs[-1] += 1
            else:
                runs.append(1)
                last = dtype
        return True if len(runs) <= 1 else runs

    def _sent(self, slots: list[_PlacedBlock], tensors: list[torch.Tensor]) -> Any:
        """Blocks as a message carries them: packed ``(names, sizes, flat)`` (one tensor per
        message, which the RPC agent sends far faster than several), or, for blocks of several
        dtypes, a list of those, one per dtype."""
        def pack(part: list[_PlacedBlock], values: list[torch.Tensor]) -> tuple:
            return [s.name for s in part], [s.block.size for s in part], torch.cat([t.reshape(-1) for t in values])

        packed = self._packable(slots)
        if packed is True:
            return pack(slots, tensors) if tensors else {}
        out, at = [], 0
        for n in packed:
            out.append(pack(slots[at:at + n], tensors[at:at + n]))
            at += n
        return out

    def _received(self, slots: list[_PlacedBlock], got: Any) -> dict[str, torch.Tensor]:
        """A server's answer for ``slots`` (one flat tensor, or one per dtype: see
        :meth:`_packable`) by block name."""
        packed = self._packable(slots)
        flats = [got] if isinstance(got, torch.Tensor) else got
        values: list[torch.Tensor] = []
        at = 0
        for n, flat in zip([len(slots)] if packed is True else packed, flats):
            values += torch.split(flat, [s.block.size for s in slots[at:at + n]])
            at += n
        return dict(zip([s.name for s in slots], values))

    def pull(self) -> None:
        """Fetch the parameters from the servers into the local model (in sync mode, waiting
        until the previous step was applied on every server).

        Example::

            model.pull()
            print(model.module.weight)       # the servers' current values
        """
        self._pull()

    def _pull(self, record: bool = False) -> None:
        """:meth:`pull`; ``record``: as a forward's pull, the values DC-ASGD's servers
        compensate this trainer's next push against (:meth:`_server_values`)."""
        self._wait_pushes()
        self._ready = None
        values = self._server_values(record)
        self._write(values)
        if self.ps_mode == "geo":
            self._pulled = {k: v.clone() for k, v in values.items()}
            self._geo_restored = None  # the local copy is the servers' now
            self._geo_unpushed[0] = 0

    def _server_values(self, record: bool = False) -> dict[str, torch.Tensor]:
        """Every block's value on its server, by block name (nothing written locally). In sync
        mode a server answers once this trainer's last step is applied there; the other modes
        answer at once. ``record`` (a forward that computes gradients, or the model's first
        pull): with DC-ASGD the servers keep what they sent, the values this trainer's next
        push is compensated against; a read that computes no gradient (``pull()``, a
        checkpoint, a forward under no_grad) leaves them, so a gradient computed before it is
        still compensated from the values it was computed at."""
        seconds = self._seconds()
        by_server = self._by_server()
        calls = [(server, _server._pull,
                  (self.name, [s.name for s in slots], self._step, nested_seconds(seconds), self._packable(slots),
                   self._trainer if record else None))
                 for server, slots in by_server.items() if slots]
        values = {}
        for (server, _, _), got in zip(calls, call_all(calls, timeout=self.timeout)):
            values.update(self._received(by_server[server], got))
        return values

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Pull the parameters (not in geo mode, which trains its local copy), then run the
        model on the values pulled.

        The last ``step()``'s pushes were answered with the servers' values right after them
        (sync: once that step was applied): the next forward runs on those, without pulling
        (one round trip per step); in async and half_async mode it so misses what other
        trainers pushed in between, as any async read may; ``pull()``, ``state_dict()``,
        ``optimizer_state_dict()``, ``load_state_dict()`` and ``flush()`` make it pull again,
        and so does the ``half_async_merge_s`` timer of a server that had this push queued,
        once it may have merged it.

        Each forward runs on values of its own: the pulled values are copied into the local
        parameters (``model.module.weight`` shows them) and the model runs on a separate copy
        whose gradient flows into those same parameter objects. So a later forward, whose pull
        may bring other trainers' updates (async, half_async), never changes what an earlier
        forward's graph saved: two forwards before one ``backward()`` give, as in torch, the sum
        of each forward's gradient at the values that forward used (parameters, hooks and
        optimizers holding them are unchanged objects). Under ``torch.no_grad()`` the model runs
        on the parameters themselves. Threads calling one PSModel pull concurrently and run the
        module one at a time (each on the values it pulled).
        """
        self._wait_pushes()  # (a failure of the last step's pushes raises here, once)
        self._step_done = set()  # a failed step() not retried: the next one is whole
        if self.ps_mode == "geo":
            return self.module(*args, **kwargs)
        # async / half_async: the values the last step's answers brought (a pull right after
        # that push), once, unless a half_async timer has merged what was queued since; else pull
        ready, self._ready = self._ready, None
        values = ready[0] if ready is not None and time.monotonic() < ready[1] else None
        if values is None:
            values = self._server_values(record=torch.is_grad_enabled())
        with _forward_lock(self):
            pulled = self._write(values)
            if not torch.is_grad_enabled():
                return self.module(*args, **kwargs)
            params = self._params()
            own = {id(params[pname]): _Pulled.apply(params[pname], value) if params[pname].requires_grad else value
                   for pname, value in pulled.items()}
            # each (module, attribute) once: torch's tie_weights leaves the copies installed on a
            # module registered under two names; a parameter two modules share (tied weights)
            # is given under both names, the same copy
            return functional_call(self.module, {name: own[id(p)] for name, p in _call_names(self.module).items()
                                                 if id(p) in own}, args, kwargs, tie_weights=False)

    def _local_optimizer_stepped(self, thread: int, optimizer: torch.optim.Optimizer) -> None:
        """A local torch.optim optimizer stepped (not :attr:`ps_optimizer`, nor geo's own): warn
        once if the lr of its param group holding this model's parameters changed since its
        first step seen (an LR scheduler on an optimizer over ``model.parameters()``, kept from
        a local script), since the servers step them with :attr:`ps_optimizer`'s lr."""
        if self._warned_lr or optimizer is self._local_opt:
            return
        changed = changed_group_lr(self._group_lrs, optimizer, self._params().values())
        if changed is None:
            return
        self._warned_lr = True
        warnings.warn(
            f"PSModel {self.name!r}: the lr of the {type(optimizer).__name__} param group holding its parameters "
            f"changed from {changed[0]:g} to {changed[1]:g} (an LR scheduler?), but the servers step them with "
            "model.ps_optimizer's settings, which local optimizers do not change: schedule model.ps_optimizer (and "
            "each table's ps_optimizer) instead of a local optimizer", UserWarning, stacklevel=user_stacklevel())

    def _wait_pushes(self) -> None:
        """Wait for the last step's pushes in flight (not geo), raising its failure once; and
        for its tables' own. sync: a step that counted on the servers but was not applied in
        time (a trainer missing) raises its ``CallTimeout`` here once, as a pull would; the
        next read waits for it again."""
        self._land_in_flight(self._tables.values())
        stalled, self._stalled = self._stalled, None
        if stalled is not None:
            # every part of that step counted on the servers: a step() now (the retry a failed
            # push asks for) pushes none of them again, as after a step that raised part-way; a
            # forward or zero_grad() makes the next step() a whole one. (Without this, step()
            # pushed the next step, without gradients: refused while the stalled step was not
            # applied, else taken as this trainer's next step, one step ahead of the others.)
            self._step_done = {None, *self._tables}
            raise stalled

    def __getstate__(self) -> dict:
        """As nn.Module's, once the pushes in flight landed (a failure raises here, as at any
        call), less the step in flight and its bookkeeping (a copy, e.g. ``copy.deepcopy``,
        shares the servers' values, not this trainer's step under way)."""
        self._wait_pushes()
        state = dict(super().__getstate__())
        for key in ("_flight", "_stalled", "_group_lrs"):
            del state[key]
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._start_trainer_state()
        watch_local_optimizers(self)

    def _start_trainer_state(self) -> None:
        """(Construction, and a copy) What this object alone holds, which a copy does not share:
        its step's pushes in flight and the baselines of local optimizers' lr (a local optimizer
        over the parameters whose lr a scheduler changes warns once: see
        :meth:`_local_optimizer_stepped`)."""
        self._flight = None
        self._stalled: BaseException | None = None  # sync: a step counted, not applied in time (raised once)
        self._group_lrs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the local gradients, and the tables' gradients since their last step (once the
        last step's pushes landed)."""
        self._wait_pushes()
        self._step_done = set()  # a failed step() dropped, not retried
        self._took = None
        super().zero_grad(set_to_none)
        for table in self._tables.values():
            table.zero_grad()

    def flush(self) -> None:
        """Wait for the last step's pushes in flight; half_async: have the servers apply what
        they have queued now; geo: push the deltas of the local steps since the last push now
        (the end of training: the steps after the last ``geo_push_every`` boundary) and take
        the merged values, as a push every ``geo_push_every`` steps does (the next one still
        comes at the next multiple of ``geo_push_every`` steps); its tables push theirs too."""
        self._wait_pushes()
        if self._geo_unpushed[0]:
            plans = self._delta_push_plans()
            if plans:
                run_push_plans(plans, self.timeout)
        self._ready = None  # the next forward pulls what the merge made
        call_all([(s, _server._flush, (self.name,)) for s in self.servers], timeout=self.timeout)
        for table in self._tables.values():
            table.flush()

    def stats(self) -> dict[str, dict]:
        """Per server: steps applied (sync), pushes applied, attached trainers, queued pushes
        (once the last step's pushes landed)."""
        self._wait_pushes()
        return dict(zip(self.servers, call_all([(s, _server._stats, (self.name,)) for s in self.servers],
                                                timeout=self.timeout)))

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, servers={list(self.servers)}, ps_mode={self.ps_mode!r}, "
                f"num_trainers={self.num_trainers}, blocks={len(self._slots)}")
