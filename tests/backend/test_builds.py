"""One build per world (rpc_backend/builds.py): the wire fingerprint, the report, the comparison
on a store, and ranks of different builds, each on its own ``PYTHONPATH`` (a copy of this
checkout, changed or not), under torchrun and with plain ``rpc.init_rpc``.
"""

import _thread
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import remote_module
import rpc_backend
from rpc_backend import builds, connect, loopback_env
from rpc_backend.builds import Build, BuildMismatch, RankBuilds, check_world, defined_names, fingerprint, mismatch
from rpc_backend.connect import check_world_builds
from tests._deadlines import HANG_S, SETUP_S
from tests.test_torchrun import _argv, _free_port

ROOT = Path(__file__).resolve().parents[2]
JOB = "tests/backend/scripts/builds_job.py"
OTHER = "0.1.0+other"


# -- the fingerprint ------------------------------------------------------------------------------


def _package(root: Path, text: str) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "host.py").write_text(text)
    return root / "pkg"


def test_defined_names_are_the_functions_and_classes_with_their_shapes(tmp_path):
    pkg = _package(tmp_path, "def handler(x):\n    def inner():\n        pass\n\nclass Plan:\n"
                             "    rows: list\n    def method(self, a, /, b=1, *rest, c, **more):\n        pass\n"
                             "    class Part:\n        size: int\n\nasync def later(*, when):\n    pass\n"
                             "try:\n    def fallback():\n        pass\nexcept ImportError:\n    pass\n")
    assert sorted(defined_names("pkg", pkg)) == [
        "pkg.host:Plan.Part{size}", "pkg.host:Plan.method(self,a,/,b,*rest,c,**more)", "pkg.host:Plan{rows}",
        "pkg.host:fallback()", "pkg.host:handler(x)", "pkg.host:later(*,when)"]


def test_a_file_that_does_not_parse_counts_by_its_name(tmp_path):
    assert defined_names("pkg", _package(tmp_path, "def broken(:\n")) == ["pkg.host:?"]


_BASE = '''
"""A module of handlers."""
from typing import NamedTuple


class Plan(NamedTuple):
    """What travels."""

    rows: list
    weight: float = 1.0

    def size(self, scale):
        return len(self.rows) * scale


def handler(plan, strict=False):
    # answer the plan
    return plan.size(2)
'''

#: edits of _BASE that change what travels or how it is called: refused
_WIRE_CHANGES = {
    "a handler gains an argument": ("def handler(plan, strict=False):", "def handler(plan, strict=False, more=0):"),
    "a handler's argument renamed": ("def handler(plan, strict=False):", "def handler(plan, exact=False):"),
    "an argument becomes keyword-only": ("def handler(plan, strict=False):", "def handler(plan, *, strict=False):"),
    "a NamedTuple gains a field": ("    rows: list\n", "    rows: list\n    owner: int\n"),
    "a NamedTuple's fields reordered": ("    rows: list\n    weight: float = 1.0\n",
                                        "    weight: float = 1.0\n    rows: list\n"),
    "a method gains an argument": ("def size(self, scale):", "def size(self, scale, floor):"),
    "a handler renamed": ("def handler(", "def handler2("),
    "a private helper added (never travels, refused all the same: documented)": ("", "\n\ndef _helper():\n    pass\n"),
}

#: edits of _BASE that no call on the wire can see: one build
_SAME_WIRE = {
    "a comment": ("    # answer the plan\n", "    # answer the plan, twice\n"),
    "a docstring": ('"""What travels."""', '"""What travels over RPC."""'),
    "a body": ("return plan.size(2)", "return plan.size(3) + 0"),
    "a default value": ("strict=False", "strict=True"),
    "an annotation's type": ("rows: list", "rows: tuple"),
    "the order of definitions": ("", "MOVE"),
}


def _edited(old: str, new: str) -> str:
    if new == "MOVE":  # the handler first, the class after it
        head, plan = _BASE.split("\n\nclass Plan", 1)
        plan, handler = plan.split("\n\ndef handler", 1)
        return f"{head}\n\ndef handler{handler}\n\nclass Plan{plan}"
    if not old:
        return _BASE + new
    assert old in _BASE, old
    return _BASE.replace(old, new, 1)


@pytest.mark.parametrize("change", sorted(_WIRE_CHANGES))
def test_the_fingerprint_changes_with_what_travels_and_how_it_is_called(tmp_path, change):
    base = fingerprint("1.0", defined_names("pkg", _package(tmp_path / "a", _BASE)))
    changed = fingerprint("1.0", defined_names("pkg", _package(tmp_path / "b", _edited(*_WIRE_CHANGES[change]))))
    assert changed != base


@pytest.mark.parametrize("change", sorted(_SAME_WIRE))
def test_the_fingerprint_ignores_what_no_call_sees(tmp_path, change):
    base = fingerprint("1.0", defined_names("pkg", _package(tmp_path / "a", _BASE)))
    same = fingerprint("1.0", defined_names("pkg", _package(tmp_path / "b", _edited(*_SAME_WIRE[change]))))
    assert same == base


def test_the_fingerprint_changes_with_a_handler_name_or_the_version_not_with_the_place(tmp_path):
    one = defined_names("pkg", _package(tmp_path / "a", "def handler(x):\n    return x\n"))
    same = defined_names("pkg", _package(tmp_path / "b", "def handler(x):\n    return x\n"))
    renamed = defined_names("pkg", _package(tmp_path / "c", "def handler2(x):\n    return x\n"))
    assert fingerprint("1.0", one) == fingerprint("1.0", same)  # two checkouts of one build
    assert fingerprint("1.0", one) != fingerprint("1.0", renamed)
    assert fingerprint("1.0", one) != fingerprint("1.1", one)
    assert fingerprint("1.0", ["b", "a"]) == fingerprint("1.0", ["a", "b", "a"])  # sorted, each once


def test_the_fingerprint_is_the_same_in_every_process():
    # no hash seed, no id(): two interpreters with different seeds agree with this one
    code = ("import json, remote_module; from rpc_backend.builds import local_builds; "
            "print(json.dumps({p: b.fingerprint for p, b in local_builds().items()}))")
    seen = []
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
                             env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": seed})
        assert out.returncode == 0, out.stderr[-3000:]
        seen.append(json.loads(out.stdout))
    here = {p: b.fingerprint for p, b in builds.local_builds(["remote_module", "rpc_backend"]).items()}
    assert seen == [here, here]


def test_both_packages_declare_their_build():
    found = builds.local_builds()
    assert found["remote_module"].version == remote_module.__version__
    assert found["remote_module"].location == str(ROOT / "remote_module")
    assert found["rpc_backend"].fingerprint and not found["rpc_backend"].error


def test_the_answer_to_other_builds_stays_where_they_look_for_it():
    # another build calls it by this name: moving it breaks the check between builds
    assert (builds.answer_builds.__module__, builds.answer_builds.__qualname__) == ("rpc_backend.builds",
                                                                                    "answer_builds")
    answer = builds.answer_builds(["remote_module"])
    assert set(answer["builds"]) >= {"remote_module", "rpc_backend"}
    assert json.loads(json.dumps(answer)) == answer  # plain dicts and strings only


def test_a_package_that_cannot_be_imported_is_a_build_of_its_own():
    found = builds.local_builds(["no_such_package_here"])["no_such_package_here"]
    assert "cannot import it here: ModuleNotFoundError" in found.error


def test_only_threads_python_started_wait_for_a_peers_answer():
    # torch's RPC handler threads are not Python's (threading sees them as dummies): a handler
    # that calls a peer must not block its pool on the question
    seen = []
    done = threading.Event()

    def foreign():
        seen.append(builds._may_wait())
        done.set()

    _thread.start_new_thread(foreign, ())
    assert done.wait(HANG_S)
    assert builds._may_wait() and seen == [False]


# -- the report -----------------------------------------------------------------------------------


def _build(version, names=("pkg.host:handler",), location="/a/pkg"):
    return Build("pkg", version, fingerprint(version, names), location)


def test_one_build_on_every_rank_is_no_mismatch():
    ranks = [RankBuilds("rank 0 (ps0) on a", {"pkg": _build("1.0")}),
             RankBuilds("rank 1 (t0) on b", {"pkg": _build("1.0", location="/b/pkg")})]
    assert mismatch(ranks) is None


def test_the_report_names_both_builds_their_ranks_and_the_fix():
    one, other = _build("1.0"), _build("1.0", ("pkg.host:moved",), "/b/pkg")
    ranks = [RankBuilds("rank 0 (ps0) on a", {"pkg": one}), RankBuilds("rank 1 (t0) on b", {"pkg": other}),
             RankBuilds("rank 2 (t1) on a", {"pkg": one})]
    report = mismatch(ranks)
    assert report.startswith("the ranks of this RPC world run different builds of pkg: ")
    assert f"pkg 1.0 (wire {one.fingerprint}, from /a/pkg) on rank 0 (ps0) on a, rank 2 (t1) on a" in report
    assert f"pkg 1.0 (wire {other.fingerprint}, from /b/pkg) on rank 1 (t0) on b" in report
    assert "install one build of the package on every machine" in report
    lacking = mismatch([ranks[0], RankBuilds("rank 1 (t0) on b", {})])
    assert "no build of pkg (not reported) on rank 1 (t0) on b" in lacking


# -- the comparison on a store (ranks as threads) --------------------------------------------------


def _no_call(name):
    """A probe that asks nobody: the ranks here are threads, and this process may be a rank of
    the test session's own RPC world, whose agent knows no ``w1``."""
    return None


def _world(declared, asked=None, timeout=HANG_S):
    """Run check_world on one store for ranks whose ``declared`` builds are given; ``asked``:
    what a rank answers for every package once asked (round 2). Each rank's outcome."""
    store = dist.HashStore()
    names = [f"w{r}" for r in range(len(declared))]
    outcomes = [None] * len(declared)

    def rank(r):
        def mine(packages):
            return declared[r] if packages is None else {p: (asked or declared)[r][p] for p in packages}

        try:
            check_world(store, r, len(declared), names, timeout, builds=mine, probe=_no_call)
            outcomes[r] = "ok"
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcomes[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(declared))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    return outcomes


def test_ranks_of_one_build_pass_the_comparison():
    assert _world([{"pkg": _build("1.0")}, {"pkg": _build("1.0", location="/b/pkg")}]) == ["ok", "ok"]


def test_every_rank_fails_naming_both_builds():
    outcomes = _world([{"pkg": _build("1.0")}, {"pkg": _build("1.1", location="/b/pkg")}])
    for r, outcome in enumerate(outcomes):
        assert isinstance(outcome, BuildMismatch), outcome
        assert str(outcome).startswith(f"rank {r} (w{r}) cannot join: the ranks of this RPC world run different")
        assert "pkg 1.0 (wire" in str(outcome) and "pkg 1.1 (wire" in str(outcome)


def test_a_rank_that_had_not_imported_the_package_is_compared_all_the_same():
    # rank 1 declared only the other package; asked (round 2) it imports pkg: another build
    base = {"base": _build("1.0")}
    declared = [{**base, "pkg": _build("1.0")}, base]
    asked = [declared[0], {**base, "pkg": _build("2.0")}]
    outcomes = _world(declared, asked)
    assert all(isinstance(o, BuildMismatch) and "pkg 2.0 (wire" in str(o) for o in outcomes), outcomes
    assert _world(declared, [declared[0], declared[0]]) == ["ok", "ok"]


def test_the_comparison_says_which_packages_it_compared():
    store = dist.HashStore()
    assert check_world(store, 0, 1, ["w0"], HANG_S, builds=lambda packages: {"pkg": _build("1.0")}) == {"pkg"}


def _never_answered(name):
    return torch.futures.Future()  # a stopped rank: the call neither answers nor fails


def test_a_rank_that_publishes_no_build_is_named_when_the_bound_passes():
    store = dist.HashStore()
    with pytest.raises(BuildMismatch, match=r"^rank 0 \(w0\) cannot join: rank\(s\) 1 \(w1\) published no build "
                                            r"within 0 s of joining: .* or is stopped or hung"):
        check_world(store, 0, 2, ["w0", "w1"], 0.5, builds=lambda packages: {"pkg": _build("1.0")},
                    probe=_never_answered)


def test_a_rank_that_died_before_publishing_fails_the_others_at_once():
    # the bound is HANG_S: the failed call to w1 ends the wait long before it
    asked = []

    def refused(name):
        asked.append(name)
        failed = torch.futures.Future()
        failed.set_exception(RuntimeError("connect: Connection refused (this is tensorpipe's error)"))
        return failed

    with pytest.raises(BuildMismatch, match=r"^rank 0 \(w0\) cannot join: rank\(s\) cannot take part in comparing "
                                            r"the builds \(a call to each failed\): 1 \(w1\) died or shut down: "
                                            r"connect: Connection refused"):
        check_world(dist.HashStore(), 0, 2, ["w0", "w1"], HANG_S, builds=lambda packages: {"pkg": _build("1.0")},
                    probe=refused)
    assert asked == ["w1"]  # once, and only the rank that was missing


def test_a_rank_of_an_older_build_is_named_at_once_not_at_the_bound():
    # a build without rpc_backend.builds publishes nothing and cannot unpickle the question:
    # its answer says so at once (the bound is HANG_S), and the error says how to fix it
    def older(name):
        failed = torch.futures.Future()
        failed.set_exception(AttributeError("Can't get attribute 'answer_builds' on <module 'rpc_backend.builds'>"))
        return failed

    with pytest.raises(BuildMismatch, match=r"1 \(w1\) runs an older build: it cannot answer "
                                            r"rpc_backend.builds.answer_builds .*install one build"):
        check_world(dist.HashStore(), 0, 2, ["w0", "w1"], HANG_S, builds=lambda packages: {"pkg": _build("1.0")},
                    probe=older)


def test_a_store_gone_during_the_comparison_is_a_build_error_not_a_network_one(monkeypatch):
    # RPC formed already: the join reports the comparison's own failure, never a ConnectError
    class Gone(dist.Store):
        def set(self, key, value):
            raise dist.DistStoreError("Connection reset by peer")

    # this rank leaves RPC at once: seen through stand-ins, since this process may be a rank of
    # the test session's own world, which the tests after this one still use
    left = []
    monkeypatch.setattr(connect, "is_rpc_initialized", lambda: True)
    monkeypatch.setattr(connect.rpc, "shutdown", lambda graceful=True, **kw: left.append(graceful))
    with pytest.raises(BuildMismatch, match=r"^rank 0 \(w0\) cannot join: the ranks' builds could not be compared "
                                            r"\(DistStoreError: Connection reset by peer\): the job's store or"):
        check_world_builds(Gone(), "p", ("127.0.0.1", 1), 0, 2, ["w0", "w1"], HANG_S)
    assert left == [False]


# -- ranks of different builds, each on its own PYTHONPATH -----------------------------------------


def _checkout_copy(where: Path, version: str | None = None) -> Path:
    """This checkout's packages in ``where`` (the version changed to ``version``): another build."""
    for name in ("remote_module", "rpc_backend", "templates"):
        shutil.copytree(ROOT / name, where / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "setup.cfg", where / "setup.cfg")
    if version is not None:
        init = where / "remote_module" / "__init__.py"
        text = init.read_text()
        assert '__version__ = "0.1.0"' in text
        init.write_text(text.replace('__version__ = "0.1.0"', f'__version__ = "{version}"'))
    return where


def _env(pythonpath: Path) -> dict:
    return {**os.environ, **loopback_env(), "PYTHONPATH": str(pythonpath)}


def _two_ranks(commands: list[list[str]], envs: list[dict]) -> list[tuple[int, str, str]]:
    procs = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for command, env in zip(commands, envs)]
    outcomes = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=SETUP_S + HANG_S)
            outcomes.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outcomes


def _torchrun_ranks(paths: list[Path]) -> list[tuple[int, str, str]]:
    port = _free_port()
    return _two_ranks([_argv(f"torchrun --nnodes=2 --nproc-per-node=1 --node-rank={r} --master-addr=127.0.0.1 "
                             f"--master-port={port} {JOB}") for r in range(2)], [_env(p) for p in paths])


@pytest.mark.slow
@pytest.mark.timeout(2 * (SETUP_S + HANG_S))
def test_a_rank_of_another_build_fails_the_world_naming_both(tmp_path):
    other = _checkout_copy(tmp_path, OTHER)
    outcomes = _torchrun_ranks([ROOT, other])
    for r, (code, out, err) in enumerate(outcomes):
        assert code != 0, out + err[-4000:]
        assert "joined" not in out, out
        line = next((x for x in err.splitlines() if "BuildMismatch: " in x), None)
        assert line is not None, err[-4000:]
        assert f"rank {r} (worker{r}) cannot join: the ranks of this RPC world run different builds of " \
               "remote_module" in line, line
        assert "remote_module 0.1.0 (wire " in line and f"from {ROOT / 'remote_module'}) on rank 0 (worker0)" in line
        assert f"remote_module {OTHER} (wire " in line and f"from {other / 'remote_module'}) on rank 1 (worker1)" \
               in line, line
        assert "install one build of the package on every machine" in line, line


@pytest.mark.slow
@pytest.mark.timeout(2 * (SETUP_S + HANG_S))
def test_without_torchruns_store_the_ranks_compare_on_the_one_init_rpc_started(tmp_path):
    # the torchrun variables set by hand (no agent store): rank 0's init_rpc hosts the store,
    # and stays until rank 1 has read the report
    port = str(_free_port())
    envs = [{**_env(path), "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": port,
             "TORCHELASTIC_USE_AGENT_STORE": "False"} for r, path in enumerate([ROOT, _checkout_copy(tmp_path, OTHER)])]
    for r, (code, out, err) in enumerate(_two_ranks([[sys.executable, JOB]] * 2, envs)):
        assert code != 0 and "joined" not in out, out + err[-4000:]
        assert f"BuildMismatch: rank {r} (worker{r}) cannot join: the ranks of this RPC world run different " \
               "builds of remote_module" in err, err[-4000:]
        assert f"remote_module {OTHER} (wire " in err and "remote_module 0.1.0 (wire " in err, err[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(2 * (SETUP_S + HANG_S))
def test_a_rank_that_dies_in_the_comparison_fails_the_others_with_rpc_shut_down():
    # rank 1 exits right after init_rpc; rank 0 (its init_rpc hosts the store) calls it, the
    # call fails, and rank 0 names it at once (long before the connect bound, which is this
    # test's own guard): no network advice, RPC left, a clean exit
    port = str(_free_port())
    envs = [{**_env(ROOT), "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": port,
             "TORCHELASTIC_USE_AGENT_STORE": "False", "BUILDS_JOB_DIE_IN_CHECK": "1",
             "RPC_BACKEND_CONNECT_TIMEOUT": str(SETUP_S + HANG_S)} for r in range(2)]
    (code, out, err), (died, _, _) = _two_ranks([[sys.executable, JOB]] * 2, envs)
    assert died == 3
    assert code == 1 and "rank 0: BuildMismatch; RPC still initialized: False" in out, out + err[-4000:]
    assert "BuildMismatch: rank 0 (worker0) cannot join: rank(s) cannot take part in comparing the builds (a " \
           "call to each failed): 1 (worker1) died or shut down: " in err, err[-4000:]
    assert "ConnectError" not in err and "IFNAME" not in err and "terminate called" not in err, err[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(2 * (SETUP_S + HANG_S))
def test_two_checkouts_of_one_build_form_a_world(tmp_path):
    outcomes = _torchrun_ranks([ROOT, _checkout_copy(tmp_path)])
    for r, (code, out, err) in enumerate(outcomes):
        assert code == 0, out + err[-4000:]
        assert f"rank {r}: joined, remote_module 0.1.0" in out, out


def _plain_ranks(tmp_path: Path, paths: list[Path]) -> list[tuple[int, str, str]]:
    init = f"file://{tmp_path / 'rendezvous'}"
    return _two_ranks([[sys.executable, JOB, "plain", str(r), init] for r in range(2)], [_env(p) for p in paths])


@pytest.mark.slow
@pytest.mark.timeout(2 * (SETUP_S + HANG_S))
def test_plain_init_rpc_fails_the_first_call_to_a_peer_of_another_build(tmp_path):
    other = _checkout_copy(tmp_path / "other", OTHER)
    (caller, served) = _plain_ranks(tmp_path, [ROOT, other])
    assert caller[0] == 0 and served[0] == 0, caller[2][-3000:] + served[2][-3000:]
    assert "called worker1" not in caller[1], caller[1]
    line = next((x for x in caller[1].splitlines() if x.startswith("worker0: BuildMismatch: ")), None)
    assert line is not None, caller[1] + caller[2][-3000:]
    assert "worker 'worker1' cannot be called: the ranks of this RPC world run different builds of " \
           "remote_module" in line, line
    assert "remote_module 0.1.0 (wire " in line and "on worker0 (this process)" in line, line
    # worker1 had not imported remote_module: it did so to answer, from its own PYTHONPATH
    assert f"remote_module {OTHER} (wire " in line and f"from {other / 'remote_module'}) on worker1" in line, line


@pytest.mark.slow
@pytest.mark.timeout(2 * (SETUP_S + HANG_S))
def test_plain_init_rpc_names_a_peer_whose_build_cannot_answer_the_check(tmp_path):
    # a build older than the check: the peer cannot find the function the question names
    other = _checkout_copy(tmp_path / "older")
    module = other / "rpc_backend" / "builds.py"
    module.write_text(module.read_text().replace("def answer_builds(", "def answer_builds_elsewhere("))
    (caller, served) = _plain_ranks(tmp_path, [ROOT, other])
    assert caller[0] == 0 and served[0] == 0, caller[2][-3000:] + served[2][-3000:]
    line = next((x for x in caller[1].splitlines() if x.startswith("worker0: BuildMismatch: ")), None)
    assert line is not None, caller[1] + caller[2][-3000:]
    assert "worker 'worker1' cannot be called: it runs a build of rpc_backend that cannot answer " \
           "rpc_backend.builds.answer_builds (one older than that check; there: " in line, line
    assert "answer_builds" in line.split("older than that check; there: ", 1)[1], line  # torch's own words
    assert "install one build of the package on every machine" in line, line


@pytest.mark.slow
@pytest.mark.timeout(2 * (SETUP_S + HANG_S))
def test_plain_init_rpc_with_one_build_calls_as_before(tmp_path):
    (caller, served) = _plain_ranks(tmp_path, [ROOT, _checkout_copy(tmp_path / "same")])
    assert caller[0] == 0 and served[0] == 0, caller[2][-3000:] + served[2][-3000:]
    assert "worker0: called worker1, got (1, 3)" in caller[1], caller[1] + caller[2][-3000:]


def test_the_check_is_exported():
    assert rpc_backend.BuildMismatch is BuildMismatch and rpc_backend.declare_build is builds.declare_build
