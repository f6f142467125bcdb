"""Free TCP port runs on the loopback interface (I/O: probes by binding).

DP ranks need consecutive ports (``base + rank``), which binding port 0 cannot give, so runs are found
by probing. Another process may take a probed port before it is used; callers then fail on bind with
a clear error, and tests simply retry on another run.
"""

from __future__ import annotations

import random
import socket

PROBE_RANGE = (20_000, 32_768)
"""Ports probed for free runs: below the usual Linux ephemeral range (32768-60999), whose ports the
kernel hands to outgoing connections at any moment, so a probed port stays free until it is bound."""

MAX_PROBES = 200
"""Attempts before giving up."""


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port_run(host: str, count: int, rng: random.Random | None = None) -> int:
    """First port of ``count`` consecutive free ports on ``host``; ``OSError`` when none is found."""
    pick = rng or random.Random()
    low, high = PROBE_RANGE
    for _ in range(MAX_PROBES):
        base = pick.randrange(low, high - count)
        if all(port_is_free(host, base + offset) for offset in range(count)):
            return base
    raise OSError(f"no run of {count} free ports found on {host}")
