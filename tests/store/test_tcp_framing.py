"""How the tcp data port and the control wire take their byte streams apart: the node's
buffered request reader (one receive for a header and its table, bytes that came along kept
for what follows) and the wire's frame reader."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import numpy as np
import pytest

from pdserve.store.segment import SegmentMemory, shm_name
from pdserve.store.transports import tcp, tcp_server
from pdserve.store.wire import FrameReader

SEG_BYTES = 1 << 20


@pytest.fixture
def node():
    """An in-process tcp server over one segment, data tokens off (any in-bounds range)."""
    seg_id = f"framing-{uuid.uuid4().hex[:8]}-seg0"
    seg = SegmentMemory.create(seg_id, shm_name(seg_id), SEG_BYTES)
    seg.mm[:] = np.arange(SEG_BYTES, dtype=np.uint32).astype(np.uint8).tobytes()
    srv = tcp_server.TcpServer()
    srv.start([seg])
    srv.set_data_key(seg_id, b"")
    yield srv, seg
    srv.stop()
    seg.unlink()


def _head(op: int, count: int) -> bytes:
    return tcp.REQ.pack(tcp.REQ_MAGIC, tcp.VERSION, op, 0, 0, 0, count)


def _table(seg: int, ranges: list[tuple[int, int]]) -> bytes:
    return b"".join(tcp.RANGE.pack(seg, off, n, *tcp.NO_GRANT) for off, n in ranges)


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, "the node closed the connection"
        out += chunk
    return out


def _reply(s: socket.socket, payload: int) -> bytes:
    magic, status, n = tcp.REP.unpack(_recv_exactly(s, tcp.REP.size))
    assert (magic, status, n) == (tcp.REP_MAGIC, tcp.ST_OK, payload)
    return _recv_exactly(s, payload)


def test_a_request_dribbled_a_byte_at_a_time_is_served(node) -> None:
    srv, seg = node
    key = tcp.segment_key(seg.segment_id)
    request = _head(tcp.OP_READV, 2) + _table(key, [(10, 100), (5000, 7)])
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(len(request)):
            s.sendall(request[i : i + 1])
            if i % 16 == 0:
                time.sleep(0.001)  # separate segments, so the node sees partial reads
        assert _reply(s, 107) == bytes(seg.mm[10:110]) + bytes(seg.mm[5000:5007])


def test_pipelined_requests_in_one_send_are_answered_in_order(node) -> None:
    """Bytes read ahead past one request are the start of the next: a write whose payload
    came with its header, then reads, all in one send."""
    srv, seg = node
    key = tcp.segment_key(seg.segment_id)
    payload = bytes(range(256)) * 3
    stream = (
        _head(tcp.OP_READV, 1)
        + _table(key, [(0, 16)])
        + _head(tcp.OP_WRITEV, 1)
        + _table(key, [(4096, len(payload))])
        + tcp.writev_pad(1)
        + payload
        + _head(tcp.OP_READV, 1)
        + _table(key, [(4096, len(payload))])
    )
    before = bytes(seg.mm[:16])
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(stream)
        assert _reply(s, 16) == before
        _magic, status, n = tcp.REP.unpack(_recv_exactly(s, tcp.REP.size))
        assert (status, n) == (tcp.ST_OK, len(payload))  # the write's answer
        assert _reply(s, len(payload)) == payload
    assert bytes(seg.mm[4096 : 4096 + len(payload)]) == payload


def test_a_table_larger_than_the_read_ahead_buffer_is_served(node) -> None:
    srv, seg = node
    key = tcp.segment_key(seg.segment_id)
    count = tcp_server.READ_AHEAD // tcp.RANGE.size * 3
    ranges = [(i * 64, 8) for i in range(count)]
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(_head(tcp.OP_READV, count) + _table(key, ranges))
        got = _reply(s, 8 * count)
    assert got == b"".join(bytes(seg.mm[o : o + n]) for o, n in ranges)


def test_frame_reader_splits_and_joins_receives() -> None:
    a, b = socket.socketpair()
    reader = FrameReader(b)
    big = bytes(range(256)) * (FrameReader.SIZE // 128)  # larger than the buffer
    sent = b"head" + b"x" * 10 + big + b"tail"

    def send() -> None:
        for i in range(0, len(sent), 7000):
            a.sendall(sent[i : i + 7000])
        a.close()

    th = threading.Thread(target=send)
    th.start()
    try:
        assert reader.read(4) == b"head"
        assert reader.read(10) == b"x" * 10
        assert bytes(reader.read(len(big))) == big
        assert reader.read(4) == b"tail"
        with pytest.raises(ConnectionResetError):
            reader.read(1)
    finally:
        th.join()
        b.close()


def test_a_vector_read_mixes_memory_and_disk_segments_byte_exact(node, tmp_path) -> None:
    """A disk segment's ranges are sent from its file (sendfile), a memory segment's from its
    mapping, in the order asked, in one reply; the disk bytes were written through the file
    (as the node's tier copies are), never through the mapping."""
    _srv, mem = node
    disk_id = f"framing-{uuid.uuid4().hex[:8]}-disk0"
    disk = SegmentMemory.create(disk_id, disk_id, SEG_BYTES, directory=tmp_path)
    assert disk.on_disk
    data = np.random.default_rng(7).integers(0, 256, SEG_BYTES, dtype=np.uint8).tobytes()
    disk.write(0, memoryview(data))
    srv2 = tcp_server.TcpServer()
    srv2.start([mem, disk])
    srv2.set_data_key(mem.segment_id, b"")
    srv2.set_data_key(disk_id, b"")
    mkey, dkey = tcp.segment_key(mem.segment_id), tcp.segment_key(disk_id)
    ranges = [(dkey, 3, 5000), (mkey, 10, 100), (dkey, 700_000, 300_000), (dkey, 0, 1)]
    request = _head(tcp.OP_READV, len(ranges)) + b"".join(
        tcp.RANGE.pack(seg, off, n, *tcp.NO_GRANT) for seg, off, n in ranges
    )
    try:
        with socket.create_connection(("127.0.0.1", srv2.port), timeout=5) as s:
            s.sendall(request)
            got = _reply(s, sum(n for _s, _o, n in ranges))
            s.sendall(_head(tcp.OP_READV, 1) + _table(dkey, [(SEG_BYTES - 9, 9)]))
            tail = _reply(s, 9)
    finally:
        srv2.stop()
        os.close(disk.fd)  # the mapping the server still views stays valid
    want = data[3:5003] + bytes(mem.mm[10:110]) + data[700_000:1_000_000] + data[:1]
    assert got == want
    assert tail == data[-9:]
