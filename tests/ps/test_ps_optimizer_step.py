"""A PS optimizer's ``step()`` as torch's optimizers' (``remote_module.ps._optimizer``): it skips
torch's step wrapper only where nothing would see the difference, so step hooks (the
optimizer's own and global ones), the profiler's record of the step and an LR scheduler's count
of steps behave as with any ``torch.optim`` optimizer. No RPC: these are local objects."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from remote_module.ps._optimizer import GroupedPSOptimizer, PSOptimizer


def _optimizers() -> list[torch.optim.Optimizer]:
    one = PSOptimizer([torch.zeros(0, requires_grad=True)], {"lr": 0.1}, "table 'a'")
    other = PSOptimizer([torch.zeros(0, requires_grad=True)], {"lr": 0.2}, "table 'b'")
    return [one, GroupedPSOptimizer([one, other], "collection")]


@pytest.mark.parametrize("index", [0, 1], ids=["PSOptimizer", "GroupedPSOptimizer"])
def test_step_hooks_see_every_step(index: int) -> None:
    optimizer = _optimizers()[index]
    seen: list[str] = []
    handles = [
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append("pre")),
        optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append("post")),
    ]
    optimizer.step()
    assert seen == ["pre", "post"]
    for handle in handles:
        handle.remove()
    optimizer.step()
    assert seen == ["pre", "post"]
    handles = [register_optimizer_step_pre_hook(lambda opt, args, kwargs: seen.append("global pre")),
               register_optimizer_step_post_hook(lambda opt, args, kwargs: seen.append("global post"))]
    try:
        optimizer.step()
    finally:
        for handle in handles:
            handle.remove()
    assert seen == ["pre", "post", "global pre", "global post"]


@pytest.mark.parametrize("index", [0, 1], ids=["PSOptimizer", "GroupedPSOptimizer"])
def test_a_pre_hook_may_replace_the_arguments(index: int) -> None:
    """torch's wrapper lets a pre hook give new ``(args, kwargs)`` (``args`` with the optimizer
    first): the closure it gives runs."""
    optimizer = _optimizers()[index]
    handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: (args, {"closure": lambda: 7.0}))
    try:
        assert optimizer.step() == 7.0
    finally:
        handle.remove()
    assert optimizer.step() is None
    assert optimizer.step(lambda: 3.0) == 3.0


@pytest.mark.parametrize("index", [0, 1], ids=["PSOptimizer", "GroupedPSOptimizer"])
def test_the_profiler_records_the_step(index: int) -> None:
    optimizer = _optimizers()[index]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        optimizer.step()
    names = [event.name for event in prof.events()]
    assert f"Optimizer.step#{type(optimizer).__name__}.step" in names


def test_a_scheduler_counts_the_steps() -> None:
    """An LR scheduler wraps the instance's ``step`` to count it: no warning that it stepped
    before the optimizer, and the lr it sets is the group's."""
    optimizer = _optimizers()[0]
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            optimizer.step()
            scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)


def test_the_unpushed_warning_still_comes() -> None:
    """Two steps in a row with gradients on the parameters (a port without the owner's step()) warn."""
    param = torch.zeros(1, requires_grad=True)
    optimizer = PSOptimizer([param], {"lr": 0.1}, "model 'm'")
    param.grad = torch.ones(1)
    with pytest.warns(UserWarning, match="does no update and pushes nothing"):
        optimizer.step()
        optimizer.step()


def test_an_unobserved_step_skips_torchs_wrapper() -> None:
    """With no hook but the library's own (which ignores PS optimizers) and the profiler off, a
    step is not observed: torch's wrapper, and its profiler record, are skipped."""
    from remote_module.ps import _optimizer

    _optimizer._watch_optimizer_steps()  # (the library's global post hook, as a table registers it)
    for optimizer in _optimizers():
        assert not _optimizer._observed(optimizer)
        handle = optimizer.register_step_post_hook(lambda opt, args, kwargs: None)
        assert _optimizer._observed(optimizer)
        handle.remove()
        assert not _optimizer._observed(optimizer)


@pytest.mark.parametrize("index", [0, 1], ids=["PSOptimizer", "GroupedPSOptimizer"])
def test_hooks_see_the_arguments_as_given(index: int) -> None:
    """As torch's wrapper passes them: a closure by keyword is in ``kwargs`` (a pre hook may
    replace it there), an explicit ``None`` is in ``args``; the signature is ``(closure=None)``."""
    optimizer = _optimizers()[index]
    seen: list = []
    handles = [optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append((len(args), sorted(kwargs)))),
               optimizer.register_step_pre_hook(
                   lambda opt, args, kwargs: (args, {"closure": lambda: 5.0}) if "closure" in kwargs else None)]
    try:
        assert optimizer.step(closure=lambda: 1.0) == 5.0
        assert optimizer.step(None) is None
        assert optimizer.step() is None
    finally:
        for handle in handles:
            handle.remove()
    assert seen == [(1, ["closure"]), (2, []), (1, [])]
    assert list(inspect.signature(optimizer.step).parameters) == ["closure"]


def test_the_unpushed_warning_points_at_the_callers_step() -> None:
    """With or without torch's wrapper in between (a hook) or a scheduler's."""
    param = torch.zeros(1, requires_grad=True)
    optimizer = PSOptimizer([param], {"lr": 0.1}, "model 'm'")
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    handle = optimizer.register_step_post_hook(lambda opt, args, kwargs: None)
    param.grad = torch.ones(1)
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
            optimizer.step()
        assert [w.filename for w in caught] == [__file__], [w.filename for w in caught]
        optimizer._unpushed_steps = 0
        handle.remove()


def test_settings_follow_every_change_of_the_group() -> None:
    """``settings()`` returns its last checked settings again while the group holds the same
    plain values; a scheduler's new lr, a tensor lr changed in place, new betas and a refused
    value are each seen at the next call."""
    optimizer = PSOptimizer([torch.zeros(0, requires_grad=True)], {"lr": 0.1, "betas": (0.9, 0.99)}, "table 'a'")
    assert optimizer.settings() == {"lr": 0.1, "betas": (0.9, 0.99)}
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer.step()
    scheduler.step()
    assert optimizer.settings()["lr"] == pytest.approx(0.05)
    optimizer.param_groups[0]["betas"] = (0.8, 0.9)
    assert optimizer.settings()["betas"] == (0.8, 0.9)
    lr = torch.tensor(0.3)
    optimizer.param_groups[0]["lr"] = lr
    assert optimizer.settings()["lr"] == pytest.approx(0.3)
    lr.fill_(0.4)  # (in place: the same object, another value)
    assert optimizer.settings()["lr"] == pytest.approx(0.4)
    optimizer.param_groups[0]["lr"] = 0.4
    assert optimizer.settings()["lr"] == pytest.approx(0.4)
    optimizer.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr=-1.0"):
        optimizer.settings()
    with pytest.raises(ValueError, match="lr=-1.0"):  # (a refused value is refused every time)
        optimizer.settings()
    optimizer.param_groups[0]["lr"] = 0.4
    assert optimizer.settings() == {"lr": 0.4, "betas": (0.8, 0.9)}


def test_settings_of_a_value_equal_to_the_last_but_not_plain_are_its_own() -> None:
    """A float32 tensor or NumPy scalar equal to the last plain value (``0.1 ==
    torch.tensor(0.1)``) is sent as ``float()`` makes it, as when no settings were kept; the
    dict returned is the caller's to change (the next call does not see it)."""
    import numpy as np

    optimizer = PSOptimizer([torch.zeros(0, requires_grad=True)], {"lr": 0.1, "betas": (0.9, 0.99)}, "table 'a'")
    settings = optimizer.settings()
    settings["lr"] = 5.0
    assert optimizer.settings() == {"lr": 0.1, "betas": (0.9, 0.99)}
    group = optimizer.param_groups[0]
    for lr in (torch.tensor(0.1), np.float32(0.1)):
        group["lr"] = lr
        assert optimizer.settings()["lr"] == float(lr) != 0.1
    group["lr"] = 0.1
    assert optimizer.settings()["lr"] == 0.1
    group["betas"] = (torch.tensor(0.9), torch.tensor(0.99))
    assert optimizer.settings()["betas"] == (float(torch.tensor(0.9)), float(torch.tensor(0.99)))


def test_a_collections_steps_of_its_optimizers_are_their_steps() -> None:
    """``step_each`` (a collection's step of its tables' PS optimizers and its own) does what
    calling each one's ``step()`` does: its hooks run, the profiler records each, a scheduler
    counts its optimizer's steps, a subclass's ``step`` runs, the unpushed warning comes."""
    from remote_module.ps import _optimizer

    _optimizer._watch_optimizer_steps()  # (the library's global post hook, as a table registers it)
    one, grouped = _optimizers()
    other = grouped._members[1]
    seen: list[str] = []
    handle = other.register_step_post_hook(lambda opt, args, kwargs: seen.append("other"))
    try:
        _optimizer.step_each([one, other, grouped])
    finally:
        handle.remove()
    assert seen == ["other"]
    handles = [register_optimizer_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.owner))]
    try:
        _optimizer.step_each([one, grouped])
    finally:
        for h in handles:
            h.remove()
    assert seen == ["other", "table 'a'", "collection"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _optimizer.step_each([one, grouped])
    names = [event.name for event in prof.events()]
    assert "Optimizer.step#PSOptimizer.step" in names and "Optimizer.step#GroupedPSOptimizer.step" in names
    scheduler = torch.optim.lr_scheduler.StepLR(one, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            _optimizer.step_each([one, grouped])
            scheduler.step()
    assert one.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)

    class Counted(PSOptimizer):
        calls = 0

        def step(self, *args, **kwargs):
            Counted.calls += 1
            return super().step(*args, **kwargs)

    counted = Counted([torch.zeros(0, requires_grad=True)], {"lr": 0.1}, "table 'c'")
    _optimizer.step_each([counted, counted])
    assert Counted.calls == 2
    param = torch.zeros(1, requires_grad=True)
    holding = PSOptimizer([param], {"lr": 0.1}, "model 'm'")
    param.grad = torch.ones(1)
    with pytest.warns(UserWarning, match="does no update and pushes nothing"):
        _optimizer.step_each([holding, holding])


def test_a_hook_registered_by_an_earlier_step_of_a_collection_step_sees_the_later_ones() -> None:
    """A global hook registered (or a profiler started) by user code that an optimizer's step
    runs (its own hook) sees the later optimizers' steps of the same ``step_each``, as it sees
    them with ``step()`` of each."""
    from remote_module.ps import _optimizer

    _optimizer._watch_optimizer_steps()
    one, grouped = _optimizers()
    other = grouped._members[1]
    seen: list[str] = []
    handles: list = []

    def install(opt, args, kwargs):  # (once: a hook of table 'a' installs a global one)
        if not handles:
            handles.append(register_optimizer_step_pre_hook(lambda o, a, k: seen.append(o.owner)))

    own = one.register_step_post_hook(install)
    try:
        _optimizer.step_each([one, other, grouped])
    finally:
        own.remove()
        for h in handles:
            h.remove()
    assert seen == ["table 'b'", "collection"]
