"""A proxy used after a graceful rpc.shutdown() says which call to make (the differences table
in tutorials/remote-module.md: "API used before init_rpc / after shutdown"), also on the
agent's default timeout."""

import pytest

from rpc_backend import run_local
from tests._deadlines import SETUP_S
from tests.proxy import _after_shutdown_remote


@pytest.mark.slow
def test_a_proxy_on_the_agent_default_timeout_used_after_shutdown_says_what_to_do():
    # the agent's default (rpc_timeout) is a set-up guard here: the proxy's one call must not time out
    found = run_local(_after_shutdown_remote.use_after_shutdown, 2, rpc_timeout=SETUP_S, timeout=SETUP_S)[0]
    assert len(found) == 3
    for kind, message in found:
        assert kind == "RuntimeError", (kind, message)
        assert "call rpc.init_rpc" in message, message  # not torch's "Current RPC agent is not set!"


@pytest.mark.slow
def test_a_forward_after_shutdown_does_not_warn_of_training_outside_dist_autograd():
    found = run_local(_after_shutdown_remote.warnings_after_shutdown, 2, rpc_timeout=SETUP_S, timeout=SETUP_S)[0]
    assert found == [("RuntimeError", []), ("RuntimeError", [])], found
