"""Small dedicated worlds for tests that kill workers or leave them hanging: each rank runs
module ``MODULE`` as ``__main__`` with ``sys.argv[1:] == [ROLE, INIT_METHOD, *ARGS]`` (as
``python -m MODULE ROLE INIT_METHOD [ARGS...]`` would), rank 0 prints one ``REPORT <json>``
line, and every process is reaped afterwards.

The ranks are forked from a forkserver started for the world with torch preloaded
(tests/_forkserver.py): one ``import torch`` per world instead of one per rank. They are
processes of their own (SIGSTOP and SIGKILL by pid work as on spawned ones), get the
environment given here explicitly, and reseed torch before running the module, as a new
interpreter has a seed of its own."""

import json
import os
import runpy
import sys
import tempfile
from pathlib import Path

from rpc_backend.loopback import fresh_file_rendezvous, loopback_env
from tests._deadlines import HANG_S, SETUP_S
from tests._forkserver import fork_context
from tests._transport import world_options

ROOT = Path(__file__).resolve().parents[2]


def _run_module(module: str, argv: list[str], env: dict, stdout_path: str | None) -> None:
    """A rank: ``env``, stdout to ``stdout_path`` (or nowhere), stderr nowhere, a seed of its
    own, then ``module`` as ``__main__``."""
    import torch

    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout_path or os.devnull), (2, os.devnull)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    torch.default_generator.seed()
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def run_report(module: str, roles: list[str], timeout: float = HANG_S, args: tuple[str, ...] = ()) -> dict:
    """Start one process per role (``args`` go to every one); return rank 0's report. Kills
    the rest when it is done.

    ``timeout`` is a hang guard (tests/_deadlines.py), on top of SETUP_S for starting the world:
    rank 0 must be done within ``SETUP_S + timeout`` seconds, or the test fails."""
    init_method, path = fresh_file_rendezvous()
    env = {**os.environ, **loopback_env(), "PYTHONPATH": str(ROOT)}
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.out")
        try:
            with fork_context() as ctx:
                for rank, role in enumerate(roles):
                    procs.append(ctx.Process(target=_run_module, args=(
                        module, [role, init_method, *args], env, out_path if rank == 0 else None)))
                    procs[-1].start()
                procs[0].join(SETUP_S + timeout)
                finished = procs[0].exitcode is not None
                for p in procs:
                    if p.is_alive():
                        p.kill()
                    p.join()
        finally:
            if os.path.exists(path):
                os.unlink(path)
        out = open(out_path).read() if os.path.exists(out_path) else ""
    assert finished, f"hang guard: {module}'s rank 0 did not finish within {SETUP_S + timeout:g} s:\n{out[-3000:]}"
    line = next((line for line in out.splitlines() if line.startswith("REPORT ")), None)
    assert line is not None, f"{module} printed no report:\n{out[-3000:]}"
    return json.loads(line[len("REPORT "):])


def join(role: str, init_method: str, roles: tuple[str, ...] | list[str], num_worker_threads: int = 8) -> None:
    """``rpc.init_rpc`` as ``role`` of the world ``roles``: SETUP_S for the rendezvous (torch
    uses the options' ``rpc_timeout`` there), then HANG_S as the default deadline of calls
    made without one (every call whose failure a test expects gives its own timeout)."""
    import torch.distributed.rpc as rpc

    options = world_options(init_method=init_method, rpc_timeout=SETUP_S, num_worker_threads=num_worker_threads)
    rpc.init_rpc(role, rank=list(roles).index(role), world_size=len(roles), rpc_backend_options=options)
    rpc._set_rpc_timeout(HANG_S)


def join_and_serve(role: str, init_method: str, roles: tuple[str, ...] | list[str], caller) -> None:
    """A rank's body in such a world: join RPC as ``role``; the ``caller`` role runs ``caller()``
    (which prints the report); every rank then shuts down gracefully, the others serving."""
    import torch.distributed.rpc as rpc

    join(role, init_method, roles)
    if role == "caller":
        caller()
    rpc.shutdown()
