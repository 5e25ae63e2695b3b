"""remote_module._core.tensor_records: small CPU tensors that travel inside a pickle arrive
as they were sent (values, dtype, shape, strides, requires_grad), and only those inline."""

import pickle

import pytest
import torch

from remote_module._core import inline_small
from remote_module._core.tensor_records import INLINE_MAX_BYTES, InlineTensor


def round_trip(t):
    sent = inline_small(t)
    assert isinstance(sent, InlineTensor)
    data = pickle.dumps(sent)
    assert b"torch._utils" not in data  # a record, not torch's own tensor pickling
    return pickle.loads(data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool,
                                   torch.complex64, torch.uint8])
def test_values_dtype_and_shape_arrive_as_sent(dtype):
    t = (torch.randn(4, 16) * 10).to(dtype)
    got = round_trip(t)
    assert got.dtype == t.dtype and got.shape == t.shape and got.stride() == t.stride()
    assert torch.equal(got, t)
    assert got.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()  # a copy, owned


def test_requires_grad_strides_and_small_views_are_kept():
    w = torch.randn(3, 5, requires_grad=True)
    got = round_trip(w)
    assert got.requires_grad and got.is_leaf and torch.equal(got.detach(), w.detach())
    t = torch.randn(5, 3).t()  # a transpose: strides (1, 3)
    assert round_trip(t).stride() == t.stride() and torch.equal(round_trip(t), t)
    base = torch.arange(12.0)
    view = base[2:6]  # a small storage travels whole, as torch RPC sends it
    got = round_trip(view)
    assert torch.equal(got, view) and got.storage_offset() == 2 and got.untyped_storage().nbytes() == 48
    empty = torch.empty(0, 4)
    assert round_trip(empty).shape == (0, 4)


def test_a_view_of_a_large_storage_travels_compact():
    big = torch.arange(4096.0)  # 16 KB
    got = round_trip(big[:16])
    assert torch.equal(got, big[:16]) and got.untyped_storage().nbytes() == 64


def test_what_cannot_be_a_record_is_returned_unchanged():
    for t in (torch.zeros(INLINE_MAX_BYTES // 4 + 1), torch.nn.Parameter(torch.ones(2)),
              torch.ones(3, 3).to_sparse(), torch.tensor([1 + 2j]).conj()):
        assert inline_small(t) is t
