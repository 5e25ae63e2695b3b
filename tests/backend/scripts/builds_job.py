"""A two-rank job whose ranks may run different builds of the packages (run by
tests/backend/test_builds.py, each rank with its own ``PYTHONPATH``: the checkout, or a copy of
it in a temporary directory, changed or not).

Under torchrun (one ``torchrun --nnodes=2 --node-rank=R`` per rank, so each has its own
environment), every rank joins with ``init_from_env`` and says so (with
``BUILDS_JOB_DIE_IN_CHECK=R``, rank R dies as the comparison of the builds begins)::

    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=0 --master-addr=127.0.0.1 --master-port=PORT \\
        tests/backend/scripts/builds_job.py

With plain ``rpc.init_rpc`` (``builds_job.py plain RANK INIT_METHOD``): worker1 imports nothing
of remote_module and only serves; worker0 creates a RemoteModule on worker1 and calls it, and
prints the ``BuildMismatch`` it gets instead, if any.
"""

import os
import sys

import torch
import torch.distributed.rpc as rpc

import rpc_backend
import rpc_backend.connect as connect


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def torchrun_rank() -> None:
    import remote_module
    from rpc_backend._torch_private import is_rpc_initialized

    if os.environ.get("BUILDS_JOB_DIE_IN_CHECK") == os.environ["RANK"]:  # dies as the comparison begins
        connect.check_world_builds = lambda *args, **kwargs: os._exit(3)
    try:
        me = rpc_backend.init_from_env()
    except BaseException as exc:
        say(f"rank {os.environ['RANK']}: {type(exc).__name__}; RPC still initialized: {is_rpc_initialized()}")
        raise
    with me:
        say(f"rank {me.rank}: joined, remote_module {remote_module.__version__} from {remote_module.__file__}")


def plain_rank(rank: int, init_method: str) -> None:
    options = rpc_backend.make_options(init_method=init_method, rpc_timeout=600)  # SETUP_S (tests/_deadlines.py)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        from remote_module import RemoteModule

        try:
            linear = RemoteModule("worker1/cpu", torch.nn.Linear, (2, 3))
            say(f"worker0: called worker1, got {tuple(linear(torch.ones(1, 2)).shape)}")
        except rpc_backend.BuildMismatch as exc:
            say(f"worker0: BuildMismatch: {exc}")
    rpc.shutdown()


if __name__ == "__main__":
    if sys.argv[1:2] == ["plain"]:
        plain_rank(int(sys.argv[2]), sys.argv[3])
    else:
        torchrun_rank()
