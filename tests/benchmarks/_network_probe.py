"""The network benchmark's probes of a link (tests/benchmarks/bench_network.py), run on the
simulated machines; each prints one JSON line.

    python -m tests.benchmarks._network_probe tcp-serve PORT             # serves the two below, exits
    python -m tests.benchmarks._network_probe tcp-probe HOST PORT BYTES  # round trips, then BYTES one way
    torchrun ... -m tests.benchmarks._network_probe rpc CALLS            # 2 ranks: rank 0 calls rank 1

* TCP round trip: one byte each way, ``ROUND_TRIPS`` times on one connection (``TCP_NODELAY``),
  the median;
* TCP throughput: ``BYTES`` sent one way on a fresh connection, timed from the first byte sent
  to the receiver's one-byte answer that it has them all;
* RPC round trip: an empty ``rpc_sync`` from rank 0 to rank 1 (a world of two formed by
  ``rpc_backend.init_from_env``, heartbeats as the environment says), ``CALLS`` times after a
  warm-up, the median.
"""

from __future__ import annotations

import json
import socket
import statistics
import struct
import sys
import time

ROUND_TRIPS = 2000
CHUNK = 1 << 16


def _exactly(conn: socket.socket, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        part = conn.recv(min(CHUNK, n - len(got)))
        if not part:
            raise ConnectionError(f"the peer closed after {len(got)} of {n} bytes")
        got += part
    return bytes(got)


def tcp_serve(port: int) -> None:
    """Answer one round-trip connection (echo each byte until the peer closes) and one bulk
    connection (an 8-byte length, then that many bytes, answered b"k"), then exit."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", port))
        listener.listen()
        print(json.dumps({"listening": port}), flush=True)
        for _ in range(2):
            conn, _ = listener.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                kind = _exactly(conn, 1)
                if kind == b"p":
                    while byte := conn.recv(1):
                        conn.sendall(byte)
                else:
                    (left,) = struct.unpack("!Q", _exactly(conn, 8))
                    while left:
                        part = conn.recv(min(CHUNK, left))
                        if not part:
                            raise ConnectionError("the peer closed mid-transfer")
                        left -= len(part)
                    conn.sendall(b"k")


def tcp_probe(host: str, port: int, nbytes: int) -> dict:
    with socket.create_connection((host, port), timeout=300) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(b"p")
        times = []
        for _ in range(ROUND_TRIPS):
            t0 = time.perf_counter()
            conn.sendall(b"x")
            _exactly(conn, 1)
            times.append(time.perf_counter() - t0)
    payload = b"\0" * CHUNK
    with socket.create_connection((host, port), timeout=300) as conn:
        t0 = time.perf_counter()
        conn.sendall(b"b" + struct.pack("!Q", nbytes))
        left = nbytes
        while left:
            conn.sendall(payload[:min(CHUNK, left)])
            left -= min(CHUNK, left)
        _exactly(conn, 1)
        seconds = time.perf_counter() - t0
    return {"tcp_round_trip_us": statistics.median(times) * 1e6, "tcp_MB_per_s": nbytes / seconds / 1e6,
            "tcp_bytes": nbytes}


def _nothing() -> None:
    return None


def rpc_round_trip(calls: int) -> None:
    import torch.distributed.rpc as rpc

    from rpc_backend import current_worker, init_from_env

    with init_from_env(roles={"caller": 1, "callee": 1}):
        me = current_worker()
        if me.role == "caller":
            peer = me.workers("callee")[0]
            for _ in range(max(10, calls // 10)):  # warm-up: the connection, the threads
                rpc.rpc_sync(peer, _nothing)
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                rpc.rpc_sync(peer, _nothing)
                times.append(time.perf_counter() - t0)
            print(json.dumps({"rpc_round_trip_us": statistics.median(times) * 1e6, "rpc_calls": calls}), flush=True)


def main(argv: list[str]) -> None:
    what, *rest = argv
    if what == "tcp-serve":
        tcp_serve(int(rest[0]))
    elif what == "tcp-probe":
        print(json.dumps(tcp_probe(rest[0], int(rest[1]), int(rest[2]))), flush=True)
    elif what == "rpc":
        rpc_round_trip(int(rest[0]))
    else:
        raise SystemExit(f"unknown probe {what!r}: tcp-serve, tcp-probe or rpc")


if __name__ == "__main__":
    main(sys.argv[1:])
