"""The data port's and control wire's connection server under pressure: a connection cap, an
accept loop that outlives running out of file descriptors, and an idle timeout."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest

from pdserve.store.netio import ConnectionServer


def _echo(conn: socket.socket) -> None:
    while data := conn.recv(64):
        conn.sendall(data)


def _talks(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"ping")
            return s.recv(4) == b"ping"
    except OSError:
        return False


def test_connections_beyond_the_cap_are_closed_and_the_rest_served() -> None:
    server = ConnectionServer("127.0.0.1", 0, _echo, "test-cap", max_connections=2)
    try:
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        for s in held:
            s.sendall(b"hi")
            assert s.recv(2) == b"hi"
        assert not _talks(server.port)  # the third: closed on accept
        assert server.refused == 1
        held.pop().close()
        deadline = time.monotonic() + 5
        while not _talks(server.port):  # a slot is free again
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for s in held:
            s.close()
    finally:
        server.close()


@pytest.mark.slow
def test_running_out_of_descriptors_does_not_stop_accepting() -> None:
    """With RLIMIT_NOFILE low, connections beyond it fail to be accepted (EMFILE); once some
    close, new ones are accepted again (the loop used to end on the first EMFILE)."""
    script = textwrap.dedent(
        """
        import resource, socket, sys, time
        from pdserve.store.netio import ConnectionServer

        def echo(conn):
            while data := conn.recv(64):
                conn.sendall(data)

        server = ConnectionServer("127.0.0.1", 0, echo, "test-emfile")
        print(server.port, flush=True)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        sys.stdin.readline()
        server.close()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(proc.stdout.readline())
        conns = []
        for _ in range(100):  # well past the server's 64 descriptors
            try:
                conns.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            except OSError:
                break
        time.sleep(0.5)
        served = 0
        for s in conns:
            s.settimeout(0.1)
            try:
                s.sendall(b"x")
                served += s.recv(1) == b"x"
            except OSError:
                pass
        assert 0 < served < len(conns)  # the limit was hit
        for s in conns:
            s.close()
        deadline = time.monotonic() + 10
        while not _talks(port):
            assert time.monotonic() < deadline, "the server stopped accepting after EMFILE"
            time.sleep(0.1)
        assert proc.poll() is None
    finally:
        proc.stdin.close()
        proc.wait(10)


def test_a_connection_that_goes_quiet_is_closed_after_the_idle_timeout() -> None:
    """An idle pooled connection, or a peer stalled halfway through a request, holds its
    thread and descriptor for ``idle_timeout_s``, not forever."""
    server = ConnectionServer("127.0.0.1", 0, _echo, "test-idle", idle_timeout_s=0.3)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(b"hi")
            assert s.recv(2) == b"hi"
            t0 = time.monotonic()
            assert s.recv(1) == b""  # the server closed it
            assert 0.2 < time.monotonic() - t0 < 3
        assert _talks(server.port)  # new connections are still served
    finally:
        server.close()


@pytest.mark.slow
def test_the_store_client_reconnects_when_the_node_closed_an_idle_connection(cluster_factory):
    """A node closes pooled connections idle past its idle timeout; the client's next request
    on one goes out again on a fresh connection: served, no replica failover, no miss."""
    from pdserve.store import open_store
    from pdserve.store.client.reads import READ_FAILOVERS

    c = cluster_factory()
    c.add_node(transports="tcp", segment_sizes="8MiB", idle_timeout_s=0.3)
    failovers = READ_FAILOVERS.metric.labels("tcp")
    with open_store(c.address, transport="tcp") as client:
        data = bytes(range(256)) * 1024
        assert client.put("idle", data)
        assert client.get("idle") == data
        before = failovers._value.get()
        time.sleep(1.0)  # every pooled connection is closed by the node now
        for i in range(3):
            assert client.get("idle") == data
            assert client.put(f"idle-{i}", data)
            time.sleep(0.5)
        assert failovers._value.get() == before
