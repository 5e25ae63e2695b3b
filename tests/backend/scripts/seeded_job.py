"""A user's script that seeds torch at module level and runs ranks with rpc_backend.run_local
(run by tests/backend/test_launcher.py). Each rank re-imports the script as ``__mp_main__``, so
with either start method every rank starts from that seed; a script that does not seed gets a
different seed in every rank.

    python tests/backend/scripts/seeded_job.py SEED|none
"""

import json
import sys

import torch

from rpc_backend import run_local

if sys.argv[1:] != ["none"]:
    torch.manual_seed(int(sys.argv[1]))


def draw() -> list:
    return [torch.initial_seed(), torch.randint(0, 10**9, (2,)).tolist()]


if __name__ == "__main__":
    print("RESULT " + json.dumps({m: run_local(draw, 3, timeout=120, start_method=m) for m in ("forkserver", "spawn")}))
