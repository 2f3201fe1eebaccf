"""Per-peer connection limits and the first-frame timeout of the store's socket servers (a
node's tcp data port, the master's control wire), over real sockets on loopback: one peer
address over its cap is refused while another still connects (127.0.0.2 is a second peer on
Linux loopback), and a connection that sends no complete first frame is closed in time, TLS
handshake included."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve import config, identity
from pdserve.commands import certs
from pdserve.config import ConfigError
from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.services.kvstore.master.servicer import MasterHandlers
from pdserve.services.kvstore.master.state import MasterState
from pdserve.services.kvstore.master.wire import WireServer
from pdserve.services.kvstore.node.config import NodeConfig
from pdserve.services.kvstore.node.node import _make_server
from pdserve.store.netio import ConnectionServer, PeerLimits
from pdserve.store.transports.tcp import REP, REQ, REQ_MAGIC, ST_BAD_MAGIC, VERSION
from pdserve.store.transports.tcp_server import TcpServer
from pdserve.store.wire import FRAME, HELLO, METHOD_IDS, FrameReader, WireClient
from pdserve.v1 import kvstore_pb2 as pb

OTHER_PEER = "127.0.0.2"


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


def _closed_by_server(s: socket.socket, within_s: float = 3.0) -> bool:
    """True when the server closes ``s`` (end of stream or reset) within ``within_s``."""
    s.settimeout(within_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _wait(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _served_echo(server_box: list[ConnectionServer]):
    """An echo ``serve`` whose first frame is its first line."""

    def serve(conn: socket.socket) -> None:
        first = b""
        while not first.endswith(b"\n"):
            got = conn.recv(1)
            if not got:
                return
            first += got
        server_box[0].established(conn)
        conn.sendall(first)
        while data := conn.recv(64):
            conn.sendall(data)

    return serve


@pytest.fixture
def echo() -> Iterator[ConnectionServer]:
    box: list[ConnectionServer] = []
    server = ConnectionServer(
        "127.0.0.1",
        0,
        _served_echo(box),
        "test-peers",
        max_connections_per_peer=3,
        handshake_timeout_s=0.5,
    )
    box.append(server)
    yield server
    server.close()


def _talks(port: int, source: str = "127.0.0.1") -> bool:
    try:
        with _connect(port, source) as s:
            s.sendall(b"ping\n")
            return s.recv(5) == b"ping\n"
    except OSError:
        return False


def test_peer_limits_count_per_address_and_in_all() -> None:
    limits = PeerLimits(total=3, per_peer=2)
    assert limits.admit("a") == limits.admit("a") == ""
    assert "per-peer" in limits.admit("a")
    assert limits.admit("b") == ""
    assert "3 connections open" in limits.admit("c")  # the global cap still holds
    limits.release("a")
    assert limits.held("a") == 1 and limits.held() == 2
    assert limits.admit("c") == ""
    with pytest.raises(ValueError):
        PeerLimits(total=0)


def test_a_peer_over_its_cap_is_refused_while_another_peer_connects(echo) -> None:
    held = [_connect(echo.port) for _ in range(3)]
    for s in held:
        s.sendall(b"ping\n")
        assert s.recv(5) == b"ping\n"
    extra = _connect(echo.port)  # the fourth from 127.0.0.1: closed on accept
    assert _closed_by_server(extra)
    assert echo.refused == 1
    assert _talks(echo.port, OTHER_PEER)  # another peer address is still served
    held.pop().close()
    _wait(lambda: echo.limits.held("127.0.0.1") < 3)
    assert _talks(echo.port)  # a slot of its own is free again
    for s in [*held, extra]:
        s.close()


def test_a_connection_without_a_first_frame_is_closed_after_the_timeout(echo) -> None:
    silent = _connect(echo.port)
    t0 = time.monotonic()
    assert _closed_by_server(silent)
    assert 0.4 < time.monotonic() - t0 < 3
    # a peer trickling bytes, never a whole first frame: the deadline still holds
    trickle = _connect(echo.port)
    t0 = time.monotonic()
    closed = False
    for _ in range(40):
        try:
            trickle.sendall(b"x")
        except OSError:
            closed = True
            break
        trickle.settimeout(0.05)
        try:
            if trickle.recv(1) == b"":
                closed = True
                break
        except TimeoutError:
            pass
    assert closed and time.monotonic() - t0 < 3
    assert echo.timed_out == 2
    # a connection that sent its first frame stays open past the timeout
    with _connect(echo.port) as s:
        s.sendall(b"ping\n")
        assert s.recv(5) == b"ping\n"
        assert not _closed_by_server(s, within_s=1.0)
        s.sendall(b"more")
        assert s.recv(4) == b"more"
    _wait(lambda: echo.limits.held() == 0)  # every slot was given back
    silent.close()
    trickle.close()


# --- the node's tcp data port ------------------------------------------------------------


@pytest.fixture
def tcp() -> Iterator[TcpServer]:
    server = TcpServer("127.0.0.1", 0, max_connections_per_peer=2, handshake_timeout_s=0.5)
    server.start([])
    yield server
    server.stop()


def _bad_request(s: socket.socket) -> int:
    """Sends a whole request header with a bad magic; the status the node answers."""
    s.sendall(REQ.pack(b"XXXX", VERSION, 1, 0, 0, 0, 1))
    head = b""
    while len(head) < REP.size:
        got = s.recv(REP.size - len(head))
        assert got, "the node closed without a reply"
        head += got
    return REP.unpack(head)[1]


def test_the_data_port_caps_each_peer_and_serves_the_others(tcp) -> None:
    held = [_connect(tcp.port) for _ in range(2)]
    time.sleep(0.1)
    extra = _connect(tcp.port)
    assert _closed_by_server(extra)
    with _connect(tcp.port, OTHER_PEER) as other:
        assert _bad_request(other) == ST_BAD_MAGIC  # served: its header was read and answered
    for s in [*held, extra]:
        s.close()


def test_the_data_port_closes_a_connection_stalled_before_its_first_header(tcp) -> None:
    with _connect(tcp.port) as s:
        s.sendall(REQ.pack(REQ_MAGIC, VERSION, 1, 0, 0, 0, 1)[:10])  # half a header, then nothing
        t0 = time.monotonic()
        assert _closed_by_server(s)
        assert time.monotonic() - t0 < 3


# --- the master's control wire -------------------------------------------------------------


def _wire(tls: identity.TlsFiles | None = None) -> WireServer:
    identity.configure_files(tls)
    try:
        server = WireServer(MasterHandlers(MasterState(MasterConfig())), "127.0.0.1", 0)
    finally:
        identity.configure_files(None)
    # the control wire takes netio's defaults (128 per peer, 10 s): smaller here
    server._server.limits.per_peer = 2
    server._server.handshake_timeout_s = 0.5
    return server


def test_the_control_wire_caps_each_peer_and_times_out_a_missing_hello() -> None:
    server = _wire()
    try:
        held = [_connect(server.port) for _ in range(2)]
        for s in held:
            s.sendall(HELLO)
        time.sleep(0.1)
        assert _closed_by_server(_connect(server.port))
        with _connect(server.port, OTHER_PEER) as other:  # another peer address still calls
            other.sendall(HELLO + FRAME.pack(0, METHOD_IDS["Stats"], 0))
            _length, status, _ = FRAME.unpack(FrameReader(other).read(FRAME.size))
            assert status == 0  # OK: answered
        # the two with a hello stay open past the timeout; a connection without one does not
        assert not _closed_by_server(held[0], within_s=1.0)
        held[1].close()
        _wait(lambda: server._server.limits.held("127.0.0.1") < 2)
        silent = _connect(server.port)
        assert _closed_by_server(silent)
        for s in [held[0], silent]:
            s.close()
    finally:
        server.close()


@pytest.fixture(scope="module")
def master_tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, identity.TlsFiles]:
    d = tmp_path_factory.mktemp("wire-tls")
    certs.make(d, ["master:kvstore-master", "worker:w1"], hosts=["127.0.0.1"])
    files = identity.TlsFiles.load(
        str(d / "ca.crt"), str(d / "kvstore-master.crt"), str(d / "kvstore-master.key")
    )
    return d, files


def test_the_tls_handshake_counts_toward_the_first_frame_timeout(master_tls) -> None:
    d, files = master_tls
    server = _wire(files)
    try:
        # a peer that connects and never starts its handshake
        stalled = _connect(server.port)
        t0 = time.monotonic()
        assert _closed_by_server(stalled)
        assert time.monotonic() - t0 < 3
        # a peer that completes the handshake but sends no hello
        ctx = ssl.create_default_context(cafile=str(d / "ca.crt"))
        ctx.load_cert_chain(d / "w1.crt", d / "w1.key")
        with ctx.wrap_socket(_connect(server.port), server_hostname="127.0.0.1") as tls:
            t0 = time.monotonic()
            assert _closed_by_server(tls)
            assert time.monotonic() - t0 < 3
        # a worker with its certificate calls as before; idle past the idle timeout, its
        # connection is closed (a TLS socket needs Python's timeout for that) and the next
        # call reconnects
        server._server.idle_timeout_s = 0.5
        w1 = identity.TlsFiles.load(str(d / "ca.crt"), str(d / "w1.crt"), str(d / "w1.key"))
        client = WireClient("127.0.0.1", server.port, timeout_s=5, tls=w1)
        assert client.call("Stats", pb.StatsRequest()) is not None
        _wait(lambda: server._server.limits.held() == 1)
        _wait(lambda: server._server.limits.held() == 0)  # closed by the server, idle
        assert client.call("Stats", pb.StatsRequest()) is not None
        client.close()
        stalled.close()
    finally:
        server.close()


def test_the_node_config_sets_the_data_ports_limits() -> None:
    def node(**fields: object) -> NodeConfig:
        return config.load(NodeConfig, "kvstore_node", env={}, overrides=fields)

    default = node()
    assert (default.max_connections_per_peer, default.handshake_timeout_s) == (128, 10.0)
    server = _make_server("tcp", node(max_connections_per_peer=7, handshake_timeout_s=2.5))
    assert (server.max_connections_per_peer, server.handshake_timeout_s) == (7, 2.5)
    for bad in ({"max_connections_per_peer": 0}, {"max_connections_per_peer": 5000}):
        with pytest.raises(ConfigError, match="max_connections_per_peer"):
            node(**bad)
    with pytest.raises(ConfigError, match="handshake_timeout_s"):
        node(handshake_timeout_s=0)
