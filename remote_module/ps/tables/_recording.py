"""Gradient recording: a table's lookups recorded for its next step (:class:`_RowsForStep`, an
autograd node per lookup that hands backward's gradient of the rows to the table), and the
table's bookkeeping of them (:class:`GradientRecording`): what a step takes, what
``zero_grad()`` drops, and the warnings for gradients never pushed and for a local scheduler
whose lr never reaches the rows."""

from __future__ import annotations

import threading
import warnings
import weakref
from functools import partial
from typing import Any, Callable, NamedTuple

import torch

from remote_module._core import backward_accumulates, post_accumulate_grad_hooks, storage_address, user_stacklevel
from remote_module.ps._optimizer import changed_group_lr
from remote_module.ps._rowwise import pooled_rows

#: the param groups of local optimizers whose lr change a table warned of (:meth:`_check_group_lr`):
#: tables sharing a group (a collection's, a model's) warn once for it, not once each
_WARNED_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: backward passes a table records without a step() before it warns that its gradients are never
#: pushed, where no local optimizer step told it sooner (gradient accumulation stays below this)
UNPUSHED_BACKWARDS = 10


#: a table's bookkeeping attribute stored as such (its class's ``_PLAIN_ATTRIBUTES``): what its
#: ``__setattr__`` does for them, without a Python frame (a step sets a few per table)
set_plain = object.__setattr__


def _weakly(method: weakref.WeakMethod, marker: torch.Tensor) -> None:
    """A grad marker's hook: its table's :meth:`GradientRecording._backward_done`, while the table lives."""
    done = method()
    if done is not None:
        done(marker)


def _has_hook(marker: torch.Tensor, done: weakref.WeakMethod) -> bool:
    """Whether ``marker`` has the hook of :func:`_weakly` of ``done`` already."""
    return any(isinstance(h, partial) and h.func is _weakly and h.args[0] == done
               for h in post_accumulate_grad_hooks(marker).values())


class RecordedTogether(NamedTuple):
    """A table's gradient recorded with other tables' in one backward (a collection's lookup
    planned them together, ``_packed``): ``gradient``, the table's entry (``_packed``'s
    ``TablePackedGradient``), and ``lookup``, the ``PackedGradient`` of the whole lookup, which
    the collection's step pushes for all of them at once."""

    gradient: Any
    lookup: Any


class BagsGradient:
    """A lookup's gradient as backward left it, in the bags' form (``_embedding_bag._BagsGradient``): the
    gradient of its pooled bags (divided by each bag's size for a mean), with the lookup as it
    was sent (``shares``: per server index, the ids sent there and each bag's first position
    among them), so a step can push it as it is and each server computes its rows' gradients
    (``_handlers._push_bags``); ``rows()`` computes them here, the same bits, for the paths that
    need the rows (several lookups in one step, a retry after a partial failure)."""

    __slots__ = ("flat", "bags", "shares", "grad")

    def __init__(self, flat: torch.Tensor, bags: torch.Tensor, shares: dict, grad: torch.Tensor) -> None:
        self.flat, self.bags, self.shares, self.grad = flat, bags, shares, grad

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        return pooled_rows(self.flat, self.bags, self.grad)


class _RowsForStep(torch.autograd.Function):
    """``rows`` unchanged, recorded for :meth:`ShardedEmbedding.step`: backward hands their
    gradient to ``arrived`` (the table's :meth:`~GradientRecording._gradient_arrived`) and
    gives the table's zero-size ``grad_marker`` a (zero-size) gradient, so the marker's
    ``.grad`` says whether a gradient was recorded since the last ``zero_grad()``, as a
    parameter's does."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, marker: torch.Tensor, arrived: Callable, uniq: torch.Tensor,
                accumulator: Any) -> torch.Tensor:
        ctx.arrived, ctx.uniq, ctx.accumulator = arrived, uniq, accumulator
        ctx.marker = (marker.dtype, marker.device)  # (a model moved with .double() or .to(device))
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # as a parameter's .grad: only a backward that accumulates into the marker records (not
        # torch.autograd.grad(), nor backward(inputs=...) without the table)
        if backward_accumulates(ctx.accumulator):
            ctx.arrived(ctx.uniq, grad.to(torch.float32))  # the servers' rows are float32, whatever the model's dtype
        dtype, device = ctx.marker
        return None, torch.zeros(0, dtype=dtype, device=device), None, None, None


class GradientRecording:
    """The gradient bookkeeping of :class:`~remote_module.ps.tables._embedding.ShardedEmbedding`
    (a part of it: it uses the table's ``grad_marker``, ``name`` and locks)."""

    def _reset_gradients(self) -> None:
        """No gradients recorded (construction, and a copy)."""
        # (unique ids, gradient rows) of each lookup backward reached: ``_fresh`` in the backward
        # under way, ``_held`` in finished ones (dropped when the marker's grad was cleared since)
        self._fresh: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []
        # (the marker whose accumulation ends a backward (_fresh held), its AccumulateGrad node, its
        # data's storage then, by address and held): see _hooked_marker
        self._hooked: tuple | None = None
        self._backwards = 0  # backward passes recorded since the last step()
        self._stepped_past = False  # a local optimizer stepped while _held waited
        self._forward_thread: int | None = None
        self._warned_unpushed = False

    def _records_gradients(self) -> bool:
        """Whether this forward records gradients (grad enabled, the table not frozen); warns
        once if recorded gradients were never pushed (see the class docstring)."""
        marker = self.grad_marker
        if not (torch.is_grad_enabled() and marker.requires_grad):
            return False
        set_plain(self, "_forward_thread", threading.get_ident())
        if marker.grad is None:  # (as _drop_discarded; read again under the lock)
            with self._pending_lock:
                self._drop_discarded()
        if not self._warned_unpushed and (self._stepped_past or self._backwards >= UNPUSHED_BACKWARDS):
            self._warned_unpushed = True
            why = ("a local optimizer has stepped since they were recorded" if self._stepped_past
                   else f"{self._backwards} backward passes without a step()")
            warnings.warn(
                f"{type(self).__name__} {self.name!r}: gradients that backward recorded for its rows were never "
                f"pushed to the servers ({why}), so the table does not train: an optimizer of model.parameters() "
                "steps only its zero-size grad_marker. Call table.step() after loss.backward() (PSModel.step() "
                "does it for the tables inside a PSModel); to accumulate over backward passes, call it once after "
                "them; to freeze the table, table.requires_grad_(False)", UserWarning, stacklevel=user_stacklevel())
        return True

    def _rows_recorded(self, uniq: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (standing for the rows of ``uniq``) recorded for :meth:`step`: their gradient
        is kept once backward reaches them. Nothing is held before that, as with a local
        module: a lookup that is never backpropagated (an eval loop without ``no_grad``) is
        gone with its output."""
        # one thread at a time: torch takes a leaf's autograd lock, then the GIL, to find its
        # AccumulateGrad in an op (view_as, which runs without the GIL), but the GIL, then
        # that lock, in a Function's apply; two threads of one table doing both at once
        # deadlocked (waiting on this lock releases the GIL)
        with self._marker_lock:
            marker, accumulator = self._hooked_marker()
            return _RowsForStep.apply(rows, marker, self._gradient_arrived, uniq, accumulator)

    def _hooked_marker(self) -> tuple[torch.Tensor, Any]:
        """(``_marker_lock`` held) the grad marker, hooked to hold what a backward recorded once
        it ends (:meth:`_backward_done`), and its ``AccumulateGrad`` node."""
        marker = self.grad_marker
        hooked = self._hooked
        # (a copy, or the marker replaced; or its tensor swapped under it, torch.utils.swap_tensors
        # as ``model.float()`` does with swap_module_params_on_conversion: the hook and the
        # AccumulateGrad stay with the other tensor, even when it holds the same data)
        if hooked is None or hooked[0] is not marker or hooked[1].variable is not marker:
            # (through a weak reference: torch's garbage collector does not see a tensor's hooks,
            # so a hook holding the table kept every table that ran a backward alive for good)
            done = weakref.WeakMethod(self._backward_done)
            # once per marker: one given back after another (torch.func.functional_call's) has it
            if not _has_hook(marker, done):
                marker.register_post_accumulate_grad_hook(partial(_weakly, done))
            hooked = None
        if hooked is None or hooked[2] != storage_address(marker):
            # its AccumulateGrad, kept: torch keeps a leaf's only weakly, and would make a new one
            # at every lookup. torch gives the leaf a new one when its data is replaced by another
            # dtype or device (``.data =``, ``model.double()``), so it is found again whenever the
            # data is another storage: a cast and back (``.double().float()``) ends where it began
            # by dtype and device, but with a new node (the old storage is held, so its address
            # is no new one's)
            hooked = self._hooked = (marker, marker.view_as(marker).grad_fn.next_functions[0][0],
                                     storage_address(marker), marker.untyped_storage())
        return marker, hooked[1]

    def _gradient_arrived(self, uniq: torch.Tensor, grad: torch.Tensor) -> None:
        """In backward, before the marker accumulates: keep ``grad``, the gradient of the rows of
        ``uniq``; gradients of finished backward passes are dropped if ``zero_grad()`` cleared
        the marker since."""
        self._keep_gradient((uniq, grad))

    def _keep_gradient(self, entry: Any, together: Any = None) -> None:
        """:meth:`_gradient_arrived` of a gradient ``entry``: ``(ids, rows)``, or an object whose
        ``rows()`` gives them (a collection's: ``_packed.TablePackedGradient``, recorded with
        other tables' in ``together``, its ``PackedGradient``: the collection's next step pushes
        them together, :meth:`_take_packed_gradient`)."""
        with self._pending_lock:
            self._drop_discarded()
            self._fresh.append(entry)
        if together is not None:
            set_plain(self, "_together", RecordedTogether(entry, together))

    def _take_packed_gradient(self) -> RecordedTogether | None:
        """The last gradient recorded with other tables' (see :meth:`_keep_gradient`), taken
        (None when there is none since the last step)."""
        hint = self._together
        if hint is not None:
            set_plain(self, "_together", None)
        return hint

    def _backward_done(self, marker: torch.Tensor) -> None:
        """After the marker accumulated (once per backward through the table): this backward's
        gradients count until the marker's ``.grad`` is cleared."""
        with self._pending_lock:
            if not self._fresh:
                return
            self._held.extend(self._fresh)
            set_plain(self, "_fresh", [])
            set_plain(self, "_backwards", self._backwards + 1)
            # a gradient since a failed step: its retry is a step for every server again (those
            # that applied the failed one get the new rows, or an empty push: a step counted)
            if self._took:
                set_plain(self, "_took", frozenset())

    def _local_optimizer_stepped(self, thread: int, optimizer: torch.optim.Optimizer) -> None:
        """A local torch.optim optimizer stepped in ``thread``: note it if this table holds
        gradients recorded by a forward of that thread (see :meth:`_records_gradients`), and warn once if
        the lr of its group holding this table's ``grad_marker`` changed since its first step
        (see :meth:`_check_group_lr`)."""
        if thread == self._forward_thread and self._held and self.grad_marker.grad is not None:
            self._stepped_past = True
        if not self._warned_lr:
            self._check_group_lr(optimizer)

    def _check_group_lr(self, optimizer: torch.optim.Optimizer) -> None:
        """The rows step with the lr the table was built with, on the servers: an LR scheduler
        (or a hand-set ``group["lr"]``) changing the lr of the group that holds ``grad_marker``
        (an optimizer over ``model.parameters()``, as facebookresearch/dlrm schedules it) does
        not reach them, so warn once. A group's lr at the optimizer's first step seen is the
        baseline; a group added later starts a new one. No warning once the table's own
        ``ps_optimizer`` is scheduled (a scheduler attached to it, or its lr changed): a port that
        schedules both optimizers, as the rows' lr needs, was told already."""
        group = self.ps_optimizer.param_groups[0]
        if "initial_lr" in group or float(group["lr"]) != float(self.ps_optimizer.defaults["lr"]):
            return
        changed = changed_group_lr(self._group_lrs, optimizer, [self.grad_marker])
        if changed is None:
            return
        first, now = changed
        self._warned_lr = True
        warned = _WARNED_GROUPS.setdefault(optimizer, set())
        group = id(self._group_lrs[optimizer][1])
        if group in warned:  # another table in this group warned of it already
            return
        warned.add(group)
        warnings.warn(
            f"{type(self).__name__} {self.name!r}: the lr of the {type(optimizer).__name__} param group holding its "
            f"grad_marker changed from {first:g} to {now:g} (an LR scheduler?), but the table's rows "
            "step on the servers with its ps_optimizer's lr, which local optimizers do not change (nor those of "
            "the group's other tables, not named again): schedule table.ps_optimizer (a collection: its "
            "ps_optimizer; a PSModel: its tables' ps_optimizer) for the rows; to silence this, build the "
            "scheduled optimizer over the local parameters only (a PSModel's own step on the servers too: schedule "
            "its ps_optimizer)", UserWarning, stacklevel=user_stacklevel())

    def _drop_discarded(self) -> None:
        """(Lock held.) If ``zero_grad()`` (of the table, a container or an optimizer) cleared the
        marker's ``.grad`` since the held backward passes, forget them: their gradients are not
        pushed and they do not count towards the unpushed warning (a local optimizer step while
        they were held still does: their gradients were never pushed)."""
        if self.grad_marker.grad is None and (self._held or self._backwards):
            set_plain(self, "_held", [])
            set_plain(self, "_backwards", 0)

    def _take_gradients(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The gradients recorded and not discarded since the last step, now forgotten (lock held)."""
        self._drop_discarded()
        held, fresh = self._held, self._fresh
        if not held and not fresh:
            return []
        set_plain(self, "_held", [])
        set_plain(self, "_fresh", [])
        return held + fresh

    def _take_for_step(self) -> list:
        """The gradients recorded since the last step, taken for a push (the warnings' counts
        restart)."""
        with self._pending_lock:
            taken = self._take_gradients()
            if self._backwards:
                set_plain(self, "_backwards", 0)
            if self._stepped_past:
                set_plain(self, "_stepped_past", False)
        return taken
