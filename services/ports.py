"""Choosing a free TCP port for a service that will bind it a moment later.

The port is picked below the kernel's ephemeral range. A port from `bind(0)` is ephemeral, and
between choosing it and the service binding it, the kernel may hand the same number to any
outgoing connection's source port or to another server binding port 0 (gRPC, a storage node);
the service then fails to bind, or a health check talks to the wrong server. Ports below the
range are only ever taken on purpose.
"""

from __future__ import annotations

import random
import socket

_FLOOR = 10000  # below this live well-known and registered services


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port on host that is free now and outside the ephemeral range when possible."""
    rng = random.SystemRandom()  # independent across processes choosing at the same time
    low = _ephemeral_low()
    for _ in range(100):
        port = rng.randrange(_FLOOR, low) if low > _FLOOR + 100 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:  # nothing free below the range: fall back to the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]
