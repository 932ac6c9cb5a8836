"""Ports for daemons a test (or a bench) starts: the one helper every caller uses."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_FIXED_FLOOR = 20000  # below: well-known and registered services' ports


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a process that binds it a moment later (a static
    member's address must be known before it starts). Picked below the kernel's ephemeral
    range, which every outgoing connection draws its local port from: on a busy host a port
    from that range (what binding port 0 gives) was taken by someone's client connection
    before the daemon bound it ("Address already in use")."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rnd = random.Random()
    for _ in range(200 if low > _FIXED_FLOOR + 1000 else 0):
        port = rnd.randrange(_FIXED_FLOOR, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
