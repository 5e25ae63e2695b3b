"""Same-script worlds keep the identity of __main__ classes and factories; a host whose
__main__ is other code gets copies (tests/proxy/scripts/same_script_job.py, tests/proxy/scripts/other_code_host.py).

Each launcher runs one job that checks everything: a factory guarding a module-level
singleton with a threading.Lock constructs, two proxies share that singleton, the host
instance is an instance of the host's own class and the class-level state is the host's,
nested __main__ objects in constructor arguments are the host's own, and a __main__
namedtuple output is the caller's own class; a host running other code returns copies of the
caller's namedtuple and dataclass that arrive as the caller's own classes.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rpc_backend import fresh_file_rendezvous, loopback_env
from tests._deadlines import HANG_S, SETUP_S

ROOT = Path(__file__).resolve().parents[2]
JOB = "tests/proxy/scripts/same_script_job.py"
#: a job starts its world (SETUP_S inside it, for run_local's) and then waits for it to end
JOB_S = SETUP_S + HANG_S


def _env() -> dict:
    return {**os.environ, **loopback_env(), "PYTHONPATH": str(ROOT)}


def _result(stdout: str, stderr: str = "") -> dict:
    line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"no RESULT line\nstdout:\n{stdout[-2000:]}\nstderr:\n{stderr[-3000:]}"
    return json.loads(line[len("RESULT "):])


def _run(argv: list[str]) -> dict:
    out = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=JOB_S)
    assert out.returncode == 0, out.stderr[-3000:]
    return _result(out.stdout, out.stderr)


def _check_same_script(result: dict, main: str) -> None:
    assert result["singleton"] == 2, result  # lock factory built once; both proxies share it
    net = result["net"]
    assert isinstance(net, dict), net
    assert net["main"] == main
    assert net["own_class"] is True  # isinstance(host instance, host's own Net)
    assert net["own_instances"] == 1  # class-level state is the host's own class's
    assert net["configs_own"] == [True] and net["config_scales"] == [3.0]
    assert net["out_is_callers_point"] is True and net["out"] == [[3.0, 3.0], 1]
    nested = result["nested"]
    assert isinstance(nested, dict), nested
    assert nested["configs_own"] == [True, True] and nested["config_scales"] == [2.0, 5.0]


@pytest.mark.slow
def test_torchrun_same_script():
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", JOB, "torchrun"]
    _check_same_script(_run(argv), main="__main__")


@pytest.mark.slow
def test_mp_spawn_same_script():
    # caller is the real __main__, host the spawned __mp_main__: one name on the wire
    _check_same_script(_run([sys.executable, JOB, "spawn"]), main="__mp_main__")


@pytest.mark.slow
def test_run_local_same_script():
    _check_same_script(_run([sys.executable, JOB, "local"]), main="__mp_main__")


@pytest.fixture(scope="module")
def different_code() -> dict:
    init_method, path = fresh_file_rendezvous()
    host = subprocess.Popen([sys.executable, "tests/proxy/scripts/other_code_host.py", init_method], cwd=ROOT,
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        caller = subprocess.run([sys.executable, JOB, "caller", init_method], cwd=ROOT, env=_env(),
                                capture_output=True, text=True, timeout=JOB_S)
        host.wait(timeout=HANG_S)  # it leaves once the caller shut down
    finally:
        if host.poll() is None:
            host.kill()
        host.wait()
        if os.path.exists(path):
            os.unlink(path)
    assert caller.returncode == 0, caller.stderr[-3000:]
    return _result(caller.stdout, caller.stderr)


@pytest.mark.slow
def test_host_with_other_code_gets_copies(different_code):
    net = different_code["net"]
    assert isinstance(net, dict), net
    assert net["type"] == "Net" and net["own_class"] is False  # the caller's code, copied
    assert net["own_instances"] == 0  # the host's own Net was never instantiated
    assert net["configs_own"] == [False] and net["config_scales"] == [3.0]
    nested = different_code["nested"]
    assert isinstance(nested, dict), nested
    assert nested["configs_own"] == [False, False] and nested["config_scales"] == [2.0, 5.0]
    assert nested["forward"] == [7.0]
    # the factory holds a lock, so it cannot be copied, and the host's own is other code
    assert different_code["lock_factory"].startswith("ERROR"), different_code["lock_factory"]
    assert "could not be copied by its sender" in different_code["lock_factory"]
    assert "_thread.lock" in different_code["lock_factory"]


@pytest.mark.slow
def test_copied_class_returns_the_callers_own_namedtuple(different_code):
    # host -> caller: the host's copy of Net returns its copy of Point, which the caller
    # recognises as its own Point (once: PicklingError on the host)
    assert different_code["output"] == {"callers_point": True, "out": [[3.0, 3.0], 1]}


@pytest.mark.slow
def test_copied_class_returns_the_callers_own_dataclass(different_code):
    # the host's own Config is other code; the copied Summary returns the caller's Config
    # (its copy on the host), which arrives as the caller's own class, sync and async
    assert different_code["dataclass_output"] == {"callers_config": [True, True], "scales": [3.0, 2.0]}
