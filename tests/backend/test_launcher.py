"""rpc_backend.run_local: results by rank, bounded failure."""

import re
import time

import pytest

from rpc_backend import LocalWorldError, run_local
from tests._deadlines import HANG_S, SETUP_S
from tests.backend import _launcher_remote

#: run_local's bound on a whole world that only starts and returns at once (its ranks' default
#: rpc_timeout, 60 s, also bounds their rendezvous: SETUP_S here too, see tests/_deadlines.py)
WORLD = dict(timeout=SETUP_S, rpc_timeout=SETUP_S)
#: a script that starts a world of its own: the interpreter, the world and its shutdown
SCRIPT_S = SETUP_S + HANG_S


def test_returns_values_ordered_by_rank():
    assert run_local(_launcher_remote.rank_and_sum, 3, args=(10,), **WORLD) == [
        ("worker0", 10, "0", "3"),
        ("worker1", 11, "1", "3"),
        ("worker2", 12, "2", "3"),
    ]


def test_a_failing_rank_stops_the_world_quickly():
    # the other ranks sleep for an hour; the launcher must not wait for them: it raises the
    # failure (not its own TimeoutError, which comes after SETUP_S + HANG_S) and stops them
    start = time.monotonic()
    with pytest.raises(LocalWorldError) as info:
        run_local(_launcher_remote.second_rank_fails, 3, timeout=SETUP_S + HANG_S, rpc_timeout=SETUP_S + HANG_S)
    assert info.value.rank == 1
    assert "rank 1 fails on purpose" in str(info.value)
    assert time.monotonic() - start < SETUP_S + HANG_S, "hang guard"


def test_a_rank_interrupted_alone_fails_the_world_as_interrupted():
    with pytest.raises(LocalWorldError) as info:
        run_local(_launcher_remote.second_rank_interrupted, 3, **WORLD)
    assert info.value.rank == 1 and info.value.interrupted, info.value
    assert "rank 1 (worker1) was interrupted (KeyboardInterrupt" in str(info.value)
    assert "KeyboardInterrupt" in info.value.text  # the rank's traceback


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        run_local(_launcher_remote.rank_and_sum, 0)
    with pytest.raises(ValueError, match="distinct"):
        run_local(_launcher_remote.rank_and_sum, 2, names=["a", "a"])


def test_a_rank_that_cannot_start_raises_its_own_error():
    # spawn pickles a rank's arguments when it starts it: the caller gets that error, not a
    # failure of the cleanup that follows ("can only join a started process")
    import threading

    with pytest.raises(TypeError, match="pickle"):
        run_local(_launcher_remote.rank_and_sum, 2, args=(threading.Lock(),), **WORLD)


def _children() -> set:
    import os

    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            return set(f.read().split())
    except FileNotFoundError:  # not Linux: nothing to compare
        return set()


def _nested_function():
    def inner() -> int:
        return 1

    return inner


@pytest.mark.parametrize("fn, what", [
    (lambda: 1, "<lambda>"),
    (_nested_function(), "_nested_function.<locals>.inner"),
])
def test_a_function_the_ranks_cannot_import_is_refused_before_any_process_starts(fn, what):
    before = _children()
    with pytest.raises(TypeError) as info:
        run_local(fn, 2, **WORLD)
    text = str(info.value)
    assert what in text and "top level of a module" in text and "lambda" in text, text
    assert _children() <= before  # nothing was started


def test_a_function_of_a_main_module_the_ranks_cannot_import_is_refused():
    # python -c, stdin or a notebook: the ranks have no file to import __main__ from (before,
    # unpickling __main__.f in a rank found the variable of the process that forks the ranks)
    import subprocess
    import sys

    code = ("from rpc_backend import run_local\n"
            "def f():\n    return 1\n"
            "try:\n    run_local(f, 2, timeout=60)\n"
            "except TypeError as e:\n    print('REFUSED', e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SCRIPT_S)
    assert done.returncode == 0 and "REFUSED" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "__main__" in done.stdout and "f" in done.stdout and "file" in done.stdout, done.stdout


def test_an_argument_that_cannot_be_sent_is_named():
    with pytest.raises(TypeError) as info:
        run_local(_launcher_remote.rank_and_sum, 2, args=(lambda: 1,), **WORLD)
    assert "args[0]" in str(info.value) and "<lambda>" in str(info.value), str(info.value)


def test_tensor_results_arrive_by_value_and_intact():
    import torch

    messages: list[str] = []
    values = run_local(_launcher_remote.tensors_of_rank, 2, args=(7,), **WORLD, progress=messages.append,
                       progress_every=0.5)
    # progress: the start, (maybe) who is still joining, everyone joined; then, once every fn
    # returned, the shutdown and (maybe) who has not shut down or exited yet
    assert messages[0].startswith("started 2 processes (worker0, worker1)"), messages
    joined = [i for i, m in enumerate(messages) if m.startswith("all 2 ranks joined the RPC world")]
    returned = [i for i, m in enumerate(messages) if m == "all 2 ranks returned; shutting the RPC world down"]
    assert len(joined) == 1 and len(returned) == 1 and joined[0] < returned[0], messages
    assert all(re.match(r"waiting for (worker\d, )*worker\d to join the RPC world", m)
               for m in messages[1:joined[0]]), messages
    assert all(re.match(r"waiting for (worker\d, )*worker\d to (shut down|exit)", m)
               for m in messages[returned[0] + 1:]), messages
    for rank, value in enumerate(values):
        g = torch.Generator().manual_seed(7 + rank)
        base = torch.randn(6, 4, generator=g)
        leaf = torch.randn(3, generator=g)
        assert value["rank"] == rank
        assert torch.equal(value["view"], base[1:4, ::2])
        assert isinstance(value["leaf"], torch.nn.Parameter) and value["leaf"].requires_grad
        assert torch.equal(value["leaf"].detach(), leaf)
        assert torch.equal(value["ints"], torch.arange(5) * (rank + 1))
        assert torch.equal(value["remote"], base + 1.0)
        # the values are the caller's own: usable after every rank has exited
        value["view"].add_(1)
        assert torch.equal(value["view"], base[1:4, ::2] + 1)


def test_an_unpicklable_result_names_the_rank_and_the_type():
    with pytest.raises(LocalWorldError) as info:
        run_local(_launcher_remote.rank_returns_a_lock_inside, 2, **WORLD)
    assert info.value.rank == 1
    text = str(info.value)
    assert "result['lock']" in text and "_thread.lock" in text, text
    assert "without a result" not in text


@pytest.mark.slow
def test_a_deprecation_the_users_script_triggers_shows_as_under_python_main():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "deprecation_job.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=SCRIPT_S)
    assert done.returncode == 0 and "RESULT [1]" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "DeprecationWarning: old_api() is deprecated: call new_api()" in done.stderr, done.stderr[-3000:]
    assert "deprecation_job.py:19" in done.stderr, done.stderr[-3000:]  # the user's line


def test_a_script_without_a_main_guard_fails_with_multiprocessings_own_error():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "no_guard_job.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=SCRIPT_S)
    assert done.returncode != 0 and "RESULT" not in done.stdout, done.stdout + done.stderr[-3000:]
    assert "LocalWorldError" in done.stderr, done.stderr[-3000:]
    assert "if __name__ == '__main__':" in done.stderr, done.stderr[-3000:]
    # the launcher's top level, then each of the 2 ranks' own run of it: no nested worlds
    assert done.stdout.count("TOP LEVEL") <= 3, done.stdout


def test_ranks_see_the_callers_environment_cwd_stdout_and_transport_as_of_each_call(capfd, monkeypatch, tmp_path):
    import os

    mark = "RPC_BACKEND_TEST_MARK"
    # set to 2 (torch caps the count at the cores there are: 2 on the smallest machines), then
    # unset: one thread per rank, as torchrun sets it for several processes
    THREADS = (2, 1)
    TRANSPORT_OF_CALL = ({}, {"transport": "shm"})  # the default (uv), then torch's own defaults
    monkeypatch.chdir(tmp_path)
    seen = {}
    for i in range(2):
        monkeypatch.setenv(mark, f"call{i}")  # changed after the first call: the second sees it
        if i == 0:
            monkeypatch.setenv("OMP_NUM_THREADS", str(THREADS[i]))
            monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
        else:
            monkeypatch.delenv("OMP_NUM_THREADS")
            monkeypatch.delenv("MALLOC_ARENA_MAX")
        transport = TRANSPORT_OF_CALL[i]
        seen[i] = run_local(_launcher_remote.what_a_rank_sees, 2, args=(mark,), **WORLD, **transport)
    me = os.getpid()
    for i, ranks in seen.items():
        for got in ranks:
            assert got["mark"] == f"call{i}" and got["cwd"] == str(tmp_path), got
            assert got["threads"] == THREADS[i], got  # OMP_NUM_THREADS as the call saw it, else 1
            assert got["omp_env"] == str(THREADS[i]), got
            assert got["arenas_env"] == ("4", "2")[i], got  # the caller's, else 2 (glibc arenas per rank)
            # forked by one process per world (the zygote), which this process spawned
            assert got["launcher"] == me and got["parent"] == got["mp_parent"] != me, got
            if got["thread_names"] is not None:  # Linux: the transport asked for, and only it
                spinning = "TP_SHM_reactor" in got["thread_names"]
                assert "TP_UV_loop" in got["thread_names"], got
                assert spinning == (TRANSPORT_OF_CALL[i].get("transport") == "shm"), got
    # one zygote per call, shared by its ranks
    assert [len({got["parent"] for got in ranks}) for ranks in seen.values()] == [1, 1], seen
    assert seen[0][0]["parent"] != seen[1][0]["parent"], seen
    # their prints reach the caller's stdout (here: pytest's capture)
    out = capfd.readouterr().out
    assert out.count("rank 0 prints") == 2 and out.count("rank 1 prints") == 2, out
    assert "OMP_NUM_THREADS" not in os.environ and "MALLOC_ARENA_MAX" not in os.environ  # as it was



def test_forked_ranks_run_their_exit_handlers_and_keep_the_scripts_seeds_as_spawned_ones(tmp_path):
    # the ranks are forked from one process per world (rpc_backend/_zygote.py): what a spawned
    # rank got from running the script's top level itself must hold as well
    import random

    import numpy
    import torch

    saved = random.getstate(), numpy.random.get_state(), torch.get_rng_state()
    from tests.backend import _seeded_remote  # seeds this process's generators: put back below

    random.setstate(saved[0])
    numpy.random.set_state(saved[1])
    torch.set_rng_state(saved[2])
    draws = run_local(_seeded_remote.exits_and_draws, 3, args=(str(tmp_path),), **WORLD)
    # atexit handlers ran as each rank ended (run_local returns once every rank has exited)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exit0", "exit1", "exit2"]
    assert all(p.read_text() == "ran" for p in tmp_path.iterdir())
    # the module seeded Python's, NumPy's and torch's generators at import: every rank draws
    # from the seeded streams (Python's reseeding of ``random`` in a forked child is undone)
    want = _seeded_remote.expected_draws()
    for d in draws:
        assert {k: d[k] for k in want} == want, (d, want)
    # a process a rank starts is spawned by default, as from a spawned rank
    assert [d["start_method"] for d in draws] == ["spawn"] * 3, draws


def test_unseeded_ranks_draw_their_own_streams_as_fresh_interpreters_do():
    # torch seeds a fresh interpreter from the OS (as Python and NumPy seed theirs): ranks
    # forked from one process must not share its streams, or two trainers that generate their
    # own batches (randn, randperm, dropout, a shuffled DataLoader) train on the same data
    import torch

    draws = run_local(_launcher_remote.draws, 3, args=(None,), **WORLD)
    for key in ("initial_seed", "python", "numpy"):
        assert len({d[key] for d in draws}) == 3, (key, [d[key] for d in draws])
    for key in ("randn", "randperm", "dropout", "loader"):
        for a in range(3):
            for b in range(a + 1, 3):
                assert not torch.equal(draws[a][key], draws[b][key]), (key, a, b, draws[a][key])
    # a second world draws streams of its own too
    again = run_local(_launcher_remote.draws, 3, args=(None,), **WORLD)
    assert not {d["initial_seed"] for d in draws} & {d["initial_seed"] for d in again}


def test_a_rank_that_seeds_torch_in_fn_draws_exactly_the_seeded_stream():
    import torch

    draws = run_local(_launcher_remote.draws, 2, args=(11,), **WORLD)
    saved = torch.get_rng_state()
    try:
        want = _launcher_remote.draws(11)  # the same function, here, in a local process
    finally:
        torch.set_rng_state(saved)
    for d in draws:
        assert d["initial_seed"] == 11
        for key in ("randn", "randperm", "dropout", "loader"):
            assert torch.equal(d[key], want[key]), (key, d[key], want[key])


@pytest.mark.slow
def test_a_script_that_seeds_torch_at_its_top_level_seeds_every_rank():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "seeded_job.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=SCRIPT_S)
    assert done.returncode == 0 and "SEEDED True" in done.stdout, done.stdout + done.stderr[-3000:]


def test_a_ranks_module_runs_in_the_rank_never_before_the_fork():
    # module-level code of fn's module (as of the caller's script) runs in each rank, as when
    # every rank was spawned: an OpenMP pool started there (forked after use, it would hang
    # the ranks' next parallel op) and a thread started there (absent after a fork)
    from tests.backend import _zygote_remote

    got = run_local(_zygote_remote.matmul_and_heartbeat, 2, **WORLD)
    assert got == [{"sum": 256.0 ** 3, "threads": 2, "heartbeat": True}] * 2, got


def test_a_child_a_rank_leaves_behind_does_not_hold_up_the_world(tmp_path):
    import os
    import signal

    from tests.backend import _zygote_remote

    pids = run_local(_zygote_remote.leave_a_child, 2, args=(str(tmp_path),), **WORLD)
    try:
        # returned, though each child still holds every descriptor its rank had
        assert all(os.path.exists(f"/proc/{pid}") for pid in pids), pids
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_forking_process_killed_is_named():
    from tests.backend import _zygote_remote

    with pytest.raises(LocalWorldError, match=r"the process that forked the ranks \(pid \d+\) exited with code -9"):
        run_local(_zygote_remote.kill_the_forking_process, 2, **WORLD)


@pytest.mark.parametrize("where", ["guard", "top"])
def test_a_function_defined_under_the_main_guard_is_refused_naming_it(where):
    # the ranks import the script as __mp_main__ without running its `if __name__ == "__main__":`
    # block: a function defined there is refused in the caller, named, before any rank starts
    # (before: each rank failed with "Can't get attribute 'work' on <module '__mp_main__'>");
    # one defined at the top level, even inside another block, is sent as before
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "guarded_fn_job.py"
    args = [] if where == "guard" else ["top"]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=SCRIPT_S)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    if where == "guard":
        assert done.stdout.startswith("REFUSED"), done.stdout + done.stderr[-3000:]
        assert "guarded_work is defined under `if __name__ == \"__main__\":`" in done.stdout, done.stdout
        assert "guarded_fn_job.py" in done.stdout and "top level" in done.stdout, done.stdout
    else:
        assert done.stdout.splitlines()[-1] == "RESULT [7, 7]", done.stdout + done.stderr[-3000:]
