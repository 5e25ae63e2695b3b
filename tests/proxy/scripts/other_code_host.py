"""The host of the different-code case (tests/proxy/test_same_script.py): its __main__ has the same
names as tests/proxy/scripts/same_script_job.py with other code, so the caller's objects must
arrive as copies:

    python tests/proxy/scripts/other_code_host.py INIT_METHOD
"""

import collections
import dataclasses
import os
import sys
import threading

import torch
import torch.distributed.rpc as rpc
from torch import nn

from rpc_backend import loopback_env, make_options
from tests._deadlines import SETUP_S

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Config:
    scale: float = -1.0


class Net(nn.Module):
    instances = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -x


_LOCK = threading.Lock()


def shared_counter() -> nn.Module:
    with _LOCK:
        return nn.Identity()


if __name__ == "__main__":
    os.environ.update(loopback_env())
    options = make_options(init_method=sys.argv[1], worker_names=["worker0", "worker1"], rpc_timeout=SETUP_S)
    rpc.init_rpc("worker1", rank=1, world_size=2, rpc_backend_options=options)
    rpc.shutdown()
