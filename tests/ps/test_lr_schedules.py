"""LR schedules (issue 26): a PSModel's ``ps_optimizer`` is a torch.optim.Optimizer that torch's
LR schedulers drive; the next push carries its settings to the servers. In sync mode N trainers
equal one process on the global batch with the same scheduler."""

from __future__ import annotations

import pytest
import torch

from tests.ps import _dense_remote as d
from tests.ps import _lr_remote as r
from tests.ps._world import job

STEPS = 6


@pytest.fixture
def world(ps_world):  # shared with the other PS tests (tests/conftest.py)
    return ps_world


def local_reference(kind: str, steps: int) -> tuple[dict, list]:
    torch.manual_seed(0)
    net = d.Net()
    opt = torch.optim.SGD(net.parameters(), lr=r.LR, momentum=r.MOMENTUM)
    sched = r.scheduler(kind, opt, 8)
    lrs = []
    for k in range(steps):
        x = torch.cat([d.batch(t, k)[0] for t in range(2)])
        y = torch.cat([d.batch(t, k)[1] for t in range(2)])
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        r.advance(kind, sched, k)
    return {k: v.detach() for k, v in net.state_dict().items()}, lrs


@pytest.mark.parametrize("kind", ["step", "lambda", "plateau", "onecycle"])
def test_a_scheduler_on_ps_optimizer_trains_as_locally_in_sync_mode(world, kind):
    name = job(f"lr-{kind}")
    got = world.run({f"trainer{t}": (r.train, name, kind, t, 2, STEPS) for t in range(2)})
    weights, lrs = local_reference(kind, STEPS)
    assert len(set(lrs)) > 1  # the schedule changed the lr (else this would not tell)
    for t in range(2):
        assert got[f"trainer{t}"]["lrs"] == pytest.approx(lrs, rel=1e-12)
        for k, w in weights.items():
            torch.testing.assert_close(got[f"trainer{t}"]["weights"][k], w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["step", "onecycle"])
def test_a_checkpoint_with_the_schedulers_state_continues_as_uninterrupted(world, kind):
    whole = world.run({"trainer0": (r.train, job(f"lr-whole-{kind}"), kind, 0, 1, STEPS)})["trainer0"]
    first = world.run({"trainer0": (r.train, job(f"lr-first-{kind}"), kind, 0, 1, 3)})["trainer0"]
    rest = world.run({"trainer0": (r.train, job(f"lr-rest-{kind}"), kind, 0, 1, STEPS - 3, 3,
                                   first["checkpoint"])})["trainer0"]
    assert first["lrs"] + rest["lrs"] == pytest.approx(whole["lrs"], rel=1e-12)
    for k, w in whole["weights"].items():
        torch.testing.assert_close(rest["weights"][k], w, rtol=1e-6, atol=1e-7)


def test_sync_trainers_whose_settings_differ_get_a_value_error_naming_the_setting(world):
    name = job("lr-disagree")
    got = world.run({"trainer0": (r.disagree, name, 0), "trainer1": (r.disagree, name, 1)})
    for t in ("trainer0", "trainer1"):
        assert got[t].startswith("ValueError") and "'lr' differ" in got[t], got
        assert "trainer0: 0.2" in got[t] and "trainer1: 0.1" in got[t], got


def local_bag_reference(kind: str, steps: int) -> tuple[torch.Tensor, list]:
    bag = torch.nn.EmbeddingBag(r.ROWS, r.DIM, mode="sum", sparse=True)
    with torch.no_grad():
        bag.weight.copy_(r.initial_rows())
    cls, kwargs = r.table_optimizer(kind)
    opt = cls(bag.parameters(), **kwargs)
    sched = r.scheduler(kind, opt, 8)
    lrs = []
    for k in range(steps):
        parts = [r.bag_batch(t, k) for t in range(2)]
        ids = torch.cat([p[0] for p in parts])
        offsets = torch.cat([parts[0][1], parts[1][1] + parts[0][0].numel()])
        target = torch.cat([p[2] for p in parts])
        opt.zero_grad()
        ((bag(ids, offsets) - target) ** 2).mean().backward()
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        r.advance(kind, sched, k)
    return bag.weight.detach(), lrs


@pytest.mark.parametrize("kind", ["step", "lambda", "plateau", "onecycle"])
def test_a_scheduler_on_a_tables_ps_optimizer_trains_as_locally_in_sync_mode(world, kind):
    name = job(f"lr-bag-{kind}")
    got = world.run({f"trainer{t}": (r.train_bag, name, kind, t, 2, STEPS) for t in range(2)})
    rows, lrs = local_bag_reference(kind, STEPS)
    assert len(set(lrs)) > 1
    for t in range(2):
        assert got[f"trainer{t}"]["lrs"] == pytest.approx(lrs, rel=1e-12)
        torch.testing.assert_close(got[f"trainer{t}"]["rows"], rows, rtol=1e-5, atol=1e-6)


def test_a_scheduler_on_a_collections_ps_optimizer_drives_every_table(world):
    name = job("lr-ebc")
    got = world.run({f"trainer{t}": (r.train_collection, name, t, STEPS) for t in range(2)})
    local = {k: torch.nn.EmbeddingBag(r.ROWS, r.DIM, mode="sum", sparse=True) for k in ("a", "b")}
    for bag in local.values():
        with torch.no_grad():
            bag.weight.copy_(r.initial_rows())
    opt = torch.optim.SGD([{"params": local["a"].parameters()}, {"params": local["b"].parameters()}], lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    lrs = []
    for k in range(STEPS):
        parts = [r.bag_batch(t, k) for t in range(2)]
        n = parts[0][0].numel()
        opt.zero_grad()
        loss = 0
        for t, (ids, offsets, target) in enumerate(parts):  # each trainer's mean loss, averaged
            loss = loss + (((local["a"](ids, offsets) - target) ** 2
                            + (local["b"](ids.flip(0), offsets) + target) ** 2).mean()) / 2
        assert n == parts[1][0].numel()
        loss.backward()
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    for t in range(2):
        out = got[f"trainer{t}"]
        assert out["lrs"] == lrs  # (powers of two: exact)
        for k in ("a", "b"):
            torch.testing.assert_close(out["rows"][k], local[k].weight.detach(), rtol=1e-5, atol=1e-6)
        assert out["restored"] == opt.param_groups[0]["lr"]  # the loaded state went into the table's own group


@pytest.mark.parametrize("table", [False, True], ids=["psmodel", "table"])
def test_async_applies_each_push_with_its_own_trainers_settings(world, table, tmp_path):
    """async: the latest push's settings, i.e. its trainer's (sent only when they changed).
    trainer1 hand-sets lr 0 and pushes once; trainer0's next push, its lr 0.1 unchanged (so not
    sent again), still moves the values (before: the servers used trainer1's lr 0 for it)."""
    name = job(f"lr-async-own-{'table' if table else 'psmodel'}")
    flags = str(tmp_path / "flag")
    got = world.run({f"trainer{t}": (r.async_own_settings, name, t, flags, table) for t in range(2)})
    assert got["trainer0"] > 1e-3, got


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_ps_optimizer_still_names_its_owner_in_its_errors(how):
    """A copy of a PSModel or table (copy.deepcopy, pickle) copies its ps_optimizer, which kept
    torch's state only: its checks then failed with AttributeError ('owner') instead of the
    ValueError naming the model."""
    import copy
    import pickle

    from remote_module.ps._optimizer import PSOptimizer

    opt = PSOptimizer([torch.zeros(2, requires_grad=True)], {"lr": 0.1, "momentum": 0.0}, "PSModel 'm'")
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # (patches opt.step, as an attached scheduler does)
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert twin.owner == "PSModel 'm'"
    twin.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="PSModel 'm''s ps_optimizer has lr=-1.0"):
        twin.settings()
    with pytest.raises(ValueError, match="PSModel 'm''s ps_optimizer has one param group"):
        twin.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_collections_ps_optimizer_groups_the_copied_tables_optimizers(how):
    """A copy of a collection (copy.deepcopy, pickle) copies its tables' ps_optimizers and the
    collection's group of them, which kept torch's state only: reading its param groups then
    raised AttributeError ('_members'). The copy's groups are the copied tables' own, and a
    scheduler on it drives those, not the original's; a copied PSOptimizer counts its
    unpushed steps from 0 (its warning works as the original's)."""
    import copy
    import pickle

    from remote_module.ps._optimizer import GroupedPSOptimizer, PSOptimizer

    tables = [PSOptimizer([torch.zeros(0, requires_grad=True)], {"lr": lr}, f"table {k!r}")
              for k, lr in enumerate((0.1, 0.2))]
    group = GroupedPSOptimizer(tables, "ShardedEmbeddingBagCollection")
    both = [*tables, group]
    *twins, twin = copy.deepcopy(both) if how == "deepcopy" else pickle.loads(pickle.dumps(both))
    assert twin.owner == "ShardedEmbeddingBagCollection"
    assert [g["lr"] for g in twin.param_groups] == [0.1, 0.2]
    assert all(g is t.param_groups[0] for g, t in zip(twin.param_groups, twins))
    scheduler = torch.optim.lr_scheduler.StepLR(twin, step_size=1, gamma=0.5)
    twin.step()
    scheduler.step()
    assert [t.param_groups[0]["lr"] for t in twins] == [0.05, 0.1]
    assert [t.param_groups[0]["lr"] for t in tables] == [0.1, 0.2]
    assert all(t._unpushed_steps == 0 for t in twins)


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("where", ["psmodel", "collection"])
def test_a_tables_setting_its_rows_cannot_take_raises_before_any_gradient_is_taken(world, mode, where):
    """A momentum on table b's ps_optimizer is a ValueError at the step; raised once table a
    (and a PSModel's dense part) had taken their gradients for the push, it lost them. Now
    every setting is checked first: with b's momentum back at 0, step() again trains as one
    clean step."""
    name = job(f"lr-bad-{mode}-{where}")
    got = world.run({"trainer0": (r.bad_table_setting, name, mode, where)})["trainer0"]
    error, values = got["bad"]
    assert error is not None and "table" in error and "momentum=0.5" in error, got["bad"][0]
    for key, want in got["clean"][1].items():
        torch.testing.assert_close(values[key], want, rtol=0, atol=0, msg=key)


def test_a_scheduler_on_a_collections_ps_optimizer_does_not_warn(world):
    # the collection's ps_optimizer is where its tables' lr is scheduled (embeddings.md): the
    # warning about a local optimizer's lr that does not reach the rows is not for it
    got = world.run({"trainer0": (r.collection_scheduled_warnings, job("lr-ebc-quiet"))})["trainer0"]
    assert not [w for w in got if "changed from" in w], got


def test_a_scheduler_on_a_local_optimizer_over_a_psmodels_parameters_warns(world):
    # a port that keeps its script's optimizer (facebookresearch/dlrm: SGD(model.parameters()) and
    # its LRPolicyScheduler) and calls model.step() too: the servers step with ps_optimizer's lr,
    # which the scheduler never changes, so the schedule is lost; say so, as a table does
    got = world.run({"trainer0": (r.local_optimizer, job("lr-local-opt"))})["trainer0"]
    assert got["moved"]
    lr_warnings = [w for w in got["warnings"] if "ps_optimizer" in w and "changed from" in w]
    assert len(lr_warnings) == 1, got["warnings"]
    assert lr_warnings[0].startswith("UserWarning") and "'lr-local-opt" in lr_warnings[0], lr_warnings


def test_ps_optimizer_step_without_model_step_warns_that_nothing_trains(world):
    # ``optimizer = model.ps_optimizer`` with the script's optimizer.step() kept and no
    # model.step(): nothing is pushed, so nothing trains; say so once
    got = world.run({"trainer0": (r.ps_optimizer_step_only, job("lr-ps-opt-only"))})["trainer0"]
    assert not got["moved"]
    mine = [w for w in got["warnings"] if "pushes nothing" in w]
    assert len(mine) == 1 and mine[0].startswith("UserWarning") and "model.step()" in mine[0], got["warnings"]


def local_cyclic(optimizer: str, kind: str, cycle_momentum: bool) -> dict:
    """:func:`r.cyclic_collection` on local torch: two sparse EmbeddingBags, one optimizer with
    a param group each."""
    bags = {k: torch.nn.EmbeddingBag(r.ROWS, r.DIM, mode="sum", sparse=True) for k in ("a", "b")}
    for bag in bags.values():
        with torch.no_grad():
            bag.weight.copy_(r.initial_rows())
    cls, kwargs = r.CYCLIC_OPTIMIZERS[optimizer]
    opt = cls([{"params": bags["a"].parameters()}, {"params": bags["b"].parameters()}], **kwargs)
    try:
        sched = r.cyclic_scheduler(kind, opt, cycle_momentum)
    except Exception as exc:  # noqa: BLE001
        return {"scheduler_error": (type(exc).__name__, str(exc))}
    settings = []
    for k in range(r.CYCLIC_STEPS):
        opt.zero_grad()
        r.cyclic_loss({name: bags[name](*args) for name, args in r.cyclic_batch(k).items()}, k).backward()
        settings.append(r.cyclic_groups(opt))
        opt.step()
        sched.step()
    return {"rows": {k: b.weight.detach() for k, b in bags.items()}, "settings": settings}


@pytest.mark.parametrize("cycle_momentum", [True, False], ids=["cycle_momentum", "no_momentum"])
@pytest.mark.parametrize("kind", ["onecycle", "cyclic"])
@pytest.mark.parametrize("optimizer", sorted(r.CYCLIC_OPTIMIZERS))
def test_cyclic_schedulers_on_a_collections_ps_optimizer_as_on_a_local_optimizer(world, optimizer, kind,
                                                                                  cycle_momentum):
    """OneCycleLR and CyclicLR read ``optimizer.defaults`` (momentum or betas, to cycle), which
    a collection's ps_optimizer had empty: they refused it, for SGD and SparseAdam alike. Now
    its defaults are the tables' common ones: each scheduler takes or refuses it as it takes or
    refuses the same local optimizer (Adagrad, with no momentum to cycle, the same ValueError),
    and trains the same rows. Where local torch steps SGD with the momentum the scheduler
    cycles, the tables' row-wise SGD, which has none, refuses the step, naming it."""
    name = job(f"lr-cyc-{optimizer}-{kind}-{int(cycle_momentum)}")
    got = world.run({"trainer0": (r.cyclic_collection, name, optimizer, kind, cycle_momentum)})["trainer0"]
    want = local_cyclic(optimizer, kind, cycle_momentum)
    if "scheduler_error" in want:
        assert optimizer == "adagrad" and cycle_momentum  # (what local torch refuses)
        assert got.get("scheduler_error") == want["scheduler_error"], got
        return
    assert "scheduler_error" not in got, got
    if optimizer == "sgd" and cycle_momentum:
        error, message = got["step_error"]
        assert error == "ValueError" and "momentum=" in message and "cycle_momentum=False" in message, got
        assert got["settings"] == want["settings"][:1]  # the scheduler set the first step's as locally
        return
    assert got["settings"] == want["settings"]
    for k in ("a", "b"):
        # (the servers' row-wise steps round as torch's sparse ones but for the order of a sum)
        torch.testing.assert_close(got["rows"][k], want["rows"][k], rtol=1e-5, atol=1e-6, msg=k)


def local_skipping_a_step(where: str) -> dict:
    """:func:`r.refused_step` as one process on the global batch that skips the optimizer step
    of batch ``REFUSED_AT`` for the tables (zero_grad instead; a PSModel's Linear steps)."""
    torch.manual_seed(0)
    names = ("a", "b") if where == "collection" else ("a",)
    bags = {k: torch.nn.EmbeddingBag(r.ROWS, r.DIM, mode="sum", sparse=True) for k in names}
    for bag in bags.values():
        with torch.no_grad():
            bag.weight.copy_(r.initial_rows())
    torch.manual_seed(1)
    lin = torch.nn.Linear(r.DIM, r.DIM) if where == "psmodel" else None
    tables_opt = torch.optim.SGD([{"params": b.parameters()} for b in bags.values()], lr=r.REFUSED_LR)
    dense_opt = torch.optim.SGD(lin.parameters(), lr=0.1) if lin is not None else None
    for k in range(r.REFUSED_STEPS):
        tables_opt.zero_grad()
        if dense_opt is not None:
            dense_opt.zero_grad()
        loss = 0
        for t in range(2):  # each trainer's mean loss, averaged
            ids, offsets, target = r.bag_batch(t, k)
            if where == "collection":
                part = ((bags["a"](ids, offsets) - target) ** 2 + (bags["b"](ids.flip(0), offsets) + target) ** 2)
            elif where == "psmodel":
                part = (lin(bags["a"](ids, offsets)) - target) ** 2
            else:
                part = (bags["a"](ids, offsets) - target) ** 2
            loss = loss + part.mean() / 2
        loss.backward()
        if k != r.REFUSED_AT:
            tables_opt.step()
        if dense_opt is not None:
            dense_opt.step()
    values = {k: b.weight.detach() for k, b in bags.items()}
    if lin is not None:
        values.update({f"lin.{k}": v.detach() for k, v in lin.state_dict().items()})
    return values


@pytest.mark.parametrize("where", ["table", "collection", "psmodel"])
def test_a_refused_sync_step_is_told_to_every_trainer_and_training_goes_on_without_it(world, where):
    """Sync tables whose trainers' lrs disagree for one step (as ReduceLROnPlateau on each
    trainer's own loss makes them): the servers refuse that step. Before, trainer0 got the
    ValueError at its next forward, trainer1's retry "succeeded", and every later call of both
    timed out waiting for trainer0. Now each trainer gets the ValueError naming the lr and
    both values at its next lookup (once), the step's pushes are dropped, and training goes on
    as one process on the global batch that skipped that step."""
    name = job(f"lr-refused-{where}")
    got = world.run({f"trainer{t}": (r.refused_step, name, t, where) for t in range(2)})
    for t in ("trainer0", "trainer1"):
        assert "fatal" not in got[t], got[t]
        errors = got[t]["errors"]
        assert [k for k, _ in errors] == [r.REFUSED_AT + 1], (t, errors)
        message = errors[0][1]
        assert "'lr' differ" in message and "trainer0: 0.5" in message and "trainer1: 0.25" in message, message
        if where == "collection":  # (one error names both tables' refused steps)
            assert f"'{name}-a'" in message and f"'{name}-b'" in message, message
    want = local_skipping_a_step(where)
    for t in ("trainer0", "trainer1"):
        for key, value in want.items():
            torch.testing.assert_close(got[t]["values"][key], value, rtol=1e-5, atol=1e-6, msg=f"{t} {key}")


@pytest.mark.parametrize("how", ["state_dict", "optimizer_state_dict", "collection"])
def test_a_refused_last_sync_step_is_told_at_the_jobs_checkpoint(world, how):
    """A job whose last sync step the servers refuse ends with a checkpoint, with no lookup
    after it: each trainer gets the ValueError naming the lr and both values there (once), and
    the rows are those before the refused step. Before, the checkpoint returned as if the step
    had been applied, and silently lacked it."""
    name = job(f"lr-last-refused-{how}")
    got = world.run({f"trainer{t}": (r.last_step_refused, name, t, how) for t in range(2)})
    for t in ("trainer0", "trainer1"):
        raised = got[t]["raised"]
        assert len(raised) == 1, (t, raised)
        assert "'lr' differ" in raised[0] and "trainer0: 0.5" in raised[0] and "trainer1: 0.25" in raised[0], raised
        assert torch.equal(got[t]["after"], got[t]["before"]), t
