"""What tests/ps/test_checkpointer.py runs in a process of its own: the first of two trainers
(``trainer0``, alone in a one-rank RPC world) saves a checkpoint that the second never adds its
file to; ``close()`` fails within the timeout naming ``trainer1``. Without ``trainers=`` in
such a world (not formed by rpc_backend) the Checkpointer is refused.

    python -m tests.ps._checkpointer_script DIR
"""

from __future__ import annotations

import os
import sys

import torch.distributed.rpc as rpc
from torch import nn

from remote_module.ps import Checkpointer
from rpc_backend import fresh_file_rendezvous, loopback_env


def main(path: str) -> None:
    os.environ.update(loopback_env())
    init_method, rendezvous = fresh_file_rendezvous()
    rpc.init_rpc("trainer0", rank=0, world_size=1,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=init_method))
    try:
        try:  # an RPC world rpc_backend did not form: which workers train is not known
            Checkpointer(path, every_steps=1)
        except ValueError as e:
            print(f"ValueError: {e}", flush=True)
        ckpt = Checkpointer(path, every_steps=1, local={"model": nn.Linear(2, 1)}, trainers=["trainer0", "trainer1"],
                            timeout=0.5)
        assert ckpt.resume() == 0
        ckpt.step()
        try:
            ckpt.close()
        except TimeoutError as e:
            print(f"TimeoutError: {e}", flush=True)
    finally:
        rpc.shutdown()
        os.unlink(rendezvous)


if __name__ == "__main__":
    main(sys.argv[1])
