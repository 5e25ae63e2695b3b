"""A torchrun-style job (RPC plus DDP among trainers) runs unchanged under run_local."""

import pytest
import torch

from rpc_backend import run_local
from tests._deadlines import SETUP_S
from tests.backend import _ranks_remote, _sockets


@pytest.mark.slow
def test_trainers_form_a_role_group_under_run_local():
    ps, t0, t1 = run_local(_ranks_remote.trainers_in_a_role_group, 3, roles={"ps": 1, "trainer": 2},
                           timeout=SETUP_S, rpc_timeout=SETUP_S)
    assert ps is None
    assert (t0["group"], t1["group"]) == ((0, 2), (1, 2))  # rank = role rank, size = role size
    assert t0["all_reduce"] == t1["all_reduce"] == 3.0
    assert (t0["from_ps"], t1["from_ps"]) == (0, 10)
    # DDP kept the two replicas identical after a step on different data
    assert t0["params"] == t1["params"]
    assert len(t0["params"]) == 2 and torch.tensor(t0["params"][0]).shape == (2, 4)
    # the store the launcher hosts, like everything the ranks open, is on loopback only
    host, port = t0["master"]
    assert host == "127.0.0.1"
    assert f"127.0.0.1:{port}" in t0["launcher_listening"]
    for addresses in (t0["launcher_listening"], t0["listening"], t1["listening"]):
        assert [a for a in addresses if not _sockets.is_loopback(a)] == [], addresses
