"""rpc_backend.traffic.Traffic: the payload bytes of a process's calls, each way, per peer
(against the shared RPC world: worker0 is this process)."""

import torch
import torch.distributed.rpc as rpc

from rpc_backend import watch
from rpc_backend.traffic import Traffic, payload_bytes, payload_parts, tensor_wire_bytes
from tests._deadlines import HANG_S

#: a payload's pickle (function reference, tuples, tensor ids) is well under this
PICKLE_AT_MOST = 400


def test_a_tensor_travels_as_its_storage_or_as_rpcs_compact_copy_of_a_small_view():
    big = torch.zeros(4096)  # a 16 KB storage
    assert tensor_wire_bytes(big) == 16384
    assert tensor_wire_bytes(big[:2048]) == 8192  # half of a storage of 8 KB or more: a compact copy
    assert tensor_wire_bytes(big[:2049]) == 16384  # more than half: the whole storage
    small = torch.zeros(1792)  # 7 KB: always whole
    assert tensor_wire_bytes(small[:10]) == 7168
    assert tensor_wire_bytes(torch.zeros(3, dtype=torch.float64)) == 24
    obj = ("x", [big, {"y": small}], 3)
    pickled, tensors = payload_parts(obj)
    assert [t is x for t, x in zip(tensors, (big, small))] == [True, True] and len(tensors) == 2
    assert 0 < pickled < 100 and payload_bytes(obj) == pickled + 16384 + 7168
    # a tensor's bytes are not in the pickled part, whatever its size
    assert payload_parts(("x", [torch.zeros(1), {"y": small}], 3))[0] == pickled


def test_inactive_leaves_torch_untouched_and_counts_nothing(rpc_world):
    originals = (rpc.rpc_async, rpc.rpc_sync, rpc.remote)
    with Traffic() as traffic:
        assert rpc.rpc_async is not originals[0]
    assert (rpc.rpc_async, rpc.rpc_sync, rpc.remote) == originals
    rpc.rpc_async("worker1", torch.add, args=(torch.ones(1000), 1)).wait()
    assert not traffic.messages and not traffic.sent and not traffic.received


def test_a_call_and_its_answer_are_counted_to_and_from_its_peer(rpc_world):
    x = torch.ones(4096)  # 16 KB each way
    with Traffic() as traffic:
        fut = rpc.rpc_async("worker1", torch.add, args=(x, 1))
        got = rpc.rpc_sync(rpc.get_worker_info("worker2"), torch.mul, args=(x,), kwargs={"other": 2})
        fut.wait()
    assert float(got[0]) == 2.0
    assert dict(traffic.messages) == {"worker1": 1, "worker2": 1}
    for peer in ("worker1", "worker2"):
        assert 16384 < traffic.sent[peer] < 16384 + PICKLE_AT_MOST, traffic.sent
        assert 16384 <= traffic.received[peer] < 16384 + PICKLE_AT_MOST, traffic.received
        assert traffic.answers[peer] == 1
    assert traffic.unsized == 0


def test_heartbeats_are_left_out_and_remote_sends_without_an_answer(rpc_world):
    beat = watch.Beat("worker0", watch.RUNNING, "", watch.Origin("host", "", "", 1))
    with Traffic() as traffic:
        rpc.rpc_async("worker1", watch._beat, args=(beat,)).wait()
        ref = rpc.remote("worker2", torch.add, args=(torch.ones(2), 1))
        assert float(ref.to_here(timeout=HANG_S)[0]) == 2.0  # (torch's own message: not counted)
    assert dict(traffic.messages) == {"worker2": 1}, traffic.messages
    assert 8 < traffic.sent["worker2"] < 8 + PICKLE_AT_MOST and not traffic.received, (traffic.sent, traffic.received)


def test_counters_nest(rpc_world):
    x = torch.ones(1024)
    with Traffic() as outer:
        with Traffic() as inner:
            rpc.rpc_sync("worker1", torch.neg, args=(x,))
        rpc.rpc_sync("worker1", torch.neg, args=(x,))
    assert inner.messages["worker1"] == 1 and outer.messages["worker1"] == 2
    assert outer.sent["worker1"] == 2 * inner.sent["worker1"]


def test_one_counter_entered_twice_is_refused_and_keeps_counting(rpc_world):
    x = torch.ones(1024)
    with Traffic() as traffic:
        try:
            with traffic:
                raise AssertionError("entered twice")
        except RuntimeError as exc:
            assert "already counting" in str(exc)
        rpc.rpc_sync("worker1", torch.neg, args=(x,))
    assert traffic.messages["worker1"] == 1


def test_arguments_torch_sends_as_given_keep_their_own_error(rpc_world):
    # args=5 is sent as is and fails in the callee, with or without counting
    errors = []
    for counting in (False, True):
        with Traffic() if counting else _nothing():
            try:
                rpc.rpc_sync("worker1", torch.neg, 5, timeout=HANG_S)
            except Exception as exc:  # noqa: BLE001 - compared below
                errors.append(type(exc))
    assert len(errors) == 2 and errors[0] is errors[1], errors


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None
