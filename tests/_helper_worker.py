"""A helper rank of the test world: it joins RPC and serves until the driver shuts down.

Deliberately imports nothing but torch, so every test that creates a module on a helper
proves the host needs only the package installed (it is imported on first use by RPC).

    python -m tests._helper_worker NAME RANK WORLD_SIZE INIT_METHOD RPC_TIMEOUT PARENT_PID [CALL_TIMEOUT]

RPC_TIMEOUT is the options' ``rpc_timeout`` while the world starts (the rendezvous), CALL_TIMEOUT
the default deadline of calls made without one afterwards (RPC_TIMEOUT when not given).
"""

import os
import sys
import threading
import time

from tests._transport import world_options


def _exit_when_orphaned(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.5)


def main(argv: list[str]) -> None:
    name, rank, world_size, init_method, rpc_timeout, parent_pid, *call_timeout = argv
    threading.Thread(target=_exit_when_orphaned, args=(int(parent_pid),), daemon=True).start()
    import torch.distributed.rpc as rpc

    options = world_options(
        init_method=init_method, rpc_timeout=float(rpc_timeout), num_worker_threads=16
    )
    rpc.init_rpc(name, rank=int(rank), world_size=int(world_size), rpc_backend_options=options)
    if call_timeout:
        rpc._set_rpc_timeout(float(call_timeout[0]))
    rpc.shutdown()  # graceful: blocks, serving requests, until every rank has called it


if __name__ == "__main__":
    main(sys.argv[1:])
