"""Ports for the test servers, chosen so that they cannot race SGLang's own ports."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# SGLang's default port, which the README's commands use: tests/integration/test_newcomer.py
# serves there, so no other test server is given it.
README_PORT = 30000
_TAKEN: set[int] = {README_PORT}


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free port *below* the kernel's ephemeral range.

    SGLang picks its internal ports (NCCL/gloo rendezvous, ...) with ``bind(0)``, i.e. from the
    ephemeral range, some seconds after start. An HTTP port from that same range can be taken
    by another server's internal port before uvicorn binds it (seen in CI: ``[Errno 98]``), so
    the fixtures take theirs from below it, and never the same one twice.
    """
    lo = 20000
    # (a machine whose ephemeral range starts low still gets the restart-on-bind-race path)
    hi = max(min(_ephemeral_range()[0], 32768) - 1, lo + 1000)
    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(lo, hi)
        if port in _TAKEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _TAKEN.add(port)
        return port
    raise RuntimeError(f"no free port in [{lo}, {hi}]")
