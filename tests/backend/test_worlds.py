"""rpc_backend without RemoteModule: role specs, option validation, torchrun variables,
the Worker context manager and bounded shutdown."""

import re
from fractions import Fraction

import numpy as np
import pytest
import torch

from rpc_backend import (
    LocalWorldError,
    Worker,
    make_options,
    placements,
    read_env,
    run_local,
)
from rpc_backend.options import positive_seconds
from tests._deadlines import HANG_S, SETUP_S
from tests._faults.subworld import run_report
from tests.backend import _worlds_remote

#: run_local's bound on a world that starts and returns at once (and its ranks' rpc_timeout,
#: which bounds their rendezvous): tests/_deadlines.py
WORLD = dict(timeout=SETUP_S, rpc_timeout=SETUP_S)


def test_role_spec_names_ranks_in_order():
    layout = placements(4, {"ps": 2, "trainer": 2})
    assert [p.name for p in layout] == ["ps0", "ps1", "trainer0", "trainer1"]
    assert [(p.role, p.role_rank, p.role_size) for p in layout] == [
        ("ps", 0, 2), ("ps", 1, 2), ("trainer", 0, 2), ("trainer", 1, 2)
    ]
    assert [p.name for p in placements(2)] == ["worker0", "worker1"]


@pytest.mark.parametrize(
    "world_size,roles,exc,text",
    [
        (3, {"ps": 1, "trainer": 1}, ValueError, "add up to 2 workers but the world has 3"),
        (2, {"ps": 0, "trainer": 2}, ValueError, "role 'ps' needs a positive int count"),
        (2, {"p s": 2}, ValueError, "role names must be identifiers"),
        (2, {}, TypeError, "non-empty mapping"),
        (2, {"ps": 1, "ps1": 1}, ValueError, None),  # ps0/ps10 fine; but check no crash
        (0, None, ValueError, "world_size must be a positive int"),
    ],
)
def test_bad_role_specs(world_size, roles, exc, text):
    if text is None:
        assert [p.name for p in placements(world_size, roles)] == ["ps0", "ps10"]
        return
    with pytest.raises(exc, match=text):
        placements(world_size, roles)


@pytest.mark.parametrize(
    "kwargs,exc,text",
    [
        (dict(rpc_timeout=0), ValueError, "rpc_timeout must be a positive number"),
        (dict(rpc_timeout="60"), ValueError, "rpc_timeout"),
        (dict(num_worker_threads=0), ValueError, "num_worker_threads must be a positive int"),
        (dict(device_maps={"nobody": {"cuda:0": "cuda:0"}}, worker_names=["w0"]), ValueError,
         "'nobody', which is not in the world"),
        (dict(device_maps={"w1": {"cuda:0": "gpu9"}}), ValueError, "'gpu9' is not a device"),
        (dict(device_maps={"w1": {}}), TypeError, "non-empty dict"),
        (dict(device_maps={"w1": {"cuda:0": "cuda:1", "cuda:1": "cuda:1"}}), ValueError, "same remote device"),
        (dict(device_maps={1: {"cuda:0": "cuda:0"}}), TypeError, "peer worker names"),
        (dict(devices=["cuda:0", "tpu?"]), ValueError, "is not a device"),
    ],
)
def test_options_are_validated_before_init(kwargs, exc, text):
    with pytest.raises(exc, match=text):
        make_options(**kwargs)


@pytest.mark.parametrize(
    "value",
    [True, False, "60", None, float("nan"), float("inf"), -float("inf"), 0, 0.0, -1, 0.0004, 2**31 / 1000, 1e12],
)
def test_timeouts_outside_what_torch_can_express_are_refused(value):
    # under 1 ms torch waits forever; 2**31 ms or more (inf too) wraps into a negative figure
    with pytest.raises(ValueError) as info:
        positive_seconds(value, "timeout")
    text = str(info.value)
    assert text.startswith("timeout must be a positive number of seconds in [0.001, 2147483.648)")
    assert f"got {value!r}" in text
    with pytest.raises(ValueError, match=r"rpc_timeout must be a positive number of seconds in \[0\.001, "):
        make_options(rpc_timeout=value)


@pytest.mark.parametrize(
    "value,seconds",
    [(0.001, 0.001), (1, 1.0), (2.5, 2.5), (2**31 / 1000 - 0.001, 2147483.647), (Fraction(1, 4), 0.25),
     (np.float32(0.5), 0.5), (np.int64(3), 3.0)],
)
def test_timeouts_within_range_are_float_seconds(value, seconds):
    out = positive_seconds(value, "timeout")
    assert type(out) is float and out == seconds
    assert make_options(rpc_timeout=value).rpc_timeout == pytest.approx(seconds, rel=1e-6)


def test_valid_options():
    opts = make_options(rpc_timeout=5, num_worker_threads=4, device_maps={"w1": {"cuda:0": "cuda:1"}},
                        devices=["cuda:0"])
    assert opts.rpc_timeout == 5 and opts.num_worker_threads == 4
    assert opts.device_maps == {"w1": {torch.device("cuda:0"): torch.device("cuda:1")}}
    assert opts.devices == [torch.device("cuda:0")]


TORCHRUN = {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_read_env():
    info = read_env(TORCHRUN)
    assert (info["rank"], info["world_size"], info["local_rank"], info["master_port"]) == (1, 3, 1, 29500)
    assert info["agent_store"] is False


@pytest.mark.parametrize(
    "changes,text",
    [
        ({"RANK": None, "MASTER_PORT": None}, "missing: RANK, MASTER_PORT"),
        ({"WORLD_SIZE": "three"}, "WORLD_SIZE='three' is not an integer"),
        ({"RANK": "3"}, "RANK=3 must be in [0, WORLD_SIZE=3)"),
        ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 must be in [0, RANK=1]"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    ],
)
def test_bad_torchrun_variables_name_them_and_show_the_command(changes, text):
    env = {k: v for k, v in {**TORCHRUN, **changes}.items() if v is not None}
    with pytest.raises((RuntimeError, ValueError)) as info:
        read_env(env)
    assert text in str(info.value)
    assert "torchrun --standalone --nproc-per-node=3" in str(info.value)


def test_run_local_with_roles_sets_torchrun_variables():
    out = run_local(_worlds_remote.describe, 3, roles={"ps": 1, "trainer": 2}, **WORLD)
    assert [o["name"] for o in out] == ["ps0", "trainer0", "trainer1"]
    assert [o["rpc_name"] for o in out] == ["ps0", "trainer0", "trainer1"]
    assert out[2]["env"] == ["2", "3", "2", "trainer"]
    assert (out[2]["role"], out[2]["role_rank"], out[2]["role_size"]) == ("trainer", 1, 2)
    assert out[0]["peers"] == ["trainer0", "trainer1"]


def _worker_of(rank: int, layout: list) -> Worker:
    me = layout[rank]
    return Worker(me.name, rank, len(layout), rank, me.role, me.role_rank, me.role_size, layout=layout)


def test_workers_of_a_role_match_the_role_exactly():
    # ps0, ps1 .. ps10 with role "ps" and ps10 with role "ps1": names alone would mix them up
    layout = placements(4, {"ps": 2, "ps1": 1, "trainer": 1})
    me = _worker_of(0, layout)
    assert [p.name for p in layout] == ["ps0", "ps1", "ps10", "trainer0"]
    assert me.workers("ps") == ["ps0", "ps1"]
    assert me.workers("ps1") == ["ps10"]
    assert me.workers("trainer") == ["trainer0"]
    assert me.workers("p") == [] and me.workers("trainer0") == []
    assert me.names == ["ps0", "ps1", "ps10", "trainer0"]


def test_worker_without_layout_says_how_to_build_one():
    with pytest.raises(RuntimeError, match="layout=placements"):
        Worker("w0", 0, 1, 0, "worker", 0, 1, ["w0"]).workers("worker")
    with pytest.raises(ValueError, match="do not match its layout"):
        Worker("w0", 0, 1, 0, "worker", 0, 1, ["x"], layout=placements(1))


def test_run_local_workers_use_the_roles():
    out = run_local(_worlds_remote.role_peers, 3, roles={"ps": 1, "ps1": 1, "trainer": 1}, **WORLD)
    assert out[0] == {"ps": ["ps0"], "ps1": ["ps10"], "trainer": ["trainer0"]}
    assert out[2] == out[0]


def test_body_that_raises_shuts_down_at_once():
    # rank 0 never shuts down: rank 1 leaving gracefully would wait for it until run_local's
    # own deadline (a TimeoutError, not the rank's failure), whatever the machine's speed
    with pytest.raises(LocalWorldError, match="failed inside the with block"):
        run_local(_worlds_remote.raise_inside_worker_context, 2, timeout=SETUP_S + HANG_S, rpc_timeout=SETUP_S)


def test_graceful_shutdown_is_bounded():
    # rank 1 never calls shutdown (it sleeps until the test is done): rank 0's shutdown, bounded
    # at 2 s, gives up, and not before its bound
    report = run_report("tests.backend._shutdown_world", ["0", "1"])
    assert "did not complete within 2.0 s" in report["outcome"], report
    assert report["seconds"] >= 2.0, report
    assert report["seconds"] < 2.0 + HANG_S, f"hang guard: {report}"


def test_a_ranks_placement_is_a_rankplacement_and_keeps_its_old_name():
    import rpc_backend

    layout = placements(3, {"ps": 1, "trainer": 2})
    assert all(type(p) is rpc_backend.RankPlacement for p in layout)
    assert rpc_backend.Placement is rpc_backend.RankPlacement  # the old name, for existing code
    assert layout[2] == rpc_backend.RankPlacement("trainer1", "trainer", 1, 2)


def test_one_positive_int_check_takes_what_torch_takes_as_a_size():
    import numpy as np

    from rpc_backend.options import positive_int

    assert positive_int(np.int64(3), "n") == 3 and type(positive_int(torch.tensor(2), "n")) is int
    bad_values = [(0, ValueError), (-2, ValueError), (True, TypeError), (1.0, TypeError), ("1", TypeError),
                  (torch.tensor(True), TypeError), (np.array(True), TypeError), (np.bool_(True), TypeError)]
    for bad, error in bad_values:
        with pytest.raises(error, match=rf"^n must be .*got .*{re.escape(repr(bad))}"):
            positive_int(bad, "n")
    with pytest.raises(ValueError, match=r"^n must be a positive int, got 1\.5$"):
        positive_int(1.5, "n", wrong_type=ValueError)
    with pytest.raises(ValueError, match=r"^role 'ps' needs a positive int count, got 0$"):
        positive_int(0, "role 'ps'", message="{what} needs a positive int count, got {value!r}")


def test_the_transport_is_uv_by_default_and_shm_on_request():
    from rpc_backend import DEFAULT_TRANSPORT, TRANSPORTS
    from rpc_backend.options import transport_kwargs

    assert DEFAULT_TRANSPORT == "uv" and set(TRANSPORTS) == {"uv", "shm"}
    uv = transport_kwargs("uv")
    assert uv["_transports"] == ["uv"] and uv["_channels"][0] == "basic"
    assert transport_kwargs("shm") == {}  # torch's defaults, as a plain init_rpc
    # every rank offers the CUDA channels this torch has (a peer's device map gives it devices)
    cuda = uv["_channels"][1:]
    assert set(cuda) <= {"cuda_ipc", "cuda_gdr", "cuda_xth", "cuda_basic"}
    if torch.version.cuda is not None and torch.cuda.is_available():  # a CUDA (not ROCm) build
        assert "cuda_basic" in cuda, uv
    assert make_options(device_maps={"w1": {"cuda:0": "cuda:0"}}, devices=["cuda:0"]).devices  # builds
    class AlwaysEqual:
        def __eq__(self, other):
            return True

    for bad in ("tcp", "UV", "", None, 1, ["uv"], ("uv",), np.array(["uv"]), AlwaysEqual()):
        with pytest.raises(ValueError, match=r"transport must be one of \('uv', 'shm'\), got "):
            make_options(transport=bad)
    with pytest.raises(ValueError, match="transport must be one of"):
        run_local(print, 2, transport="ibv")  # refused in the caller, before any process starts
    # and a plain options object is built for both
    for name in TRANSPORTS:
        assert make_options(transport=name, rpc_timeout=7).rpc_timeout == 7
