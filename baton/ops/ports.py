"""Loopback ports for the processes Baton starts (the launcher's engines and metrics, tests).

A port taken from `bind(port 0)` lies in the OS's ephemeral range, the range every outgoing
TCP connection on the host draws its local port from. Between the moment a caller learns such a
port and the moment the child it starts binds it, any process's `connect` (a Redis client, a
NIXL agent, an HTTP probe) can take it, and the child dies with "Address already in use" (the
suite saw this on a busy machine: a completion engine's metrics port, a data-parallel rank's
`port + 1`). So `free_port` picks below the ephemeral range, where only listeners live, at a
random port from the OS's entropy (two test workers seeded alike must not pick alike) that it
can bind now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RNG = random.SystemRandom()
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # below are the well-known and registered services people run by hand
_TRIES = 200


def ephemeral_range() -> tuple[int, int]:
    """The OS's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(x) for x in _RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def listener_range() -> tuple[int, int]:
    """[low, high) for listeners that pick their own port (ZMQ's `bind_to_random_port`, whose
    default 49152-65536 overlaps Linux's ephemeral range): below the ephemeral range. A
    restarted engine binds the port it had (its address stays), and while it is down its
    peers keep reconnecting to that port; in the ephemeral range such a connect can draw the
    port itself as its local port and connect to itself (TCP simultaneous open), holding the
    port the restart needs."""
    low, high = ephemeral_range()
    return (_LOWEST, low) if low - _LOWEST > 1000 else (high + 1, 65536)


def port_is_free(host: str, port: int) -> bool:
    """True when a listener could bind `host:port` now (SO_REUSEADDR, as servers bind)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A port p such that p .. p + span - 1 are all free to bind now, outside the ephemeral
    range where it can be; `span` > 1 for a process that binds consecutive ports (the
    data-parallel ranks bind `port + rank`)."""
    lowest, top = listener_range()
    top -= span
    if top > lowest:
        for _ in range(_TRIES):
            port = _RNG.randrange(lowest, top)
            if all(port_is_free(host, p) for p in range(port, port + span)):
                return port
    for _ in range(_TRIES):  # no room below the range (a host that widened it): the OS's pick
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if all(port_is_free(host, p) for p in range(port, port + span)):
            return port
    raise OSError(f"no {span} consecutive free port(s) on {host}")
