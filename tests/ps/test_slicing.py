"""The parameter-server slicing rule and dispatchers, without RPC (hypothesis properties plus
the transpiler's worked cases)."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_module.ps import Block, HashName, RoundRobin, slice_blocks
from remote_module.ps._placement import block_name

_SETTINGS = settings(max_examples=60, derandomize=True, database=None, deadline=None)

shapes = st.lists(st.integers(0, 300), min_size=1, max_size=4)


@_SETTINGS
@given(shape=shapes, servers=st.integers(1, 6), min_block=st.integers(1, 5000))
def test_blocks_cover_every_element_once_in_order(shape, servers, min_block):
    numel = math.prod(shape)
    blocks = slice_blocks(shape, servers, min_block)
    assert [b.index for b in blocks] == list(range(len(blocks)))
    offset = 0
    for b in blocks:
        assert b.offset == offset
        offset += b.size
    assert offset == numel
    assert 1 <= len(blocks) <= max(1, servers)
    if numel:
        assert all(b.size > 0 for b in blocks)
        assert len({b.size for b in blocks[:-1]}) <= 1 and blocks[-1].size <= blocks[0].size


@_SETTINGS
@given(shape=st.lists(st.integers(1, 300), min_size=2, max_size=4), servers=st.integers(1, 6),
       min_block=st.integers(1, 5000))
def test_blocks_of_matrices_are_whole_rows(shape, servers, min_block):
    row = math.prod(shape[1:])
    for b in slice_blocks(shape, servers, min_block):
        assert b.offset % row == 0 and b.size % row == 0


@_SETTINGS
@given(shape=shapes, servers=st.integers(1, 6), min_block=st.integers(1, 5000))
def test_the_rule_as_written(shape, servers, min_block):
    numel = math.prod(shape)
    if numel == 0:
        return
    split = min(servers, max(1, numel // min_block))
    block = math.ceil(numel / split)
    if len(shape) >= 2:
        row = math.prod(shape[1:])
        block = math.ceil(block / row) * row
    split = math.ceil(numel / block)
    sizes = [b.size for b in slice_blocks(shape, servers, min_block)]
    assert sizes == [block] * (split - 1) + [numel - block * (split - 1)]


def test_worked_cases():
    assert [b.size for b in slice_blocks((10000, 8), 3, 8192)] == [26672, 26672, 26656]
    assert slice_blocks((100,), 3) == [Block(0, 0, 100)]
    assert slice_blocks((10000, 8), 3, slice_var_up=False) == [Block(0, 0, 80000)]
    assert [b.size for b in slice_blocks((8192 * 2,), 5)] == [8192, 8192]  # capped by min_block_size


@pytest.mark.parametrize("bad,error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_arguments_name_the_value(bad, error):
    # as torch's sizes: a float or a bool is a TypeError, an int out of range a ValueError
    with pytest.raises(error, match="num_servers"):
        slice_blocks((4, 4), bad)
    with pytest.raises(error, match="min_block_size"):
        slice_blocks((4, 4), 2, bad)


def test_sizes_take_any_integer_operator_index_takes():
    np = pytest.importorskip("numpy")
    assert slice_blocks((4, 4), np.int64(2), np.int32(8)) == slice_blocks((4, 4), 2, 8)


def test_dispatchers():
    names = [block_name("w", 0), block_name("w", 1), block_name("b", 0)]
    assert names == ["w.block0", "w.block1", "b.block0"]
    assert RoundRobin()(names, ["ps0", "ps1"]) == ["ps0", "ps1", "ps0"]
    servers = ["ps0", "ps1", "ps2"]
    assert HashName()(names, servers) == [servers[zlib.crc32(n.encode()) % 3] for n in names]
    with pytest.raises(ValueError, match="at least one server"):
        RoundRobin()(names, [])


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "channels_last"])
@pytest.mark.parametrize("servers, min_block", [(1, 8192), (2, 4), (3, 4)])
def test_a_block_of_any_strides_is_a_view_with_the_blocks_row_major_elements(layout, servers, min_block):
    """block_of: the blocks' elements (row-major, whatever the strides) concatenate to the
    tensor's, and writing into a block writes the tensor (no ``view(-1)``, which a
    non-contiguous parameter does not have)."""
    import torch

    from remote_module.ps._placement import block_of

    t = {"contiguous": lambda: torch.arange(120.0).reshape(6, 20),
         "transposed": lambda: torch.arange(120.0).reshape(20, 6).t(),
         "channels_last": lambda: torch.arange(120.0).reshape(2, 3, 4, 5).to(memory_format=torch.channels_last),
         }[layout]()
    blocks = slice_blocks(t.shape, servers, min_block)
    assert torch.equal(torch.cat([block_of(t, b).reshape(-1) for b in blocks]), t.reshape(-1))
    for b in blocks:
        block_of(t, b).fill_(-1.0 - b.index)
    assert torch.equal(t.reshape(-1), torch.cat([torch.full((b.size,), -1.0 - b.index) for b in blocks]))
    for b in slice_blocks((7,), 2, 3):  # 1-D: runs of elements
        assert block_of(torch.arange(7), b).tolist() == list(range(b.offset, b.offset + b.size))
    assert block_of(torch.tensor(3.0), Block(0, 0, 1)).item() == 3.0  # 0-dim: itself


def test_arguments_of_the_wrong_type_are_refused_with_type_error():
    # each was taken before: 'yes' sliced as True, 'rr' failed with "'str' object is not
    # callable", and a name of 5 raised ValueError
    from remote_module.ps._options import TrainingOptions
    from remote_module.ps._placement import place

    with pytest.raises(TypeError, match="slice_var_up must be True .* got 'yes'"):
        slice_blocks((100, 4), 2, slice_var_up="yes")
    with pytest.raises(TypeError, match="split_method must be a dispatcher.*got 'rr'"):
        place("rr", ["w.0"], ["ps0"])
    with pytest.raises(TypeError, match="name must be a non-empty str naming the table, got 5"):
        TrainingOptions(5, "async", 1, (torch.optim.SGD, {"lr": 0.1}), None, 1, 1, 0.1)
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        TrainingOptions("", "async", 1, (torch.optim.SGD, {"lr": 0.1}), None, 1, 1, 0.1)
