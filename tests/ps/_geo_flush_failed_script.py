"""Run by tests/ps/test_dense_faults.py in a process of its own (one trainer, two servers): a
geo job whose push at a ``geo_push_every`` boundary fails on one server (its first delta push
there raises). That server's blocks keep their deltas (documented), so ``flush()`` after the
last step must push them: then the servers hold what one local process trained. A second job
whose boundary push failed the same way and that is never flushed must be warned of as the
process ends."""

from __future__ import annotations

import sys

import torch
from torch import nn

EVERY, LR = 3, 0.05
FAILING = ("geo-flush-failed", "geo-flush-failed-left")


def body() -> dict | None:
    from remote_module.ps import PSModel
    from remote_module.ps.dense import _server as _dense_server
    from rpc_backend import current_worker

    me = current_worker()
    if me.role != "trainer":
        if me.name == me.workers("ps")[0]:  # each failing job's first delta push here raises
            original, failed = _dense_server._push_delta, set()

            def push_delta(name: str, deltas: object, packed: bool = False) -> object:
                if name in FAILING and name not in failed:
                    failed.add(name)
                    raise RuntimeError(f"refused the delta push of {name!r}")
                return original(name, deltas, packed)

            _dense_server._push_delta = push_delta
        return None
    servers = me.workers("ps")
    opt = (torch.optim.SGD, {"lr": LR})
    xs = [torch.randn(4, 4, generator=torch.Generator().manual_seed(i)) for i in range(EVERY + 1)]
    out = {}
    for name in FAILING:
        torch.manual_seed(0)
        model = PSModel(nn.Linear(4, 2), servers, name=name, num_trainers=1, ps_mode="geo", geo_push_every=EVERY,
                        optimizer=opt, min_block_size=2)
        local = nn.Linear(4, 2)
        local.load_state_dict(model.module.state_dict())
        local_opt = torch.optim.SGD(local.parameters(), lr=LR)
        raised = None
        for x in xs[:EVERY]:
            (model(x) ** 2).mean().backward()
            try:
                model.step()
            except RuntimeError as exc:
                raised = str(exc)
            local_opt.zero_grad()
            (local(x) ** 2).mean().backward()
            local_opt.step()
        out[name] = {"raised": raised is not None and "refused the delta push" in raised}
        if name == "geo-flush-failed":
            model.flush()
            values, ref = model._server_values(), dict(local.named_parameters())
            out[name]["after"] = max(
                float((values[b.name].reshape(-1) - model._block_values(b, ref[b.pname].detach()).reshape(-1))
                      .abs().max()) for b in model._slots)
        globals()[name] = model  # alive as the process ends
    return out


if __name__ == "__main__":
    from rpc_backend import run_local
    from tests._deadlines import SETUP_S

    got = run_local(body, 3, roles={"ps": 2, "trainer": 1}, rpc_timeout=SETUP_S)[2]
    print("geo-flush-failed", got)
    sys.stdout.flush()
