"""The bytes per training step that ``make demo``'s job prints, against what the link carried.

Two simulated machines (tests/_machines.py), each running its own torchrun with the guide's
static two-machine pair (tutorials/torchrun.md) and the demo as the job: machine0 (node rank 0)
holds ranks 0-1, the two servers; machine1 the two trainers. Every byte between trainers and
servers crosses machine0's veth, and nothing else does once the world has formed (the trainers'
DDP all-reduce stays on machine1; the static rendezvous polls no store). The kernel's counters
of machine0's ``eth0`` (``/sys/class/net/eth0/statistics``, what ``ip -s link`` shows): received,
the trainers' messages to the servers; sent, the servers' answers.

What is not per step is taken out by two runs of different lengths: world formation, table
creation, the held-out scoring and the shutdown are the same in both, so the difference of the
counters over the difference of the steps is what a step carries. rpc_backend's heartbeats,
which would add bytes per second rather than per step, are off
(``RPC_BACKEND_LOST_AFTER_S=off``). The demo counts its calls' payload (pickles and tensor
bytes, rpc_backend/traffic.py); the link carries that plus TensorPipe's framing, TCP/IP and
Ethernet headers and acknowledgements: each direction must agree within 10% of the link's
count. Bytes do not depend on speed; nothing here times anything. Needs root, ``ip`` and
``unshare``; skips with the reason elsewhere (CI runs as root).
"""

import re

import pytest

from tests import _machines
from tests._deadlines import HANG_S, SETUP_S
from tests.test_torchrun import COMMANDS, _argv

#: two jobs, each a world formed (SETUP_S) and a short run
JOB_S = SETUP_S + HANG_S
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * JOB_S + 300)]

PORT = "29400"
SHORT, LONG = 20, 60  # training steps of the two runs
AGREE = 0.10  # the demo's bytes per step against the link's, relative to the link's


def demo_commands(cluster: _machines.Cluster, steps: int, extra: str = "") -> dict:
    """The guide's static pair (node rank 0 on machine0) running the demo for ``steps`` steps."""
    m0, m1 = cluster.machines
    job = f"-m remote_module.demos.dlrm --servers 2 --steps {steps} --no-progress --plot '' {extra}".strip()
    return {machine: _argv(command.replace("tutorials/torchrun_job.py", job), HOST0=m0.hostname, PORT=PORT)
            for machine, command in zip((m0, m1), COMMANDS[1:])}


def printed_bytes(out: str) -> tuple[float, float]:
    """The summary's bytes per training step, all trainers: (to the servers, from them)."""
    at = out.index("network between trainers and servers, per training step")
    line = next(line for line in out[at:].splitlines() if line.strip().startswith("all trainers"))
    to, back = (float(word.replace(",", "")) for word in line.split()[2:4])
    return to, back


def test_the_demo_bytes_per_step_agree_with_the_veth_counters(two, tmp_path):
    servers_machine = two.machines[0]
    env = _machines.clean_env(RPC_BACKEND_LOST_AFTER_S="off")
    link, printed = {}, {}
    for steps in (SHORT, LONG):
        before = servers_machine.link_counters()
        job = two.run(demo_commands(two, steps), env=env, cwd=tmp_path).wait(JOB_S)
        link[steps] = servers_machine.link_counters() - before
        assert job.returncodes() == [0, 0], job.report()
        out = job.stdout()
        assert re.search(r"trainer0 +\d", out) and "ps0" in out, job.report()
        printed[steps] = printed_bytes(out)
    per_step = (link[LONG] - link[SHORT])
    steps = LONG - SHORT
    link_to, link_from = per_step.rx_bytes / steps, per_step.tx_bytes / steps
    to, back = printed[LONG]
    figures = (f"per step: to the servers {to:,.0f} B printed, {link_to:,.0f} B on the link; from them {back:,.0f} "
               f"B printed, {link_from:,.0f} B on the link; packets per step in {per_step.rx_packets / steps:.1f}, "
               f"out {per_step.tx_packets / steps:.1f}; runs {printed}")
    assert abs(to - link_to) <= AGREE * link_to, figures
    assert abs(back - link_from) <= AGREE * link_from, figures
    # the link carries the payload and more (framing), never less
    assert to < link_to and back < link_from, figures
