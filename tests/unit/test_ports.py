"""The test servers' ports stay out of the range SGLang draws its internal ports from."""

import socket

from ports import _ephemeral_range, free_port


def test_ports_distinct_bindable_and_below_ephemeral_range():
    lo, _ = _ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports), ports
    for p in ports:
        if lo > 21000:
            assert p < lo, (p, lo)
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_port_taken_by_another_socket_is_skipped(monkeypatch):
    import random

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        # Every draw returns the held port first, then a fresh one: free_port must skip it.
        draws = iter([taken, taken] + [p for p in range(23456, 23656) if p != taken])
        monkeypatch.setattr(random.Random, "randint", lambda self, a, b: next(draws))
        held.listen()
        port = free_port()
    assert port != taken
