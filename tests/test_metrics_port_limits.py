"""A service's metrics port (pdserve/telemetry.py) is bounded: a connection that sends nothing
is closed after METRICS_IDLE_TIMEOUT_S, and past METRICS_MAX_CONNECTIONS_PER_PEER from one
address or METRICS_MAX_CONNECTIONS from all a further one is closed unread, while scrapes are
served (over real sockets, in this process)."""

from __future__ import annotations

import resource
import socket
import time
import urllib.error
import urllib.request

import pytest

from pdserve import telemetry

#: How long a check waits for what it expects.
WITHIN_S = 10.0


def _scrape(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WITHIN_S) as resp:
        resp.read()
        return resp.status


def _idle(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WITHIN_S)


def _closed_by_server(s: socket.socket) -> bool:
    """True when the server closes ``s`` within WITHIN_S (recv sees the end)."""
    try:
        return s.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_an_idle_connection_is_closed_and_scrapes_are_served(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(telemetry, "METRICS_IDLE_TIMEOUT_S", 0.3)
    port = telemetry.serve_metrics(0, key="")
    with _idle(port) as idle, _idle(port) as partial:
        partial.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        assert _scrape(port) == 200
        assert _closed_by_server(idle) and _closed_by_server(partial)


def test_connections_past_the_caps_are_closed_at_once(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(telemetry, "METRICS_MAX_CONNECTIONS", 3)
    monkeypatch.setattr(telemetry, "METRICS_MAX_CONNECTIONS_PER_PEER", 2)
    monkeypatch.setattr(telemetry, "METRICS_IDLE_TIMEOUT_S", 60.0)
    port = telemetry.serve_metrics(0, key="")
    held = [_idle(port), _idle(port)]  # 127.0.0.1's 2
    with _idle(port) as third:
        assert _closed_by_server(third)  # long before the 60 s idle deadline
    other = socket.create_connection(("127.0.0.1", port), WITHIN_S, ("127.0.0.2", 0))
    held.append(other)  # another address is served: the 3rd of all together
    with socket.create_connection(("127.0.0.1", port), WITHIN_S, ("127.0.0.3", 0)) as fourth:
        assert _closed_by_server(fourth)  # all together at 3
    held.pop(0).close()  # a slot of 127.0.0.1 frees up once the server sees it closed
    deadline = time.monotonic() + WITHIN_S
    while True:
        try:
            assert _scrape(port) == 200
            break
        except (OSError, urllib.error.URLError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    for s in held:
        s.close()


def test_the_cap_is_at_most_an_eighth_of_the_descriptor_limit(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (1024, 20000))
    assert telemetry.metrics_connection_cap() == 128
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (20000, 20000))
    assert telemetry.metrics_connection_cap() == telemetry.METRICS_MAX_CONNECTIONS == 1024
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (resource.RLIM_INFINITY,) * 2)
    assert telemetry.metrics_connection_cap() == 1024
