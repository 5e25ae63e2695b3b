"""Small dedicated worlds of plain subprocesses, for tests that kill workers or leave them
hanging: each rank runs ``python -m MODULE ROLE INIT_METHOD [ARGS...]``, rank 0 prints one
``REPORT <json>`` line, and every process is reaped afterwards."""

import json
import os
import subprocess
import sys
from pathlib import Path

from rpc_backend.loopback import fresh_file_rendezvous, loopback_env
from tests._transport import world_options

ROOT = Path(__file__).resolve().parents[2]


def run_report(module: str, roles: list[str], timeout: float, args: tuple[str, ...] = ()) -> dict:
    """Start one process per role (``args`` go to every one); return rank 0's report. Kills
    the rest when it is done."""
    init_method, path = fresh_file_rendezvous()
    env = {**os.environ, **loopback_env(), "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, role, init_method, *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        for role in roles
    ]
    try:
        out, _ = procs[0].communicate(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if os.path.exists(path):
            os.unlink(path)
    line = next((line for line in out.splitlines() if line.startswith("REPORT ")), None)
    assert line is not None, f"{module} printed no report:\n{out[-3000:]}"
    return json.loads(line[len("REPORT "):])


def join_and_serve(role: str, init_method: str, roles: tuple[str, ...] | list[str], caller) -> None:
    """A rank's body in such a world: join RPC as ``role``; the ``caller`` role runs ``caller()``
    (which prints the report); every rank then shuts down gracefully, the others serving."""
    import torch.distributed.rpc as rpc

    options = world_options(init_method=init_method, rpc_timeout=20, num_worker_threads=8)
    rpc.init_rpc(role, rank=roles.index(role), world_size=len(roles), rpc_backend_options=options)
    if role == "caller":
        caller()
    rpc.shutdown()
