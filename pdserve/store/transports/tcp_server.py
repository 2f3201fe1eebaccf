"""The node side of pdserve's tcp transport (protocol: :mod:`pdserve.store.transports.tcp`):
one thread per connection, every header and range checked (bounds, then grant) before any
byte moves, payloads straight from / into the segment mapping (reads of a disk segment
straight from its file, by ``sendfile``)."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Sequence

from pdserve.store import grants
from pdserve.store.affinity import CpuFollower
from pdserve.store.netio import (
    HANDSHAKE_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS_PER_PEER,
    ConnectionServer,
    advance,
    recv_parts,
    send_file,
    send_parts,
)
from pdserve.store.segment import SegmentMemory
from pdserve.store.transports.base import TransportServer
from pdserve.store.transports.tcp import (
    FLAG_STREAM,
    GRANT,
    MAX_RANGES,
    OP_READ,
    OP_READV,
    OP_WRITE,
    OP_WRITEV,
    RANGE,
    REP,
    REP_MAGIC,
    REQ,
    REQ_MAGIC,
    ST_BAD_COUNT,
    ST_BAD_MAGIC,
    ST_BAD_OP,
    ST_BAD_VERSION,
    ST_EXPIRED,
    ST_FORBIDDEN,
    ST_OK,
    ST_OUT_OF_BOUNDS,
    ST_SHORT_PAYLOAD,
    ST_UNKNOWN_SEGMENT,
    STATUS_TEXT,
    VERSION,
    segment_key,
    tune_socket,
    writev_pad,
)
from pdserve.v1 import kvstore_pb2

log = logging.getLogger(__name__)

#: Bytes a node receives at once when it waits for a request: a header and its range table
#: (72 bytes a range) usually arrive whole.
READ_AHEAD = 4096


class FileRange:
    """A read range of a disk segment: sent from its file (``send_file``), not its mapping."""

    __slots__ = ("fd", "length", "offset")

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.fd, self.offset, self.length = fd, offset, length

    def __len__(self) -> int:
        return self.length


class _NoKeyYet:
    """The grant check of a segment whose data key the node has not learned yet (before its
    first mount answer): refuses every range."""

    @staticmethod
    def check(*_args: object) -> str:
        return "the node has no data key for the segment yet (not mounted)"


class _Reader:
    """Buffered receives of a connection's request headers and range tables: the client
    sends a header and its table in one ``sendmsg``, and one ``recv`` takes both (not one
    for each). Payloads land straight in the segment; only payload bytes that came along
    with a header (at most :data:`READ_AHEAD`) are copied from the buffer."""

    __slots__ = ("buf", "conn", "end", "fresh", "start", "view")

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.fresh = True  # no complete request header received yet
        self.buf = bytearray(READ_AHEAD)
        self.view = memoryview(self.buf)
        self.start = self.end = 0  # buffered bytes not consumed yet: buf[start:end]

    def take(self, n: int) -> memoryview | None:
        """The next ``n`` bytes, valid until the next call; None when the peer closed
        first."""
        avail = self.end - self.start
        if avail < n:
            if n > len(self.buf):  # a big range table: into a buffer of its own
                out = memoryview(bytearray(n))
                out[:avail] = self.view[self.start : self.end]
                self.start = self.end = 0
                return out if recv_parts(self.conn, [out[avail:]]) else None
            if self.start:  # what is left goes to the front
                self.buf[:avail] = self.buf[self.start : self.end]
                self.start, self.end = 0, avail
            while self.end < n:
                got = self.conn.recv_into(self.view[self.end :])
                if not got:
                    return None
                self.end += got
        self.start += n
        return self.view[self.start - n : self.start]

    def fill(self, parts: list[memoryview]) -> bool:
        """Fills ``parts`` in order (buffered bytes first); False when the peer closed
        first."""
        views = [p for p in parts if len(p)]
        while self.start < self.end and views:
            n = min(self.end - self.start, len(views[0]))
            views[0][:n] = self.view[self.start : self.start + n]
            self.start += n
            advance(views, n)
        return recv_parts(self.conn, views)


class TcpServer(TransportServer):
    """Threaded server: one thread per connection (payload copies release the GIL).
    ``clock_skew_ms``: how long past its expiry a grant is still accepted (the master's and
    the node's clocks may differ by that much). Connection limits and timeouts:
    :class:`~pdserve.store.netio.ConnectionServer` (a connection's first frame is its first
    request header with its grant or range table). ``follow_cpu``: serve the stream requests
    of a client on this host on the CPU they came from (:mod:`pdserve.store.affinity`)."""

    name = "tcp"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        clock_skew_ms: int = 2000,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        advertise_host: str = "",
        max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        follow_cpu: bool = True,
    ) -> None:
        self.host = host
        self.follow_cpu = follow_cpu
        #: What the endpoint tells clients to dial (the bound host unless set).
        self.advertise_host = advertise_host or host
        self.idle_timeout_s = idle_timeout_s
        self.max_connections_per_peer = max_connections_per_peer
        self.handshake_timeout_s = handshake_timeout_s
        self.requested_port = port
        self.port = 0
        self.clock_skew_ms = clock_skew_ms
        # segment key -> (its memory, its grant check: a GrantKey, _NoKeyYet, or None when
        # data tokens are off; the file reads are sent from, -1 for a memory segment)
        self._segments: dict[int, tuple[memoryview, grants.GrantKey | _NoKeyYet | None, int]] = {}
        self._server: ConnectionServer | None = None
        self._read = 0
        self._written = 0

    @property
    def bytes_read(self) -> int:
        return self._read

    @property
    def bytes_written(self) -> int:
        return self._written

    def start(self, segments: Sequence[SegmentMemory]) -> None:
        self._segments = {
            segment_key(s.segment_id): (s.view, _NoKeyYet(), s.fd if s.on_disk else -1)
            for s in segments
        }
        self._server = ConnectionServer(
            self.host,
            self.requested_port,
            self._serve,
            "kv-tcp-conn",
            tune=tune_socket,
            idle_timeout_s=self.idle_timeout_s,
            max_connections_per_peer=self.max_connections_per_peer,
            handshake_timeout_s=self.handshake_timeout_s,
        )
        self.port = self._server.port

    def endpoint(self, segment: SegmentMemory, host_id: str) -> kvstore_pb2.Endpoint:
        return kvstore_pb2.Endpoint(
            transport=kvstore_pb2.TRANSPORT_TCP,
            address=f"{self.advertise_host}:{self.port}",
            host_id=host_id,
        )

    def set_data_key(self, segment_id: str, key: bytes) -> None:
        seg = segment_key(segment_id)
        mem, _old, fd = self._segments[seg]
        self._segments[seg] = (mem, grants.GrantKey(key) if key else None, fd)

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def _serve(self, conn: socket.socket) -> None:
        reader = _Reader(conn)
        cpu = CpuFollower(conn, self.follow_cpu)
        while self._handle(conn, reader, cpu):
            pass

    def _established(self, conn: socket.socket, reader: _Reader) -> None:
        """The connection's first request header (and its grant or range table) is in."""
        if reader.fresh:
            reader.fresh = False
            if self._server is not None:
                self._server.established(conn)

    def _reply(self, conn: socket.socket, status: int, length: int = 0) -> None:
        conn.sendall(REP.pack(REP_MAGIC, status, length))

    def _fail(self, conn: socket.socket, status: int, detail: str) -> bool:
        """Answers ``status``, then closes gracefully: the stream cannot be trusted after a
        bad header. Unread input is drained (bounded) so the peer receives the reply instead
        of a connection reset."""
        log.warning("tcp data port: rejected request: %s (%s)", STATUS_TEXT[status], detail)
        try:
            self._reply(conn, status)
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(0.5)
            sink = bytearray(65536)
            for _ in range(256):  # at most 16 MiB of garbage
                if conn.recv_into(sink) == 0:
                    break
        except OSError:
            pass
        return False

    def _handle(self, conn: socket.socket, reader: _Reader, cpu: CpuFollower) -> bool:
        """One request; False when the connection is done (closed by the peer, or refused)."""
        head = reader.take(REQ.size)
        if head is None:
            return False
        magic, version, op, flags, seg, offset, length = REQ.unpack(head)
        if magic != REQ_MAGIC:
            return self._fail(conn, ST_BAD_MAGIC, repr(bytes(head[:4])))
        if version != VERSION:
            return self._fail(conn, ST_BAD_VERSION, str(version))
        cpu.request(bool(flags & FLAG_STREAM))
        if op in (OP_READV, OP_WRITEV):
            return self._vector(conn, reader, op, length)
        if op not in (OP_READ, OP_WRITE):
            return self._fail(conn, ST_BAD_OP, str(op))
        grant = reader.take(GRANT.size)
        if grant is None:
            return False
        self._established(conn, reader)
        gop = grants.OP_READ if op == OP_READ else grants.OP_WRITE
        now = time.time() * 1000 - self.clock_skew_ms
        region = self._region(gop, seg, offset, length, *GRANT.unpack(grant), now)
        if isinstance(region, tuple):
            return self._fail(conn, *region)
        return self._move(conn, reader, op == OP_READ, [region])

    def _region(
        self,
        op: int,
        seg: int,
        offset: int,
        length: int,
        grant_offset: int,
        grant_length: int,
        expires_ms: int,
        alloc_id: int,
        mac: bytes,
        now_ms: float,
    ) -> memoryview | FileRange | tuple[int, str]:
        """The segment bytes a range names (a disk segment's as a FileRange when read), or
        the status that refuses it and why. ``op`` is grants.OP_READ or OP_WRITE; ``now_ms``
        the node's clock less the skew allowance."""
        entry = self._segments.get(seg)
        if entry is None:
            return ST_UNKNOWN_SEGMENT, f"segment {seg:#x}"
        mem, check, fd = entry
        if length == 0 or offset > len(mem) or length > len(mem) - offset:
            return ST_OUT_OF_BOUNDS, f"segment {seg:#x} offset {offset} length {length}"
        if check is not None:
            why = check.check(
                seg,
                offset,
                length,
                op,
                grant_offset,
                grant_length,
                expires_ms,
                alloc_id,
                mac,
                now_ms,
            )
            if why is not None:
                return (
                    ST_EXPIRED if why == grants.EXPIRED else ST_FORBIDDEN,
                    f"{why}: segment {seg:#x} offset {offset} length {length}, grant "
                    f"[{grant_offset}, +{grant_length}) op {op} allocation {alloc_id} "
                    f"expiry {expires_ms}",
                )
        if fd >= 0 and op == grants.OP_READ:
            return FileRange(fd, offset, length)
        return mem[offset : offset + length]

    def _vector(self, conn: socket.socket, reader: _Reader, op: int, count: int) -> bool:
        """A READV or WRITEV of ``count`` ranges; all are checked before any byte moves."""
        if not 1 <= count <= MAX_RANGES:
            return self._fail(conn, ST_BAD_COUNT, str(count))
        table = reader.take(count * RANGE.size)
        if table is None:
            return False
        self._established(conn, reader)
        gop = grants.OP_READ if op == OP_READV else grants.OP_WRITE
        now = time.time() * 1000 - self.clock_skew_ms
        regions = []
        for seg, offset, length, goff, glen, expires, alloc, mac in RANGE.iter_unpack(table):
            region = self._region(gop, seg, offset, length, goff, glen, expires, alloc, mac, now)
            if isinstance(region, tuple):
                return self._fail(conn, *region)
            regions.append(region)
        pad = len(writev_pad(count)) if op == OP_WRITEV else 0
        if pad and reader.take(pad) is None:
            return False
        return self._move(conn, reader, op == OP_READV, regions)

    def _move(
        self,
        conn: socket.socket,
        reader: _Reader,
        read: bool,
        regions: list[memoryview | FileRange],
    ) -> bool:
        """Sends the regions after an OK reply (a read), or receives into them and then
        replies OK (a write); the same for one range and for a vector of them."""
        total = sum(len(r) for r in regions)
        if read:
            # counted before the send: a reader that has every byte may ask the node's stats
            # at once (counted after, a test saw 0 under load)
            self._read += total
            _send_regions(conn, [REP.pack(REP_MAGIC, ST_OK, total), *regions])
            return True
        if not reader.fill(regions):
            return self._fail(conn, ST_SHORT_PAYLOAD, f"expected {total} bytes")
        self._written += total
        self._reply(conn, ST_OK, total)
        return True


def _send_regions(conn: socket.socket, parts: list) -> None:
    """Sends buffers and FileRanges in order: each run of buffers in one gathered send (told
    that more follows when a file range does), each file range by ``sendfile``."""
    run: list = []
    for part in parts:
        if not isinstance(part, FileRange):
            run.append(part)
            continue
        send_parts(conn, run, more=True)
        run = []
        send_file(conn, part.fd, part.offset, part.length)
    send_parts(conn, run)
