import pytest
import torch

from remote_module._core.device import parse_remote_device

VALID = [
    ("worker1/cpu", "worker1", None, "cpu"),
    ("worker1", "worker1", None, "cpu"),
    ("trainer0/cuda:0", "trainer0", None, "cuda:0"),
    ("rank:1/cpu", None, 1, "cpu"),
    ("rank:12", None, 12, "cpu"),
    ("ps_0/meta", "ps_0", None, "meta"),
]


@pytest.mark.parametrize("text,name,rank,device", VALID)
def test_valid(text, name, rank, device):
    parsed = parse_remote_device(text)
    assert parsed.worker_name == name
    assert parsed.rank == rank
    assert parsed.device == torch.device(device)
    assert parsed.worker == (name if name is not None else rank)


@pytest.mark.parametrize(
    "text",
    ["", "/", "worker1/", "/cpu", "a/b/c", "rank:x/cpu", "rank:/cpu", "foo:1/cpu", "cpu", "cuda:0",
     " worker1/cpu", "work er/cpu", "worker1/cpu/"],
)
def test_unparsable(text):
    with pytest.raises(ValueError) as info:
        parse_remote_device(text)
    assert str(info.value) == f"Could not parse remote_device: {text}. The valid format is '<workername>/<device>'"


def test_bad_device_is_torchs_own_error():
    with pytest.raises(RuntimeError) as ours:
        parse_remote_device("worker1/cdua:0")
    with pytest.raises(RuntimeError) as torchs:
        torch.device("cdua:0")
    assert str(ours.value) == str(torchs.value)


@pytest.mark.parametrize("value", [None, 1, ("worker1", "cpu"), b"worker1/cpu"])
def test_not_a_string(value):
    with pytest.raises(TypeError, match="remote_device must be a str"):
        parse_remote_device(value)
