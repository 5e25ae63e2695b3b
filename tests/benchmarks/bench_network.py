"""Network benchmark: what ``make demo``'s job carries per training step, and how fast it trains,
on one machine's loopback, across two simulated machines, and on links shaped to a rate.

    make bench                                        # runs this last (as root; skipped otherwise)
    sudo python -m tests.benchmarks.bench_network     # about 16 minutes on 2 loaded cores
    sudo python -m tests.benchmarks.bench_network --quick
    sudo python -m tests.benchmarks.bench_network --rates 20mbit,5mbit

Needs root, ``ip``, ``unshare`` and ``tc``: the machines are network namespaces joined by veth
pairs on a bridge (tests/_machines.py); without them it says why and exits 0.

The job: the demo (remote_module/demos/dlrm.py: 2 servers, 2 trainers, async, 128 clicks per
trainer per step) under torchrun, with rpc_backend's heartbeats off (``RPC_BACKEND_LOST_AFTER_S
=off``: they add bytes per second, not per step; tests/benchmarks/bench_watch.py measures them).
Configurations:

* ``loopback``: every rank on one machine (the guide's one-machine command,
  ``torchrun --standalone --nproc-per-node=4``);
* ``veth``: the guide's static two-machine pair, the servers on machine0 and the trainers on
  machine1, so every byte between them crosses machine0's veth;
* ``tbf RATE``: the same, every veth end shaped to RATE (``tc qdisc ... tbf``, burst
  :data:`BURST`, queue up to :data:`LATENCY`: a token bucket adds no delay of its own; ``netem``,
  which would model latency, is not available everywhere).

Figures per configuration, medians over ``repeats`` rounds whose order rotates (the machine is
shared: other work runs beside it):

* steps/s: each trainer's, as the demo prints it (of the long run), averaged over the trainers;
* payload B/step, each way, all trainers: as the demo prints it (rpc_backend.Traffic: each
  message's pickle and tensor bytes, counted at the trainers' calls);
* link B/step, each way: machine0's veth counters (Ethernet frames: TensorPipe's framing,
  TCP/IP and Ethernet headers and acknowledgements included) over two runs of ``short`` and
  ``long`` steps, differenced, so that setup and shutdown cancel out; framing: link / payload - 1;
* needs MB/s: payload (and link) bytes per step x steps/s: what the job asks of the network;
  on a shaped link, the rate's bound in steps/s (rate / the larger direction's link bytes per step);
* probes of the link itself, beside them: a TCP round trip (one byte each way), TCP throughput
  (bytes one way) and an RPC round trip (an empty ``rpc_sync`` between two ranks, one per
  machine) (tests/benchmarks/_network_probe.py).

Writes JSON (bench-network-results.json by default).
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

from tests import _machines
from tests._deadlines import HANG_S, SETUP_S
from tests.benchmarks._common import parse_args, publish
from tests.test_torchrun import COMMANDS, DLRM_COMMANDS, _argv

FULL = {"short": 30, "long": 130, "repeats": 3, "rates": ["50mbit", "10mbit"], "rpc_calls": 1000, "tcp_MB": 32}
QUICK = {**FULL, "short": 10, "long": 30, "repeats": 1, "rates": ["10mbit"], "rpc_calls": 100, "tcp_MB": 4}
BURST, LATENCY = "64kb", "500ms"
PORT = "29400"
PROBE_PORT = 29411
#: a job: its world forms, then its run
JOB_S = SETUP_S + HANG_S
#: the demo's fixed options here: a plain run, nothing written
DEMO = "-m remote_module.demos.dlrm --servers 2 --no-progress --plot ''"


def missing_requirements() -> str | None:
    """Why the machines cannot be built here (root, ``ip``, ``unshare``, ``tc``), or None."""
    reason = _machines.missing_requirements()
    if reason is None and shutil.which("tc") is None:
        reason = "shaping links needs `tc` on PATH (iproute2)"
    return reason


def rate_bytes_per_s(rate: str) -> float:
    """``tc``'s rate (``"10mbit"``, ``"1gbit"``, ``"500kbit"``) in bytes per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not match:
        raise ValueError(f"a rate such as 10mbit or 1gbit, got {rate!r}")
    return float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)] / 8


def _demo_commands(cluster: _machines.Cluster, config: str, steps: int, transport: str) -> dict:
    m0, m1 = cluster.machines
    job = f"{DEMO} --steps {steps} --transport {transport}"
    if config == "loopback":
        return {m0: _argv(DLRM_COMMANDS[0].replace("-m remote_module.demos.dlrm --servers 2", job))}
    return {machine: _argv(command.replace("tutorials/torchrun_job.py", job), HOST0=m0.hostname, PORT=PORT)
            for machine, command in zip((m0, m1), COMMANDS[1:])}


def _env() -> dict:
    return _machines.clean_env(RPC_BACKEND_LOST_AFTER_S="off")


def _qdisc_drops(cluster: _machines.Cluster) -> int:
    """Packets the token buckets dropped so far, over every shaped veth end."""
    total = 0
    for machine in cluster.machines:
        for netns, device in ((machine.netns, machine.interface), (cluster.switch, machine.switch_port)):
            shown = subprocess.run(["ip", "netns", "exec", netns, "tc", "-s", "qdisc", "show", "dev", device],
                                   capture_output=True, text=True, timeout=HANG_S).stdout
            total += sum(int(n) for n in re.findall(r"dropped (\d+)", shown))
    return total


def parse_demo(out: str) -> dict[str, float]:
    """The demo summary's figures: trainers' mean steps/s; all trainers' bytes per step each way
    and messages per step; and the MB/s they make."""
    at = out.index("network between trainers and servers, per training step")
    rates = [float(line.split()[6]) for line in out[:at].splitlines() if re.match(r"trainer\d+ ", line)]
    lines = [line.strip() for line in out[at:].splitlines()]
    total = next((line for line in lines if line.startswith("all trainers")), None)
    words = total.split()[2:] if total else next(line for line in lines if re.match(r"trainer\d+ ", line)).split()[1:]
    to, back, messages, to_rate, back_rate = (float(w.replace(",", "")) for w in words[:5])
    return {"steps_per_s": statistics.fmean(rates), "to_servers": to, "from_servers": back,
            "messages": messages, "to_MB_per_s": to_rate, "from_MB_per_s": back_rate}


def run_demo(cluster: _machines.Cluster, config: str, steps: int, transport: str, cwd: Any) -> dict:
    """One run of the demo in ``config``: its printed figures, machine0's link counters over
    the run and the packets the shaping dropped."""
    m0 = cluster.machines[0]
    before, drops = m0.link_counters(), _qdisc_drops(cluster)
    job = cluster.run(_demo_commands(cluster, config, steps, transport), env=_env(), cwd=cwd).wait(JOB_S)
    link = m0.link_counters() - before
    if any(code != 0 for code in job.returncodes()):
        raise RuntimeError(f"the demo failed in configuration {config!r}:\n{job.report()}")
    return {"steps": steps, **parse_demo(job.stdout()), "link": link._asdict(),
            "dropped": _qdisc_drops(cluster) - drops}


def _wait_for_line(process: _machines.Process, text: str) -> None:
    deadline = time.monotonic() + HANG_S
    while text not in process.stdout():
        if process.returncode is not None:
            raise RuntimeError(f"the probe exited {process.returncode} before {text!r}:\n{process.stderr()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the probe printed no {text!r} within {HANG_S} s")
        try:
            process.popen.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass


def _json_line(out: str) -> dict:
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))


def probe(cluster: _machines.Cluster, config: str, cfg: dict, rate: float | None, cwd: Any) -> dict:
    """TCP round trip and throughput, and the RPC round trip, from machine1 (the trainers')
    to machine0 (the servers'); on loopback, within machine0."""
    m0, m1 = cluster.machines
    client, host = (m0, "127.0.0.1") if config == "loopback" else (m1, m0.address)
    nbytes = cfg["tcp_MB"] * 10**6 if rate is None else min(cfg["tcp_MB"] * 10**6, int(2 * rate))
    probe_module = [sys.executable, "-m", "tests.benchmarks._network_probe"]
    server = cluster.run({m0: [*probe_module, "tcp-serve", str(PROBE_PORT)]}, env=_env(), cwd=cwd)
    _wait_for_line(server.processes[0], "listening")
    tcp = cluster.run({client: [*probe_module, "tcp-probe", host, str(PROBE_PORT), str(nbytes)]}, env=_env(),
                      cwd=cwd).wait(HANG_S)
    server.wait(HANG_S)
    if tcp.returncodes() != [0] or server.returncodes() != [0]:
        raise RuntimeError(f"the TCP probe failed ({config}):\n{tcp.report()}\n{server.report()}")
    job = f"-m tests.benchmarks._network_probe rpc {cfg['rpc_calls']}"
    if config == "loopback":
        commands = {m0: _argv(f"torchrun --standalone --nproc-per-node=2 {job}")}
    else:
        commands = {machine: _argv(command.replace("--nproc-per-node=2", "--nproc-per-node=1")
                                   .replace("tutorials/torchrun_job.py", job), HOST0=m0.hostname, PORT=PORT)
                    for machine, command in zip((m0, m1), COMMANDS[1:])}
    rpc_job = cluster.run(commands, env=_env(), cwd=cwd).wait(JOB_S)
    if any(code != 0 for code in rpc_job.returncodes()):
        raise RuntimeError(f"the RPC probe failed ({config}):\n{rpc_job.report()}")
    return {**_json_line(tcp.stdout()), **_json_line(rpc_job.stdout())}


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def summarize(name: str, rounds: list[dict], rate: float | None) -> dict:
    """One configuration's medians over its rounds (see the module docstring)."""
    longs = [r["long"] for r in rounds]
    out: dict[str, Any] = {key: _median(longs, key) for key in
                           ("steps_per_s", "to_servers", "from_servers", "messages", "to_MB_per_s", "from_MB_per_s")}
    for key in ("tcp_round_trip_us", "tcp_MB_per_s", "rpc_round_trip_us"):
        out[key] = statistics.median(r["probe"][key] for r in rounds)
    pairs = [r for r in rounds if r.get("short") is not None]
    if pairs:
        def per_step(r: dict, field: str) -> float:
            return (r["long"]["link"][field] - r["short"]["link"][field]) / (r["long"]["steps"] - r["short"]["steps"])

        out["link_to_servers"] = statistics.median(per_step(r, "rx_bytes") for r in pairs)
        out["link_from_servers"] = statistics.median(per_step(r, "tx_bytes") for r in pairs)
        out["link_packets_in"] = statistics.median(per_step(r, "rx_packets") for r in pairs)
        out["link_packets_out"] = statistics.median(per_step(r, "tx_packets") for r in pairs)
        out["framing_to"] = out["link_to_servers"] / out["to_servers"] - 1
        out["framing_from"] = out["link_from_servers"] / out["from_servers"] - 1
        # (a step's bytes are both trainers', which step at once)
        out["link_to_MB_per_s"] = out["link_to_servers"] * out["steps_per_s"] / 1e6
        out["link_from_MB_per_s"] = out["link_from_servers"] * out["steps_per_s"] / 1e6
        out["dropped"] = sum(r["long"]["dropped"] + r["short"]["dropped"] for r in pairs)
    if rate is not None and pairs:
        out["rate_bytes_per_s"] = rate
        # the steps/s (each trainer's: they step at once) the rate allows
        out["rate_bound_steps_per_s"] = rate / max(out["link_to_servers"], out["link_from_servers"])
    out["rounds"] = len(rounds)
    return out


def run(cfg: dict, transport: str) -> dict:
    configs: list[tuple[str, float | None]] = [("loopback", None), ("veth", None)]
    configs += [(f"tbf {rate}", rate_bytes_per_s(rate)) for rate in cfg["rates"]]
    rounds: dict[str, list[dict]] = {name: [] for name, _ in configs}
    with _machines.machines(2) as cluster:
        cwd = cluster.logs
        for r in range(cfg["repeats"]):
            for name, rate in configs[r % len(configs):] + configs[:r % len(configs)]:
                for machine in cluster.machines:
                    cluster.shape(machine, name.split()[1] if rate is not None else None, BURST, LATENCY)
                entry = {"probe": probe(cluster, name, cfg, rate, cwd)}
                if name != "loopback":  # (loopback: the ranks' DDP shares lo; no link to difference)
                    entry["short"] = run_demo(cluster, name, cfg["short"], transport, cwd)
                entry["long"] = run_demo(cluster, name, cfg["long"], transport, cwd)
                rounds[name].append(entry)
                print(f"round {r + 1}/{cfg['repeats']} {name}: {entry['long']['steps_per_s']:.1f} steps/s",
                      flush=True)
    rates = dict(configs)
    return {"config": {**cfg, "transport": transport, "burst": BURST, "latency": LATENCY},
            "summary": {name: summarize(name, rows, rates[name]) for name, rows in rounds.items()},
            "rounds": rounds}


def report(results: dict) -> str:
    cfg, summary = results["config"], results["summary"]
    lines = [
        "",
        f"make demo's job under torchrun: 2 servers, 2 trainers, async, 128 clicks per trainer per step; medians of "
        f"{cfg['repeats']} interleaved rounds; heartbeats off; tbf burst {cfg['burst']}, queue {cfg['latency']}",
        "payload: the demo's bytes per step, all trainers (RPC payload counted at the trainers' calls: pickles and "
        "tensor bytes); link: machine0's veth counters per step (runs of "
        f"{cfg['short']} and {cfg['long']} steps differenced: Ethernet frames, so TensorPipe's framing, TCP/IP headers "
        "and acknowledgements included); steps/s: per trainer (both step at once)",
        f"{'':<14}{'steps/s':>8}{'to servers B/step':>28}{'from servers B/step':>28}{'packets/step':>14}"
        f"{'job needs MB/s':>20}{'rate bound':>11}",
        f"{'':<14}{'':>8}{'payload':>10}{'link':>10}{'framing':>8}{'payload':>10}{'link':>10}{'framing':>8}"
        f"{'in':>7}{'out':>7}{'to':>10}{'from':>10}{'steps/s':>11}",
        "-" * 135,
    ]
    for name, s in summary.items():
        link = (f"{s['link_to_servers']:>10,.0f}{s['framing_to']:>8.1%}" if "link_to_servers" in s
                else f"{'-':>10}{'-':>8}")
        back = (f"{s['link_from_servers']:>10,.0f}{s['framing_from']:>8.1%}" if "link_from_servers" in s
                else f"{'-':>10}{'-':>8}")
        packets = (f"{s['link_packets_in']:>7.1f}{s['link_packets_out']:>7.1f}" if "link_packets_in" in s
                   else f"{'-':>7}{'-':>7}")
        bound = f"{s['rate_bound_steps_per_s']:>11.1f}" if "rate_bound_steps_per_s" in s else f"{'-':>11}"
        lines.append(f"  {name:<12}{s['steps_per_s']:>8.1f}{s['to_servers']:>10,.0f}{link}{s['from_servers']:>10,.0f}"
                     f"{back}{packets}{s['to_MB_per_s']:>10.2f}{s['from_MB_per_s']:>10.2f}{bound}")
    lines += [
        "",
        "job needs MB/s: payload bytes per step x steps/s, summed over the trainers; rate bound: the rate over the "
        "larger direction's link bytes per step (a step's bytes are both trainers': they step at once)",
        "",
        "the links' own probes (machine1 -> machine0; loopback: within machine0): TCP round trip of one byte, TCP "
        f"throughput one way (up to {cfg['tcp_MB']} MB, 2 s of a shaped rate), RPC round trip of an empty rpc_sync "
        "between two ranks",
        f"{'':<14}{'TCP rtt µs':>12}{'TCP MB/s':>10}{'RPC rtt µs':>12}{'dropped':>9}",
    ]
    for name, s in summary.items():
        dropped = f"{s['dropped']:>9}" if "dropped" in s else f"{'-':>9}"
        lines.append(f"  {name:<12}{s['tcp_round_trip_us']:>12.0f}{s['tcp_MB_per_s']:>10.1f}"
                     f"{s['rpc_round_trip_us']:>12.0f}{dropped}")
    lines.append("dropped: packets the token buckets dropped over the demo runs (a full queue; TCP resends them)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    def extra(parser: Any) -> None:
        parser.add_argument("--rates", default=None,
                            help="the shaped rates, tc syntax, comma-separated (default: "
                                 f"{','.join(FULL['rates'])}; --quick: {','.join(QUICK['rates'])})")

    args = parse_args("make demo's job over loopback, a veth and shaped links", "bench-network-results.json", argv,
                      extra=extra)
    reason = missing_requirements()
    if reason is not None:
        print(f"bench_network skipped: {reason}")
        return {}
    cfg = dict(QUICK if args.quick else FULL)
    if args.rates:
        cfg["rates"] = [rate.strip() for rate in args.rates.split(",") if rate.strip()]
        for rate in cfg["rates"]:
            rate_bytes_per_s(rate)  # checked before anything starts
    results = run(cfg, args.transport)
    return publish(results, report(results), args.json)


if __name__ == "__main__":
    main()
