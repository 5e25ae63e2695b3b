"""Simulated machines for tests: Linux network namespaces joined by one bridge.

Each machine is a network namespace with an interface ``eth0`` holding its own address on a
private subnet (10.42.0.0/24, which exists only inside these namespaces), its own loopback
(nothing is shared: a port on one machine's 127.0.0.1 is not reachable from another), its own
hostname (every command runs in a UTS namespace of its own, named as the machine) and its own
``/etc/hosts`` (through ``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` mounts over
``/etc/hosts``). By default the hosts files have the layout Debian and Ubuntu installs write: a
machine's own hostname on 127.0.1.1, the other machines on their addresses. That is where a rank
that trusts its hostname advertises loopback, as real machines do.

The machines' ``eth0`` are veth pairs whose other ends sit on a bridge in a namespace of its
own (the "switch"): nothing is added to the host's own network namespace, and removing the
namespaces removes every link. Links can be shaped per machine (:meth:`Cluster.shape`: ``tc``'s
token bucket on ``Machine.interface`` inside ``Machine.netns`` and on the switch end
``Machine.switch_port`` inside ``Cluster.switch``), and their counters read
(:meth:`Machine.link_counters`).

Use::

    with machines(2) as cluster:                    # needs root, ``ip`` and ``unshare``
        m0, m1 = cluster.machines
        job = cluster.run({m0: argv0, m1: argv1}, env=clean_env())
        job.wait(timeout=SETUP_S + HANG_S)          # all exit, or one fails and the rest stop
        assert job.returncodes() == [0, 0], job.report()

Every name this module creates starts with :data:`PREFIX` and the creating process's pid, so
concurrent runs never collide, and :func:`sweep_stale` removes what a run that died left
behind (its pid no longer alive) without touching anyone else's. Each wait is bounded by the
caller's timeout (tests/_deadlines.py's guards); a machine's processes are stopped by killing
every process in its network namespace, which reaches torchrun's workers even though each
runs in a session of its own.

Tests that need this call :func:`missing_requirements` and skip with its reason.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, NamedTuple, Sequence

from tests._deadlines import HANG_S

ROOT = Path(__file__).resolve().parent.parent

#: Every namespace this module creates is named ``<PREFIX><pid>-<n>-<what>``.
PREFIX = "rmtest"
#: The machines' subnet: machine i has ``SUBNET.(i + 1)``; it exists only inside the namespaces.
SUBNET = "10.42.0"
PREFIX_LEN = 24
#: Where the Debian/Ubuntu layout puts a machine's own hostname.
DEBIAN_SELF_ADDRESS = "127.0.1.1"
#: The variables a test of zero configuration must not inherit from the environment.
NETWORK_VARIABLES = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                      "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE")

_counter = itertools.count()

#: A machine's bind mounts, ``{where: host directory}`` (see :meth:`Machine.argv`).
Mounts = Mapping[str | Path, str | Path]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=HANG_S)


def missing_requirements() -> str | None:
    """Why this process cannot build machines (a skip reason), or ``None`` when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "simulated machines need root (network namespaces); CI runs as root"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"simulated machines need `{tool}` on PATH (iproute2, util-linux)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    try:
        uts = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "--", "hostname", "probe"],
                             capture_output=True, text=True, timeout=HANG_S)
        if uts.returncode != 0:
            return f"cannot give a network namespace its own hostname (unshare --uts): {uts.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _namespaces() -> list[str]:
    listed = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _owner_pid(namespace: str) -> int | None:
    rest = namespace[len(PREFIX):] if namespace.startswith(PREFIX) else ""
    head = rest.split("-", 1)[0]
    return int(head) if head.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_namespace_processes(namespace: str) -> list[int]:
    """SIGKILL every process in ``namespace`` (they are all this harness's); the pids killed."""
    pids = [int(p) for p in _ip("netns", "pids", namespace, check=False).stdout.split() if p.isdigit()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _remove_namespace(namespace: str) -> None:
    kill_namespace_processes(namespace)
    _ip("netns", "del", namespace, check=False)
    shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)


def sweep_stale() -> list[str]:
    """Remove the namespaces (and hosts files) of earlier runs whose process is gone."""
    stale = [ns for ns in _namespaces() if (pid := _owner_pid(ns)) is not None and not _alive(pid)]
    for namespace in stale:
        _remove_namespace(namespace)
    netns_etc = Path("/etc/netns")
    if netns_etc.is_dir():
        for entry in netns_etc.iterdir():
            pid = _owner_pid(entry.name)
            if pid is not None and not _alive(pid):
                shutil.rmtree(entry, ignore_errors=True)
    return stale


@dataclass(frozen=True)
class Machine:
    """One simulated machine: a network namespace with its own address, hostname and hosts file."""

    index: int
    hostname: str
    netns: str
    address: str
    interface: str = "eth0"
    switch_port: str = ""

    def argv(self, argv: Sequence[str], mounts: Mounts | None = None) -> list[str]:
        """``argv`` run on this machine: in its network namespace (and its hosts file), under its hostname.

        ``mounts`` (``{where: host directory}``) gives the command a mount namespace of its own
        (private propagation: nothing reaches the host or another machine) in which each host
        directory is bind-mounted at ``where`` (an existing directory): machines that mount
        their own directories at one path each see only their own there, as each machine sees
        only its own local disk."""
        if not mounts:
            return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--",
                    "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname, *argv]
        pairs = [os.fspath(path) for where, source in mounts.items() for path in (source, where)]
        script = ('hostname "$0" || exit 1; while [ "$1" != -- ]; do mount --bind "$1" "$2" || exit 1; shift 2; done; '
                  'shift; exec "$@"')
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--mount", "--propagation", "private", "--",
                "sh", "-c", script, self.hostname, *pairs, "--", *argv]

    def run(self, argv: Sequence[str], timeout: float, mounts: Mounts | None = None,
            **kwargs) -> subprocess.CompletedProcess:
        """Run a short command on this machine (with ``mounts``, as :meth:`argv`) and wait for it
        (at most ``timeout`` seconds)."""
        return subprocess.run(self.argv(argv, mounts), capture_output=True, text=True, timeout=timeout, **kwargs)

    def link_counters(self) -> LinkCounters:
        """The kernel's counters of this machine's ``interface`` now (what ``ip -s link``
        shows): whole frames, Ethernet header included, as the veth passed them."""
        names = LinkCounters._fields
        paths = [f"/sys/class/net/{self.interface}/statistics/{name}" for name in names]
        read = subprocess.run(["ip", "netns", "exec", self.netns, "cat", *paths], capture_output=True, text=True,
                              timeout=HANG_S, check=True)
        return LinkCounters(*(int(word) for word in read.stdout.split()))


class LinkCounters(NamedTuple):
    """A link's counters (see :meth:`Machine.link_counters`); subtract two for what passed between."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: LinkCounters) -> LinkCounters:  # type: ignore[override]
        return LinkCounters(*(a - b for a, b in zip(self, other)))


@dataclass
class Process:
    """A command running on one machine; its stdout and stderr go to files."""

    machine: Machine
    popen: subprocess.Popen
    stdout_path: Path
    stderr_path: Path
    #: set when the harness stopped it (another machine failed, or the wait ran out)
    stopped: str = ""

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


@dataclass
class Job:
    """Commands started together, one per machine (see :meth:`Cluster.run`)."""

    processes: list[Process]
    started: float = field(default_factory=time.monotonic)

    def wait(self, timeout: float, stop_on_failure: bool = True) -> Job:
        """Wait until every process has exited, at most ``timeout`` seconds.

        With ``stop_on_failure``, the first process that exits non-zero ends the wait: the
        others are stopped (their machines' processes killed), so that a job whose machine
        failed does not sit in the others' timeouts. Processes still running at the deadline
        are stopped too. Never raises for a failure: read :meth:`returncodes` and :meth:`report`.
        """
        deadline = time.monotonic() + timeout
        while True:
            pending = [p for p in self.processes if p.returncode is None]
            failed = [p for p in self.processes if p.returncode not in (None, 0)]
            if not pending:
                return self
            if failed and stop_on_failure:
                self.stop(f"stopped by the harness: {failed[0].machine.hostname} exited {failed[0].returncode}")
                return self
            if time.monotonic() >= deadline:
                self.stop(f"stopped by the harness: still running after {timeout:.0f} s")
                return self
            try:
                pending[0].popen.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass

    def stop(self, why: str) -> None:
        """Kill every process of each machine still running a command of this job."""
        for process in self.processes:
            if process.returncode is None:
                process.stopped = why
                kill_namespace_processes(process.machine.netns)
                process.popen.kill()
        for process in self.processes:
            process.popen.wait(timeout=HANG_S)

    def returncodes(self) -> list[int | None]:
        return [p.returncode for p in self.processes]

    def stdout(self) -> str:
        return "".join(p.stdout() for p in self.processes)

    def seconds(self) -> float:
        return time.monotonic() - self.started

    def report(self, tail: int = 3000) -> str:
        """Each machine's exit status and the ends of its output, for assertion messages."""
        parts = []
        for p in self.processes:
            parts.append(f"=== {p.machine.hostname} ({p.machine.address}): exit {p.returncode} {p.stopped}")
            parts.append(f"--- stdout\n{p.stdout()[-tail:]}")
            parts.append(f"--- stderr\n{p.stderr()[-tail:]}")
        return "\n".join(parts)


@dataclass
class Cluster:
    """Machines on one bridge (see :func:`machines`)."""

    machines: list[Machine]
    switch: str
    logs: Path
    jobs: list[Job] = field(default_factory=list)

    def run(self, commands: Mapping[Machine, Sequence[str]], env: Mapping[str, str] | None = None,
            cwd: Path = ROOT, mounts: Mapping[Machine, Mounts] | None = None) -> Job:
        """Start ``commands`` (one argv per machine) at once; returns the running :class:`Job`.
        ``mounts``: a machine's bind mounts (see :meth:`Machine.argv`), e.g. each machine's own
        directory at one path (``{m: {"/ckpt": tmp / m.hostname} for m in machines}``)."""
        processes = []
        number = len(self.jobs)
        for machine, argv in commands.items():
            out = self.logs / f"job{number}-{machine.hostname}.out"
            err = self.logs / f"job{number}-{machine.hostname}.err"
            with open(out, "w") as out_file, open(err, "w") as err_file:
                popen = subprocess.Popen(machine.argv(argv, (mounts or {}).get(machine)), cwd=cwd,
                                         env=dict(env if env is not None else os.environ),
                                         stdin=subprocess.DEVNULL, stdout=out_file, stderr=err_file,
                                         start_new_session=True)
            processes.append(Process(machine, popen, out, err))
        job = Job(processes)
        self.jobs.append(job)
        return job

    def shape(self, machine: Machine, rate: str | None, burst: str = "64kb", latency: str = "500ms") -> None:
        """Limit ``machine``'s link to ``rate`` each way (``tc`` syntax, e.g. ``"10mbit"``) with
        a token bucket on both of its veth ends (``tbf``: ``burst`` bytes at once, packets
        queued up to ``latency``; it adds no delay of its own, and ``netem``, which would, is not
        available everywhere); ``None`` removes the limit."""
        for netns, device in ((machine.netns, machine.interface), (self.switch, machine.switch_port)):
            subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", device, "root"],
                           capture_output=True, timeout=HANG_S)
            if rate is not None:
                subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", device, "root", "tbf",
                                "rate", rate, "burst", burst, "latency", latency],
                               capture_output=True, text=True, timeout=HANG_S, check=True)

    def stop_all(self) -> None:
        for job in self.jobs:
            if any(p.returncode is None for p in job.processes):
                job.stop("stopped by the harness: the cluster was taken down")


def hosts_file(me: Machine, everyone: Sequence[Machine], self_on_loopback: bool) -> str:
    """The ``/etc/hosts`` of ``me``: Debian's layout (own name on 127.0.1.1) or its own address."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    for other in everyone:
        if other is me:
            lines.append(f"{DEBIAN_SELF_ADDRESS if self_on_loopback else me.address}\t{me.hostname}")
        else:
            lines.append(f"{other.address}\t{other.hostname}")
    return "\n".join(lines) + "\n"


@contextmanager
def machines(count: int, *, self_on_loopback: bool = True, hostname: str = "machine") -> Iterator[Cluster]:
    """``count`` machines on one bridge, removed on exit (also when the body raises).

    Machine ``i`` has hostname ``f"{hostname}{i}"``, address ``10.42.0.{i + 1}`` on ``eth0``,
    and a hosts file naming every machine; with ``self_on_loopback`` (the default: Debian's and
    Ubuntu's layout) its own name is on 127.0.1.1, else on its own address. Removes what earlier
    runs that died left behind first (:func:`sweep_stale`).
    """
    if not 1 <= count <= 200:
        raise ValueError(f"count must be in [1, 200], got {count!r}")
    sweep_stale()
    base = f"{PREFIX}{os.getpid()}-{next(_counter)}"
    switch = f"{base}-sw"
    made: list[str] = []
    logs = Path(tempfile.mkdtemp(prefix=f"{base}-logs-"))
    cluster = Cluster([], switch, logs)
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        _ip("-n", switch, "link", "set", "lo", "up")
        for i in range(count):
            netns = f"{base}-m{i}"
            machine = Machine(i, f"{hostname}{i}", netns, f"{SUBNET}.{i + 1}", "eth0", f"m{i}")
            _ip("netns", "add", netns)
            made.append(netns)
            _ip("link", "add", machine.interface, "netns", netns, "type", "veth",
                "peer", "name", machine.switch_port, "netns", switch)
            _ip("-n", switch, "link", "set", machine.switch_port, "master", "br0")
            _ip("-n", switch, "link", "set", machine.switch_port, "up")
            _ip("-n", netns, "addr", "add", f"{machine.address}/{PREFIX_LEN}", "dev", machine.interface)
            _ip("-n", netns, "link", "set", machine.interface, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            cluster.machines.append(machine)
        for machine in cluster.machines:
            etc = Path("/etc/netns") / machine.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file(machine, cluster.machines, self_on_loopback))
        yield cluster
    finally:
        cluster.stop_all()
        for namespace in reversed(made):
            _remove_namespace(namespace)
        shutil.rmtree(logs, ignore_errors=True)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any network or torchrun variables, ``PYTHONPATH``
    the repository, plus ``extra``: what a user's shell on a fresh machine would have."""
    env = {k: v for k, v in os.environ.items() if k not in NETWORK_VARIABLES + TORCHRUN_VARIABLES}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env
