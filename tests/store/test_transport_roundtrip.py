"""Transports across processes: a peer process serves a segment, this process reads and
writes it over shm, tcp and mooncake; the tcp data port survives garbage."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
from pathlib import Path

import blake3
import numpy as np
import pytest

from pdserve.store import netio
from pdserve.store.transports import tcp, tcp_client
from pdserve.store.transports.base import TransportError
from pdserve.v1 import kvstore_pb2

PEER = Path(__file__).with_name("transport_peer.py")
SEG_BYTES = 8 * 1024 * 1024


class Peer:
    def __init__(self, transports: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), transports, str(SEG_BYTES)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={"MC_TCP_BIND_ADDRESS": "127.0.0.1", "PATH": "/usr/bin:/bin"},
        )
        info = json.loads(self.proc.stdout.readline())
        self.segment = kvstore_pb2.Segment.FromString(bytes.fromhex(info["segment"]))
        self.tcp_port = info["tcp_port"]
        self.shm_name = info["shm_name"]

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def replica(self, offset: int, size: int) -> kvstore_pb2.Replica:
        return kvstore_pb2.Replica(
            node_id=self.segment.node_id,
            segment_id=self.segment.segment_id,
            offset=offset,
            size=size,
            endpoints=self.segment.endpoints,
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(10)


@pytest.fixture
def peer(request):
    p = Peer(request.param)
    yield p
    p.close()
    assert not (Path("/dev/shm") / p.shm_name).exists()


def _client(name: str):
    if name == "shm":
        from pdserve.store.transports.shm import ShmTransport

        return ShmTransport("peer-host")
    if name == "tcp":
        return tcp_client.TcpTransport()
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine not installed")
    from pdserve.store.transports.mooncake import MooncakeTransport

    return MooncakeTransport()


def _roundtrip(peer: Peer, name: str) -> None:
    t = _client(name)
    try:
        rep = peer.replica(4096, 3 * 1024 * 1024 + 17)
        assert t.usable(rep)
        data = np.random.default_rng(1).integers(0, 256, rep.size, dtype=np.uint8).tobytes()
        t.write(rep, memoryview(data))
        # The node process sees exactly these bytes.
        assert peer.ask(f"sum {rep.offset} {rep.size}") == blake3.blake3(data).hexdigest()
        # Bytes the node wrote come back through the transport.
        other = peer.replica(5 * 1024 * 1024, 100_000)
        want = peer.ask(f"fill {other.offset} {other.size} 7")
        buf = bytearray(other.size + 10)
        t.read_into(other, memoryview(buf))
        assert blake3.blake3(bytes(buf[: other.size])).hexdigest() == want
        # A small object at the very end of the segment.
        tail = peer.replica(SEG_BYTES - 1, 1)
        t.write(tail, memoryview(b"\x5a"))
        one = bytearray(1)
        t.read_into(tail, memoryview(one))
        assert one == b"\x5a"
    finally:
        t.close()


@pytest.mark.slow
@pytest.mark.parametrize("peer", ["shm"], indirect=True)
def test_transport_shm_roundtrip(peer: Peer) -> None:
    _roundtrip(peer, "shm")


@pytest.mark.slow
@pytest.mark.parametrize("peer", ["tcp"], indirect=True)
def test_transport_tcp_roundtrip(peer: Peer) -> None:
    _roundtrip(peer, "tcp")


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.parametrize("peer", ["mooncake"], indirect=True)
def test_transport_mooncake_roundtrip(peer: Peer) -> None:
    _roundtrip(peer, "mooncake")


@pytest.mark.slow
@pytest.mark.parametrize("peer", ["shm,tcp"], indirect=True)
def test_transport_shm_refuses_other_host_and_out_of_range(peer: Peer) -> None:
    from pdserve.store.transports.shm import ShmTransport

    elsewhere = ShmTransport("another-host")
    assert not elsewhere.usable(peer.replica(0, 10))
    with pytest.raises(TransportError):
        elsewhere.read_into(peer.replica(0, 10), memoryview(bytearray(10)))
    here = ShmTransport("peer-host")
    with pytest.raises(TransportError, match="outside"):
        here.write(peer.replica(SEG_BYTES - 4, 8), memoryview(b"12345678"))


def test_transport_shm_maps_only_pdserve_segment_files_of_its_own_user() -> None:
    """Segment files are 0600; a client maps no other name, no symlink and no file of
    another user, whatever a replica names."""
    import os
    import uuid

    from pdserve import errors
    from pdserve.store.segment import SHM_DIR, SegmentMemory, shm_name
    from pdserve.store.transports.shm import ShmTransport

    def rep(name: str) -> kvstore_pb2.Replica:
        ep = kvstore_pb2.Endpoint(transport=kvstore_pb2.TRANSPORT_SHM, shm_name=name, host_id="h")
        return kvstore_pb2.Replica(segment_id=name, size=1, endpoints=[ep])

    t = ShmTransport("h")
    tag = uuid.uuid4().hex[:8]
    seg = SegmentMemory.create(f"own-{tag}", shm_name(f"own-{tag}"), 4096)
    link = SHM_DIR / shm_name(f"link-{tag}")
    theirs = SHM_DIR / shm_name(f"theirs-{tag}")
    try:
        assert os.stat(SHM_DIR / seg.name).st_mode & 0o777 == 0o600
        assert t.usable(rep(seg.name)) and not t.usable(rep(shm_name(f"absent-{tag}")))
        assert t.read_many([(rep(seg.name), memoryview(bytearray(1)))]) == [None]
        for name in ("", "../shm/" + seg.name, "pdserve-kv-a/b", "other-" + tag, "pdserve-kv-"):
            with pytest.raises(TransportError, match="invalid shm name"):
                t.read_into(rep(name), memoryview(bytearray(1)))
        link.symlink_to(SHM_DIR / seg.name)
        with pytest.raises(TransportError, match="cannot map"):
            t.read_into(rep(link.name), memoryview(bytearray(1)))
        if os.getuid() == 0:  # only root can make a file of another user
            theirs.write_bytes(bytes(4096))
            os.chown(theirs, 54321, -1)
            # not usable: "auto" picks tcp for a node isolated from its clients
            assert not t.usable(rep(theirs.name))
            with pytest.raises(TransportError, match="belongs to uid 54321"):
                t.read_into(rep(theirs.name), memoryview(bytearray(1)))
            with pytest.raises(errors.FailedPrecondition, match="another user"):
                SegmentMemory.create(f"theirs-{tag}", theirs.name, 4096)
    finally:
        t.close()
        seg.unlink()
        link.unlink(missing_ok=True)
        theirs.unlink(missing_ok=True)


def _raw(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


@pytest.mark.slow
@pytest.mark.parametrize("peer", ["tcp"], indirect=True)
def test_transport_tcp_garbage_is_rejected_and_damages_nothing(peer: Peer) -> None:
    before = peer.ask("fill 0 1048576 3")
    seg_key = tcp.segment_key(peer.segment.segment_id)

    def status(reply: bytes) -> int:
        magic, st, _ = tcp.REP.unpack(reply[: tcp.REP.size])
        assert magic == tcp.REP_MAGIC
        return st

    rng = np.random.default_rng(0)
    garbage = rng.integers(0, 256, 70_000, dtype=np.uint8).tobytes()
    assert status(_raw(peer.tcp_port, garbage)) == tcp.ST_BAD_MAGIC
    cases = {
        tcp.ST_BAD_VERSION: tcp.REQ.pack(tcp.REQ_MAGIC, 9, tcp.OP_READ, 0, seg_key, 0, 10),
        tcp.ST_BAD_OP: tcp.REQ.pack(tcp.REQ_MAGIC, tcp.VERSION, 7, 0, seg_key, 0, 10),
        tcp.ST_UNKNOWN_SEGMENT: tcp.REQ.pack(tcp.REQ_MAGIC, tcp.VERSION, tcp.OP_WRITE, 0, 1, 0, 4),
        tcp.ST_OUT_OF_BOUNDS: tcp.REQ.pack(
            tcp.REQ_MAGIC, tcp.VERSION, tcp.OP_WRITE, 0, seg_key, SEG_BYTES - 2, 4
        ),
    }
    for want, head in cases.items():
        reply = _raw(peer.tcp_port, head + b"\xff" * 64)
        assert status(reply) == want
        assert len(reply) == tcp.REP.size  # nothing else after an error; connection closed
    no_grant = tcp.GRANT.pack(*tcp.NO_GRANT)
    huge = tcp.REQ.pack(tcp.REQ_MAGIC, tcp.VERSION, tcp.OP_READ, 0, seg_key, 2**64 - 1, 2**63)
    assert status(_raw(peer.tcp_port, huge + no_grant)) == tcp.ST_OUT_OF_BOUNDS
    zero = tcp.REQ.pack(tcp.REQ_MAGIC, tcp.VERSION, tcp.OP_READ, 0, seg_key, 0, 0)
    assert status(_raw(peer.tcp_port, zero + no_grant)) == tcp.ST_OUT_OF_BOUNDS
    # A header without its grant: the node waits for it, then drops the connection.
    assert _raw(peer.tcp_port, zero) == b""
    # A truncated header: the node just drops the connection.
    assert _raw(peer.tcp_port, b"PDKT\x01") == b""
    # Nothing stored was touched, and the node still serves.
    assert peer.ask("sum 0 1048576") == before
    t = tcp_client.TcpTransport()
    buf = bytearray(1048576)
    t.read_into(peer.replica(0, len(buf)), memoryview(buf))
    assert blake3.blake3(bytes(buf)).hexdigest() == before
    # The client side turns a refused request into TransportError.
    with pytest.raises(TransportError, match="range outside"):
        t.read_into(peer.replica(SEG_BYTES - 1, 2), memoryview(bytearray(2)))
    t.close()


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"\x00garbage-garbage-garbage", "malformed"),
        # A node of protocol version 2 refuses a version 3 request with its 16-byte reply
        # header and closes the connection.
        (struct.pack("<4sB3xQ", tcp.REP_MAGIC, tcp.ST_BAD_VERSION, 0), "unsupported protocol"),
        (tcp.REP_MAGIC + bytes([tcp.ST_OK]), "after 5 bytes of a 64-byte reply header"),
    ],
)
def test_transport_tcp_client_rejects_a_bad_reply(answer: bytes, error: str) -> None:
    """A "node" that answers with garbage, an older protocol's refusal or a cut header, then
    closes: the client raises TransportError that says which, never hangs."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    import threading

    def serve() -> None:
        conn, _ = srv.accept()
        conn.recv(tcp.REQ.size)
        conn.sendall(answer)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    rep = kvstore_pb2.Replica(
        segment_id="s",
        size=10,
        endpoints=[
            kvstore_pb2.Endpoint(transport=kvstore_pb2.TRANSPORT_TCP, address=f"127.0.0.1:{port}")
        ],
    )
    with pytest.raises(TransportError, match=error):
        tcp_client.TcpTransport(timeout_s=2).read_into(rep, memoryview(bytearray(10)))
    srv.close()


@pytest.mark.slow
@pytest.mark.parametrize("peer", ["tcp"], indirect=True)
def test_transport_tcp_batches_and_parallel_streams_roundtrip(peer: Peer, monkeypatch) -> None:
    """write_many / read_many: many objects per request (WRITEV / READV) and objects big
    enough to travel over parallel connections; bytes checked on both sides."""
    t = tcp_client.TcpTransport()
    rng = np.random.default_rng(11)
    sizes = [1, 4096, 70_000, 1]
    offsets = [0, 4096, 16384, 100_000]
    reps = [peer.replica(o, n) for o, n in zip(offsets, sizes, strict=True)]
    blobs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    assert (
        t.write_many([(r, memoryview(b)) for r, b in zip(reps, blobs, strict=True)]) == [None] * 4
    )
    for r, b in zip(reps, blobs, strict=True):
        assert peer.ask(f"sum {r.offset} {r.size}") == blake3.blake3(b).hexdigest()
    bufs = [bytearray(n) for n in sizes]
    assert t.read_many([(r, memoryview(b)) for r, b in zip(reps, bufs, strict=True)]) == [None] * 4
    assert [bytes(b) for b in bufs] == blobs
    # Past PARALLEL_MIN_BYTES (lowered to fit the 8 MiB segment) an object moves as
    # PARALLEL_STREAMS sub-ranges, and a batch as groups, on separate connections.
    monkeypatch.setattr(tcp_client, "PARALLEL_MIN_BYTES", 1 << 20)
    big = [peer.replica(1 << 20, 3 * (1 << 20) + 5), peer.replica(5 << 20, 700_001)]
    data = [rng.integers(0, 256, r.size, dtype=np.uint8).tobytes() for r in big]
    assert t.write_many([(r, memoryview(d)) for r, d in zip(big, data, strict=True)]) == [None] * 2
    for r, d in zip(big, data, strict=True):
        assert peer.ask(f"sum {r.offset} {r.size}") == blake3.blake3(d).hexdigest()
    out = [bytearray(r.size) for r in big]
    assert t.read_many([(r, memoryview(o)) for r, o in zip(big, out, strict=True)]) == [None] * 2
    assert [bytes(o) for o in out] == data
    one = bytearray(big[0].size)
    t.read_into(big[0], memoryview(one))
    assert bytes(one) == data[0]
    # A bad range in a batch fails that request's objects and leaves the others' bytes.
    bad = peer.replica(SEG_BYTES - 2, 4)
    errs = t.read_many([(reps[1], memoryview(bytearray(4096))), (bad, memoryview(bytearray(4)))])
    assert all(isinstance(e, TransportError) for e in errs)
    assert "range outside" in str(errs[1])
    assert peer.ask(f"sum {reps[1].offset} {reps[1].size}") == blake3.blake3(blobs[1]).hexdigest()
    t.close()


@pytest.mark.slow
@pytest.mark.parametrize("peer", ["tcp"], indirect=True)
def test_transport_tcp_vector_requests_are_checked_before_any_byte_moves(peer: Peer) -> None:
    before = peer.ask("fill 0 65536 5")
    seg_key = tcp.segment_key(peer.segment.segment_id)

    def vector(op: int, ranges: list[tuple[int, int, int]], count: int | None = None) -> int:
        head = tcp.REQ.pack(
            tcp.REQ_MAGIC, tcp.VERSION, op, 0, 0, 0, len(ranges) if count is None else count
        )
        table = b"".join(tcp.RANGE.pack(*r, *tcp.NO_GRANT) for r in ranges)
        reply = _raw(peer.tcp_port, head + table + b"\xee" * 64)
        assert len(reply) == tcp.REP.size  # an error status and nothing else
        return tcp.REP.unpack(reply)[1]

    assert vector(tcp.OP_READV, [], count=0) == tcp.ST_BAD_COUNT
    assert vector(tcp.OP_READV, [], count=tcp.MAX_RANGES + 1) == tcp.ST_BAD_COUNT
    good = (seg_key, 0, 32)
    assert vector(tcp.OP_WRITEV, [good, (seg_key, SEG_BYTES - 1, 2)]) == tcp.ST_OUT_OF_BOUNDS
    assert vector(tcp.OP_WRITEV, [good, (seg_key + 1, 0, 2)]) == tcp.ST_UNKNOWN_SEGMENT
    assert vector(tcp.OP_READV, [good, (seg_key, 0, 0)]) == tcp.ST_OUT_OF_BOUNDS
    assert peer.ask("sum 0 65536") == before  # the good first range was not written either


def test_split_groups_by_bytes() -> None:
    ranges = [(i, 0, 0, n, None) for i, n in enumerate([4, 4, 4, 4])]
    assert tcp_client._split(ranges, 2) == [ranges]  # below PARALLEL_MIN_BYTES: one stream
    big = tcp.PARALLEL_MIN_BYTES
    ranges = [(i, 0, 0, n, None) for i, n in enumerate([big // 2, big // 2, big // 2, big // 2])]
    assert tcp_client._split(ranges, 2) == [ranges[:2], ranges[2:]]
    one = [(0, 0, 0, 4 * big, None)]
    assert tcp_client._split(one, 2) == [one]


def _through_socket_pair(a: socket.socket, b: socket.socket, parts: list[bytes]) -> None:
    """Sends ``parts`` from ``a`` on a thread and receives them on ``b`` into buffers of
    their sizes; every byte must land in its buffer, in order."""
    import threading

    sender = threading.Thread(target=netio.send_parts, args=(a, list(parts)))
    sender.start()
    bufs = [bytearray(len(p)) for p in parts]
    assert netio.recv_parts(b, [memoryview(x) for x in bufs])
    sender.join(10)
    assert [bytes(x) for x in bufs] == parts


def test_send_parts_and_recv_parts_survive_partial_transfers() -> None:
    """Many small buffers through a socket pair with tiny kernel buffers: every byte lands
    in its buffer in order, whatever the kernel splits."""
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    rng = np.random.default_rng(2)
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in [1, 0, 5000, 3, 70_000]]
    parts += [bytes([i % 256]) * 7 for i in range(600)]  # more buffers than one sendmsg takes
    _through_socket_pair(a, b, parts)
    a.close()
    assert not netio.recv_parts(b, [memoryview(bytearray(1))])  # peer closed
    b.close()


def test_recv_parts_keeps_stream_order_across_buffers_longer_than_a_slice(monkeypatch) -> None:
    """Buffers longer than IO_SLICE ahead of others: a receive that fills one slice must not
    go on into the next buffer (waiting for all of them, MSG_WAITALL, it would fill every
    listed slice). The bytes land in stream order."""
    monkeypatch.setattr(netio, "IO_SLICE", 4096)
    a, b = socket.socketpair()
    rng = np.random.default_rng(3)
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in [10_000, 9000, 100, 5]]
    _through_socket_pair(a, b, parts)
    a.close()
    b.close()


def test_iov_stops_at_the_first_buffer_longer_than_a_slice(monkeypatch) -> None:
    monkeypatch.setattr(netio, "IO_SLICE", 8)
    views = [memoryview(bytearray(n)) for n in [3, 20, 4]]
    assert [len(v) for v in netio.iov(views)] == [3, 8]
    assert [len(v) for v in netio.iov(views[2:])] == [4]
    monkeypatch.setattr(netio, "IOV", 2)
    assert [len(v) for v in netio.iov([memoryview(bytearray(1))] * 3, first=1)] == [1]


@pytest.mark.slow
@pytest.mark.parametrize("peer", ["shm"], indirect=True)
def test_transport_shm_batches_copy_on_two_threads(peer: Peer) -> None:
    """A batch past PARALLEL_MIN_BYTES (and one object that large, cut in two) is copied on
    two threads; every byte lands where it belongs, on both sides."""
    from pdserve.store.transports import shm

    t = shm.ShmTransport("peer-host")
    rng = np.random.default_rng(4)
    sizes = [1_500_000, 1, 1_300_001, 1_800_000, shm.PARALLEL_MIN_BYTES + 11]
    offsets = [0, 1_600_000, 1_700_000, 3_100_000, 3 * 1024 * 1024 + 1]
    reps = [peer.replica(o, n) for o, n in zip(offsets[:4], sizes[:4], strict=True)]
    reps.append(peer.replica(SEG_BYTES - sizes[4], sizes[4]))
    assert sum(sizes[:4]) >= shm.PARALLEL_MIN_BYTES
    for batch in (reps[:4], reps[4:]):
        blobs = [rng.integers(0, 256, r.size, dtype=np.uint8).tobytes() for r in batch]
        assert t.write_many([(r, memoryview(b)) for r, b in zip(batch, blobs, strict=True)]) == [
            None
        ] * len(batch)
        for r, b in zip(batch, blobs, strict=True):
            assert peer.ask(f"sum {r.offset} {r.size}") == blake3.blake3(b).hexdigest()
        bufs = [bytearray(r.size) for r in batch]
        errs = t.read_many([(r, memoryview(b)) for r, b in zip(batch, bufs, strict=True)])
        assert errs == [None] * len(batch)
        assert [bytes(b) for b in bufs] == blobs
    t.close()


def test_transport_tcp_times_out_on_a_silent_node() -> None:
    """A node that accepts and never answers costs the client's timeout, not a hang (the
    kernel's SO_RCVTIMEO on a blocking socket)."""
    import threading
    import time

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    held = []
    threading.Thread(target=lambda: held.append(srv.accept()), daemon=True).start()
    rep = kvstore_pb2.Replica(
        segment_id="s",
        size=10,
        endpoints=[
            kvstore_pb2.Endpoint(
                transport=kvstore_pb2.TRANSPORT_TCP, address=f"127.0.0.1:{srv.getsockname()[1]}"
            )
        ],
    )
    start = time.monotonic()
    with pytest.raises(TransportError):
        tcp_client.TcpTransport(timeout_s=0.5).read_into(rep, memoryview(bytearray(10)))
    assert 0.4 < time.monotonic() - start < 3.0
    srv.close()
