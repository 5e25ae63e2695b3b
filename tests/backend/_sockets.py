"""Listing the TCP sockets this process listens on (Linux /proc), for the loopback test."""

import ipaddress
import os
import socket
import struct

import torch.distributed.rpc as rpc


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _decode(hex_addr: str, family: int) -> str:
    raw = bytes.fromhex(hex_addr)
    if family == socket.AF_INET:
        return socket.inet_ntop(family, struct.pack("<I", int(hex_addr, 16)))
    # /proc stores IPv6 as four little-endian 32-bit words
    words = struct.unpack("<4I", raw)
    return socket.inet_ntop(family, struct.pack(">4I", *words))


def parent_of(pid: int) -> int:
    """The parent pid of process ``pid`` (Linux: from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def listening_addresses(pid: int | None = None) -> list[str]:
    """``ip:port`` of every TCP socket in LISTEN state owned by ``pid`` (default: this process)."""
    inodes = _socket_inodes(os.getpid() if pid is None else pid)
    found = []
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                addr, port = local.split(":")
                found.append(f"{_decode(addr, family)}:{int(port, 16)}")
    return found


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    ip = ipaddress.ip_address(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def rank_report() -> dict:
    """Runs on every rank of a local world after a round of traffic."""
    me = rpc.get_worker_info()
    peer = (me.id + 1) % rpc.api._get_current_rpc_agent().get_worker_infos().__len__()
    rpc.rpc_sync(peer, os.getpid)  # make sure connections exist
    return {"name": me.name, "listening": listening_addresses()}
