"""PSOptimizer: the optimizer the parameter servers run, as a ``torch.optim.Optimizer`` on the
trainer, so that torch's LR schedulers (and a hand-set ``group["lr"]``) drive it.

Its ``step()`` does no update (the servers apply it): the owner's ``step()`` (a ``PSModel``'s)
calls it, as a local training loop calls its optimizer's. What the servers use is its one
param group's ``lr``, ``momentum``, ``betas`` and ``weight_decay``, sent with the owner's next
push whenever they changed (in the same message: no extra round trip).

Also here: the one torch.optim post-step hook that tells the owners of server-side parameters
(tables, PSModels) of every local optimizer step (:func:`watch_local_optimizers`): a local
scheduler changing an lr the servers never see warns, and so do gradients never pushed.
"""

from __future__ import annotations

import inspect
import math
import threading
import warnings
import weakref
from operator import is_
from typing import Any, Callable, Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from remote_module._core import global_optimizer_step_hooks, profiler_enabled, user_stacklevel

#: the settings a PSOptimizer's group carries to the servers
SETTINGS = ("lr", "momentum", "betas", "weight_decay")
_ABSENT = object()  # (a setting the group does not have)
_PLAIN = frozenset({float, int, bool, type(_ABSENT)})  # (values that never change in place)


def _plain(values: tuple) -> bool:
    """Whether each of ``values`` is a number, a tuple of numbers or absent (:data:`_PLAIN`)."""
    return all(type(v) in _PLAIN or (type(v) is tuple and all(type(b) in _PLAIN for b in v)) for v in values)


def class_defaults(cls: type, kwargs: dict) -> dict:
    """``cls(params, **kwargs).defaults``: every setting of the optimizer the servers build,
    given or default (built once on a one-element stand-in)."""
    return dict(cls([torch.zeros(1, requires_grad=True)], **kwargs).defaults)


def set_group(group: dict, settings: dict) -> None:
    """Put ``settings`` (a ps_optimizer's) into an optimizer's param ``group``: those it has."""
    for key, value in settings.items():
        if key in group:
            group[key] = value


class PSOptimizer(torch.optim.Optimizer):
    """The servers' optimizer as LR schedulers see it: one param group over ``params`` (the
    owner's parameters) with ``defaults`` (the settings of the optimizer the servers run).

    Example (``model`` a ``PSModel``)::

        scheduler = torch.optim.lr_scheduler.StepLR(model.ps_optimizer, step_size=10, gamma=0.5)
        for x, y in batches:
            loss_fn(model(x), y).backward()
            model.step()          # pushes, and calls model.ps_optimizer.step()
            scheduler.step()      # the next push carries the new lr
    """

    def __init__(self, params: Iterable[torch.Tensor], defaults: dict, owner: str) -> None:
        params = list(params) or [torch.zeros(0, requires_grad=True)]  # (a model with no dense parameter)
        super().__init__(params, defaults)
        self.owner = owner
        self._unpushed_steps = 0  # calls in a row that found gradients the owner's step() never pushed

    def __getstate__(self) -> dict:
        """torch's (defaults, state, param_groups) and :attr:`owner`, which its errors name (a
        copy of the owner, ``copy.deepcopy`` or pickle, copies this too)."""
        return {**super().__getstate__(), "owner": self.owner}

    def __setstate__(self, state: dict) -> None:
        """torch's, and the count of unpushed steps, which a copy starts again."""
        super().__setstate__(state)
        self._unpushed_steps = 0

    def step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """``step(closure=None)``. No update here: the servers apply it at the owner's ``step()``, which calls this.
        ``closure`` (torch's form) is run, with gradients on, and its loss returned. Called
        twice in a row with gradients on the parameters (the owner's ``step()`` clears them
        before it calls this), as a ported loop that kept ``optimizer.step()`` and has no
        ``model.step()`` does, it warns once: nothing was trained. Step hooks and the profiler
        see it as any torch optimizer's step (:func:`observed_step`)."""
        return observed_step(self, PSOptimizer._no_update, args, kwargs)

    step.hooked = True  # type: ignore[attr-defined]  # (torch's constructor leaves it as it is: see observed_step)

    def _no_update(self, closure: Callable[[], Any] | None = None) -> Any:
        """:meth:`step`'s own part."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._holds_gradients():
            self._unpushed_steps += 1
            if self._unpushed_steps == 2:
                warnings.warn(f"{self.owner}'s ps_optimizer.step() does no update and pushes nothing: the "
                              "servers train only at the owner's step() (model.step()), which pushes the "
                              "gradients and calls this", UserWarning, stacklevel=user_stacklevel())
        elif self._unpushed_steps < 2:
            self._unpushed_steps = 0
        return loss

    def _holds_gradients(self) -> bool:
        """Whether a parameter of this optimizer (not a zero-size one) has a ``.grad``."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.numel():
                    return True
        return False

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "param_groups", None):
            raise ValueError(f"{self.owner}'s ps_optimizer has one param group (the servers run one optimizer "
                             "setting for the whole model): set its settings in param_groups[0]")
        super().add_param_group(param_group)

    def settings(self) -> dict[str, Any]:
        """The group's settings the servers use, checked: ``ValueError`` naming one torch would
        refuse (a negative or non-finite lr, say). A new dict, the caller's to change."""
        return dict(self.current_settings())

    def current_settings(self) -> dict[str, Any]:
        """:meth:`settings` without the copy, for the library's steps, which read them for every
        table and never change them: the last checked settings are returned again while the
        group holds the same plain values (the same objects, or numbers equal to them; a tensor
        may change in place, and a float32 tensor or NumPy scalar equals a float it is not:
        ``0.1 == torch.tensor(0.1)``), so a step's settings are one dict while they hold."""
        group = self.param_groups[0]
        raw = (group.get("lr", _ABSENT), group.get("momentum", _ABSENT), group.get("betas", _ABSENT),
               group.get("weight_decay", _ABSENT))
        last = self.__dict__.get("_last_settings")
        if last is not None and (all(map(is_, last[0], raw)) or (last[0] == raw and _plain(raw))):
            return last[1]  # (only plain values are kept: the same objects are plain values too)
        out = self._checked_settings(group)
        if _plain(raw):
            self._last_settings = (raw, out)
        return out

    def _checked_settings(self, group: dict) -> dict[str, Any]:
        """:meth:`settings` of ``group``, checked."""
        out: dict[str, Any] = {}
        for key in SETTINGS:
            if key not in group:
                continue
            value = group[key]
            if key == "betas":
                value = tuple(float(b) for b in value)
                ok = len(value) == 2 and all(0.0 <= b < 1.0 for b in value)
            else:
                value = float(value.item() if isinstance(value, torch.Tensor) else value)
                ok = math.isfinite(value) and value >= 0.0
            if not ok:
                raise ValueError(f"{self.owner}'s ps_optimizer has {key}={group[key]!r}, which the servers' "
                                 "optimizer would refuse")
            out[key] = value
        return out


def common_defaults(members: list[torch.optim.Optimizer]) -> dict:
    """The settings every one of ``members`` has in its ``defaults`` (the first member's value
    where theirs differ, as a local optimizer whose groups set their own keeps its constructor's)."""
    if not members:
        return {}
    return {key: value for key, value in members[0].defaults.items() if all(key in m.defaults for m in members)}


class GroupedPSOptimizer(torch.optim.Optimizer):
    """Several owners' :class:`PSOptimizer` as one optimizer (a collection's tables): one param
    group per member, the member's own (the same dict, read anew each time), so a scheduler on
    this one sets what each member sends. Its ``defaults`` are the members' common ones
    (:func:`common_defaults`): a scheduler that cycles the momentum or ``betas`` (``OneCycleLR``,
    ``CyclicLR``) takes it where it takes a local optimizer of the tables' kind, and refuses it
    where that one is refused (Adagrad, which has neither)."""

    def __init__(self, members: list[PSOptimizer], owner: str) -> None:
        self._members: list[PSOptimizer] = []  # (empty while torch's constructor checks the groups)
        super().__init__([{"params": list(m.param_groups[0]["params"])} for m in members], common_defaults(members))
        self._members, self.owner = list(members), owner

    def __getstate__(self) -> dict:
        """Its members and :attr:`owner` (its groups are theirs: a copy of the collection, by
        ``copy.deepcopy`` or pickle, groups the copied tables' optimizers), torch's defaults and
        state."""
        return {"defaults": self.defaults, "state": self.state, "_members": self._members, "owner": self.owner}

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict]:
        return [m.param_groups[0] for m in self._members]

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:  # (torch's constructor: the groups are the members')
        pass

    def add_param_group(self, param_group: dict) -> None:
        if self._members:
            raise ValueError(f"{self.owner}'s ps_optimizer has one param group per table, which are the tables' "
                             "own: add a table to the collection instead")
        super().add_param_group(param_group)

    def step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """``step(closure=None)``. No update here (the servers apply it at the owner's ``step()``, which calls this);
        seen by step hooks and the profiler as :meth:`PSOptimizer.step` is."""
        return observed_step(self, GroupedPSOptimizer._no_update, args, kwargs)

    step.hooked = True  # type: ignore[attr-defined]

    def _no_update(self, closure: Callable[[], Any] | None = None) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def load_state_dict(self, state_dict: dict) -> None:
        """Each member's settings from ``state_dict``'s groups, in order (as torch's, but into
        the members' own groups)."""
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self._members):
            raise ValueError(f"{self.owner}'s ps_optimizer has {len(self._members)} param groups (one per table), "
                             f"the state has {len(groups)}")
        for member, saved in zip(self._members, groups):
            member.param_groups[0].update({k: v for k, v in saved.items() if k != "params"})


def observed_step(optimizer: torch.optim.Optimizer, body: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """A PS optimizer's ``step(*args, **kwargs)``, whose own part is ``body(optimizer, *args, **kwargs)``.

    torch wraps every optimizer class's ``step`` (``Optimizer.profile_hook_step``): the
    profiler's record of the step and the step hooks, global and the optimizer's own. That
    wrapper cost about 50 µs of a training step's 1 ms (measured at a table's prefetched step,
    which calls it every time; a collection calls it for each table), mostly the profiler's
    record. So the PS optimizers' ``step`` is marked ``hooked`` (torch leaves it unwrapped) and
    goes through torch's wrapper whenever anything would see the difference: the autograd
    profiler is on, or a step hook is registered other than :func:`_on_optimizer_step` (which
    ignores these optimizers). An LR scheduler's own wrapper, which counts the calls, is on the
    instance and runs either way. Hooks see the arguments as the caller gave them (a closure
    given by keyword is in ``kwargs``), as torch's wrapper passes them, and a pre hook may
    replace them."""
    if _observed(optimizer):
        return _WRAPPED[body](optimizer, *args, **kwargs)
    return body(optimizer, *args, **kwargs)


#: torch's registries of global step hooks, ``(pre, post)``: dicts it changes in place (None where
#: this torch keeps them elsewhere: every step is then taken as observed)
_GLOBAL_HOOKS = global_optimizer_step_hooks()


def _observed(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step of ``optimizer`` would be seen by anything but its caller (see
    :func:`observed_step`)."""
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks) or not _unobserved()


#: each PS optimizer's step body, wrapped as torch wraps an optimizer's step (:func:`observed_step`)
_WRAPPED: dict[Callable[..., Any], Callable[..., Any]] = {}


def step_each(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """``optimizer.step()`` of each of ``optimizers`` in turn (the PS optimizers of a
    collection's tables, and its own), with what :func:`observed_step` checks read once: a step
    that nothing observes (no profiler, no step hook but ours) of an optimizer whose ``step`` is
    its class's runs its own part directly; any other (an LR scheduler's counting wrapper on the
    instance, a subclass's ``step``, its own hooks) is called as it is, and the checks are read
    again after it (its hooks or ``step`` may register a global hook or start the profiler,
    which the next optimizers' steps must see, as with ``step()`` of each)."""
    unobserved = _unobserved()
    for optimizer in optimizers:
        body = _BODIES.get(type(optimizer).step) if unobserved else None
        if (body is None or "step" in optimizer.__dict__ or optimizer._optimizer_step_pre_hooks
                or optimizer._optimizer_step_post_hooks):
            optimizer.step()
            unobserved = _unobserved()
        else:
            body(optimizer)


def _unobserved() -> bool:
    """Whether nothing but an optimizer's own hooks could see its step: no profiler, no global
    step hook but :func:`_on_optimizer_step`, which ignores these optimizers (:func:`_observed`
    less the optimizer's hooks)."""
    if _GLOBAL_HOOKS is None or profiler_enabled():
        return False
    before, after = _GLOBAL_HOOKS
    return not before and (not after or (len(after) == 1 and _on_optimizer_step in after.values()))


#: the owners of server-side parameters told of local optimizer steps (tables, PSModels)
_live_watchers: "weakref.WeakSet[Any]" = weakref.WeakSet()
_hook_lock = threading.Lock()
_optimizer_hook: Any = None


def _on_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch.optim's global post-step hook: tell every watcher (:func:`watch_local_optimizers`)
    that a local optimizer stepped."""
    # (the servers' optimizer's stand-in, or a collection's group of them: its owner pushed, and a
    # scheduler on it is how the tables' lr is meant to change)
    if isinstance(optimizer, (PSOptimizer, GroupedPSOptimizer)):
        return
    thread = threading.get_ident()
    for owner in list(_live_watchers):
        owner._local_optimizer_stepped(thread, optimizer)


def _watch_optimizer_steps() -> None:
    """Register :func:`_on_optimizer_step` with torch.optim, once per process."""
    global _optimizer_hook
    with _hook_lock:
        if _optimizer_hook is None:
            _optimizer_hook = register_optimizer_step_post_hook(_on_optimizer_step)


def watch_local_optimizers(owner: Any) -> None:
    """Call ``owner._local_optimizer_stepped(thread, optimizer)`` after every local torch.optim
    step (not a PSOptimizer's) while ``owner`` lives (a table or a PSModel: its parameters step
    on the servers, with the settings of its ps_optimizer, not with a local optimizer's)."""
    _live_watchers.add(owner)
    _watch_optimizer_steps()


def changed_group_lr(seen: "weakref.WeakKeyDictionary", optimizer: torch.optim.Optimizer,
                     params: Any) -> tuple[float, float] | None:
    """``(first, now)`` when the lr of ``optimizer``'s param group holding any of ``params``
    (tensors) changed since ``optimizer``'s first step seen (``seen`` keeps the baselines; a
    group added later starts a new one), else None."""
    entry = seen.get(optimizer)
    if entry is None or entry[0] != len(optimizer.param_groups):
        ids = {id(p) for p in params}
        group = next((g for g in optimizer.param_groups if any(id(p) in ids for p in g["params"])), None)
        entry = (len(optimizer.param_groups), group, None if group is None else float(group["lr"]))
        seen[optimizer] = entry
    _, group, first = entry
    if group is None or float(group["lr"]) == first:
        return None
    return first, float(group["lr"])


_WRAPPED.update({body: torch.optim.Optimizer.profile_hook_step(body)
                 for body in (PSOptimizer._no_update, GroupedPSOptimizer._no_update)})
#: each PS optimizer class's ``step``, and its own part (:func:`step_each`)
_BODIES: dict[Callable[..., Any], Callable[..., Any]] = {PSOptimizer.step: PSOptimizer._no_update,
                                                         GroupedPSOptimizer.step: GroupedPSOptimizer._no_update}
for _cls in (PSOptimizer, GroupedPSOptimizer):  # (what inspect.signature shows: torch's wrapped step showed it)
    _cls.step.__signature__ = inspect.signature(_cls._no_update)  # type: ignore[attr-defined]
