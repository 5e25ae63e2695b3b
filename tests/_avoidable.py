"""What torch prints that the project keeps off the console (see rpc_backend/_quiet.py), for
the tests that run scripts and jobs as a user would."""

#: gloo's per-rank "You are using a Backend ... as a ProcessGroup" and TorchScript's functional
#: optimizer deprecation (DistributedOptimizer)
AVOIDABLE = ("functional optimizers is deprecated", "You are using a Backend")


def no_avoidable_warnings(stderr: str) -> None:
    """Assert that none of :data:`AVOIDABLE` is in ``stderr``."""
    for text in AVOIDABLE:
        assert text not in stderr, stderr[-3000:]
