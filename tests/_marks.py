"""pytest marks shared by test files (caller side only: hosts never import this)."""

import pytest

#: For files whose tests run remote forwards with grad enabled outside a dist_autograd context
#: to check results or call mechanics, not to train: the UserWarning that this trains nothing
#: remote (remote_module/_core/untrained.py) is right there, once per object, and is itself tested in
#: tests/core/test_untrained_warning.py. Per file, so that no other test's filters change.
GRAD_ON_WITHOUT_CONTEXT = pytest.mark.filterwarnings(
    "ignore:.*outside a torch.distributed.autograd context:UserWarning"
)
