"""A user's script that seeds torch at its top level, then starts a local world (run by
tests/backend/test_launcher.py). Each rank runs the top level itself (as ``__mp_main__``), so
each draws exactly the seeded stream: the first draw after ``torch.manual_seed(SEED)``.

    python tests/backend/scripts/seeded_job.py
"""

import torch

from rpc_backend import run_local

SEED = 2024
torch.manual_seed(SEED)


def first_draws() -> dict:
    return {"initial_seed": torch.initial_seed(), "randn": torch.randn(6).tolist()}


if __name__ == "__main__":
    want = first_draws()  # here, right after the top level's seeding
    got = run_local(first_draws, 2, timeout=600, rpc_timeout=600)  # SETUP_S (tests/_deadlines.py)
    print("SEEDED", want["initial_seed"] == SEED and got == [want, want], flush=True)
    if got != [want, want]:
        print("WANT", want, "GOT", got, flush=True)
