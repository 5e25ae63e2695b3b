"""Two ranks; rank 1 never calls shutdown (run by tests/backend/test_worlds.py): it sleeps until
the test kills it, once rank 0 has reported.

    python -m tests.backend._shutdown_world RANK INIT_METHOD
"""

import json
import os
import sys
import time


def main(rank: str, init_method: str) -> None:
    import torch.distributed.rpc as rpc

    from rpc_backend import make_options, shutdown_rpc
    from tests._deadlines import HANG_S, SETUP_S

    rpc.init_rpc(f"w{rank}", rank=int(rank), world_size=2,
                 rpc_backend_options=make_options(init_method=init_method, rpc_timeout=SETUP_S))
    if rank == "1":
        time.sleep(SETUP_S + HANG_S)  # the test is over by then (and kills this rank first)
        os._exit(0)
    start = time.monotonic()
    try:
        shutdown_rpc(graceful=True, timeout=2.0)
        outcome = "returned"
    except RuntimeError as exc:
        outcome = str(exc)
    print("REPORT " + json.dumps({"seconds": time.monotonic() - start, "outcome": outcome}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
