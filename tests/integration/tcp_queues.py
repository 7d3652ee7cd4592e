"""Bytes waiting unread in a process's TCP receive queues, by the process that sent them
(Linux /proc). A stopped process cannot read: bytes a peer sent it and it has not read are a
request it holds and has not answered. The fault matrix uses this to prove that a frozen
storage node, store master or Redis really holds a request from the serving path when the
fault lands (tests/integration/test_fault_matrix.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_ESTABLISHED, _LISTEN = "01", "0A"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


@dataclass(frozen=True)
class _Sock:
    local: str  # "127.0.0.1:8080"
    remote: str
    state: str  # /proc's hex state: 01 established, 0A listening
    unread: int  # bytes in the receive queue
    inode: str  # "0" for a connection still in a listener's accept queue


def _tcp_table() -> list[_Sock]:
    socks = []
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            f = line.split()
            if len(f) > 9:
                socks.append(_Sock(_endpoint(f[1]), _endpoint(f[2]), f[3],
                                   int(f[4].split(":")[1], 16), f[9]))
    return socks


def _endpoint(hex_addr: str) -> str:
    """'0100007F:1F90' (or its IPv6 / v4-mapped form) -> '127.0.0.1:8080'."""
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 16:  # /proc writes IPv6 as four little-endian words; v4-mapped -> IPv4
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        if raw[:12] != b"\0" * 10 + b"\xff\xff":
            return f"[{raw.hex()}]:{int(port, 16)}"
        raw = raw[12:]
    else:
        raw = raw[::-1]
    return f"{'.'.join(str(b) for b in raw)}:{int(port, 16)}"


def unread_by_sender(target_pid: int, peers: dict[str, int], min_bytes: int = 1
                     ) -> dict[str, int]:
    """{peer name: bytes it sent `target_pid` that wait unread there}, for the `peers`
    (name -> pid) that sent at least `min_bytes`. Counts the target's own connections and
    those still in its listeners' accept queues (a stopped process accepts nothing either)."""
    table = _tcp_table()
    mine = _socket_inodes(target_pid)
    listening = {s.local for s in table if s.state == _LISTEN and s.inode in mine}
    owner = {}  # a peer's local endpoint -> the peer's name
    for name, pid in peers.items():
        theirs = _socket_inodes(pid)
        owner.update((s.local, name) for s in table if s.inode in theirs)
    out: dict[str, int] = {}
    for s in table:
        held = s.inode in mine or (s.inode == "0" and s.local in listening)
        if s.state == _ESTABLISHED and held and s.unread and s.remote in owner:
            out[owner[s.remote]] = out.get(owner[s.remote], 0) + s.unread
    return {name: n for name, n in out.items() if n >= min_bytes}


def listening_endpoints(pid: int) -> set[str]:
    """The endpoints ("127.0.0.1:8080") that process `pid` listens on."""
    mine = _socket_inodes(pid)
    return {s.local for s in _tcp_table() if s.state == _LISTEN and s.inode in mine}
