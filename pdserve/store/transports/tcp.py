"""pdserve's built-in TCP transport: raw sockets, a fixed binary header, raw payload bytes.

Protocol version 3. Request header (little-endian, 32 bytes)::

    magic b"PDKT" | version u8 (3) | op u8 (1 READ, 2 WRITE, 3 READV, 4 WRITEV)
    | reserved u16 | segment key u64 (first 8 bytes of BLAKE3(segment id)) | offset u64
    | length u64

Every range travels with its grant (48 bytes, :mod:`pdserve.store.grants`): the replica's
``Replica.offset``, ``size``, ``token_expires_ms``, ``alloc_id`` and ``token``::

    granted offset u64 | granted length u64 | expiry u64 (unix ms) | allocation id u64
    | MAC 16 bytes

A READ or WRITE header is followed by its range's grant (a WRITE's then by ``length``
payload bytes). A READV header has segment key and offset 0 and ``length`` = the number of
ranges (1..:data:`MAX_RANGES`), and is followed by that many 72-byte ranges ``segment key u64
| offset u64 | length u64 | grant``: one request reads many objects (a prompt's chunks) in
one round trip. A WRITEV is the same, then reserved bytes (:func:`writev_pad`, ignored) up to
the next multiple of 64 from the header's start, then the ranges' payloads back to back.
The node answers every request with a 64-byte reply ``magic b"PDKR" | status u8 | reserved
3 | length u64 | reserved 48``; a successful READ or READV reply is followed by ``length``
payload bytes (READV: the ranges back to back, in request order); a WRITE or WRITEV is
answered once every byte is in place. The reply and a WRITEV's header and table are whole
cache lines so that a payload sent in the same ``sendmsg`` sits at the same offset within a
cache line in the socket's buffers as in the segment and in the receiver's buffer. With the
16-byte reply of version 2 both kernel copies of every read ran misaligned: the node's send
copy took twice the CPU of the client's receive copy, and in a bare loopback test of the two
framings 16 MiB reads took 3.6-3.8 against 2.8-3.4 ms (2 cores).

The node validates every header and range before touching memory: magic, version, op,
count, known segment, ``offset + length`` inside the segment, then the grant: the range lies
inside the granted range (a sub-range is fine: big objects travel as pieces over several
connections), the MAC is the one the segment's data key gives for that segment, granted
range, operation (READ and READV read, WRITE and WRITEV write), expiry and allocation id
(compared in constant time), and the expiry has not passed on the node's clock, give or take
its clock skew allowance. Before its first mount answer names a segment's data key the node
refuses every range of it; a mount answer with an empty key (the master runs with
``data_tokens`` off) makes it serve any in-bounds range and ignore the grants. On a bad
header or range it answers with an error status (:data:`ST_FORBIDDEN`, :data:`ST_EXPIRED`
for grants) and closes the connection, because the byte stream can no longer be trusted.

Payloads go straight from / into the segment mapping and the caller's buffers, never
through an intermediate copy: a header and its payload leave in one ``sendmsg`` and a reply
lands with ``recvmsg_into`` (header and payloads scattered into the callers' buffers); the
node takes a request's header and range table with one receive (:class:`_Reader`). The
client moves bytes with READV and WRITEV only; objects from :data:`PARALLEL_MIN_BYTES` on,
and batches that large, are split over :data:`PARALLEL_STREAMS` connections at once.
"""

from __future__ import annotations

import collections
import functools
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

import blake3

from pdserve.store import grants
from pdserve.store.netio import (
    IDLE_TIMEOUT_S,
    ConnectionServer,
    advance,
    iov,
    kernel_timeouts,
    recv_parts,
    send_parts,
)
from pdserve.store.segment import SegmentMemory
from pdserve.store.transports.base import (
    TransferThreads,
    Transport,
    TransportError,
    TransportServer,
    balanced_groups,
    check_range,
    check_write,
)
from pdserve.v1 import kvstore_pb2

log = logging.getLogger(__name__)

REQ = struct.Struct("<4sBBHQQQ")
REP = struct.Struct("<4sB3xQ48x")
#: granted offset, granted length, expiry (unix ms), allocation id, MAC.
GRANT = struct.Struct(f"<QQQQ{grants.MAC_BYTES}s")
#: segment key, offset, length, then the grant.
RANGE = struct.Struct(f"<QQQQQQQ{grants.MAC_BYTES}s")
REQ_MAGIC = b"PDKT"
REP_MAGIC = b"PDKR"
VERSION = 3
#: The grant fields of a request without one (a node with data tokens off ignores them).
NO_GRANT = (0, 0, 0, 0, b"")
OP_READ = 1
OP_WRITE = 2
OP_READV = 3
OP_WRITEV = 4
#: Most ranges in one READV request.
MAX_RANGES = 4096
#: A READ or READV reply's payload, and a WRITEV's, start this many bytes (or a multiple)
#: into their message.
ALIGN = 64


def writev_pad(count: int) -> bytes:
    """The reserved bytes between a WRITEV's table of ``count`` ranges and its payloads."""
    return bytes(-(REQ.size + count * RANGE.size) % ALIGN)


ST_OK = 0
ST_BAD_MAGIC = 1
ST_BAD_VERSION = 2
ST_BAD_OP = 3
ST_UNKNOWN_SEGMENT = 4
ST_OUT_OF_BOUNDS = 5
ST_SHORT_PAYLOAD = 6
ST_BAD_COUNT = 7
ST_FORBIDDEN = 8
ST_EXPIRED = 9
STATUS_TEXT = {
    ST_BAD_MAGIC: "bad magic",
    ST_BAD_VERSION: "unsupported protocol version",
    ST_BAD_OP: "unknown op",
    ST_UNKNOWN_SEGMENT: "unknown segment",
    ST_OUT_OF_BOUNDS: "range outside the segment",
    ST_SHORT_PAYLOAD: "connection closed before the payload was complete",
    ST_BAD_COUNT: f"a READV or WRITEV needs 1 to {MAX_RANGES} ranges",
    ST_FORBIDDEN: "no valid grant for the range (none, forged, or for another range, segment "
    "or operation)",
    ST_EXPIRED: "the range's grant expired",
}
#: Explicit SO_SNDBUF/SO_RCVBUF (bytes; the kernel doubles it); 0 = kernel autotuning.
#: Small buffers keep the bytes in flight inside the CPU caches: the receiver copies out what
#: the sender just copied in. Measured on loopback (2 cores, 64 MiB objects): 256 KiB about
#: 4.5-5.4 GB/s; 512 KiB-1 MiB and autotuning (which grows to 32 MiB) 2.6-3.0 GB/s.
SOCK_BUF = 256 * 1024
#: Reads of this many bytes on (one object or a batch) are split over PARALLEL_STREAMS
#: connections at once. Measured on loopback (2 cores): 16-64 MiB reads 4.0 -> 5.2 GB/s with
#: two streams; four streams are slower than two, and splitting 1 MiB reads is slower.
PARALLEL_MIN_BYTES = 8 * 1024 * 1024
PARALLEL_STREAMS = 2
#: Bytes a node receives at once when it waits for a request: a header and its range table
#: (72 bytes a range) usually arrive whole.
READ_AHEAD = 4096


class _NoKeyYet:
    """The grant check of a segment whose data key the node has not learned yet (before its
    first mount answer): refuses every range."""

    @staticmethod
    def check(*_args: object) -> str:
        return "the node has no data key for the segment yet (not mounted)"


#: A range as the client sends it: (item index, segment key, offset, length, buffer, grant
#: as in :data:`GRANT`).
_Range = tuple[int, int, int, int, memoryview, tuple[int, int, int, int, bytes]]


@functools.lru_cache(maxsize=4096)
def segment_key(segment_id: str) -> int:
    """The u64 that names a segment on the wire (memoized: every range names one)."""
    return int.from_bytes(blake3.blake3(segment_id.encode()).digest(length=8), "little")


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCK_BUF:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)


def _split(ranges: list, streams: int) -> list[list]:
    """``ranges`` (4th field: bytes) cut into at most ``streams`` consecutive groups of
    about equal bytes; one group below PARALLEL_MIN_BYTES in all."""
    sizes = [r[3] for r in ranges]
    if sum(sizes) < PARALLEL_MIN_BYTES or len(ranges) == 1:
        return [ranges]
    return balanced_groups(ranges, sizes, streams)


class _Reader:
    """Buffered receives of a connection's request headers and range tables: the client
    sends a header and its table in one ``sendmsg``, and one ``recv`` takes both (not one
    for each). Payloads land straight in the segment; only payload bytes that came along
    with a header (at most :data:`READ_AHEAD`) are copied from the buffer."""

    __slots__ = ("buf", "conn", "end", "start", "view")

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
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
    the node's clocks may differ by that much)."""

    name = "tcp"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        clock_skew_ms: int = 2000,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        advertise_host: str = "",
    ) -> None:
        self.host = host
        #: What the endpoint tells clients to dial (the bound host unless set).
        self.advertise_host = advertise_host or host
        self.idle_timeout_s = idle_timeout_s
        self.requested_port = port
        self.port = 0
        self.clock_skew_ms = clock_skew_ms
        # segment key -> (its memory, its grant check: a GrantKey, _NoKeyYet, or None when
        # data tokens are off)
        self._segments: dict[int, tuple[memoryview, grants.GrantKey | _NoKeyYet | None]] = {}
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
        self._segments = {segment_key(s.segment_id): (s.view, _NoKeyYet()) for s in segments}
        self._server = ConnectionServer(
            self.host,
            self.requested_port,
            self._serve,
            "kv-tcp-conn",
            tune=_tune,
            idle_timeout_s=self.idle_timeout_s,
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
        mem, _old = self._segments[seg]
        self._segments[seg] = (mem, grants.GrantKey(key) if key else None)

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def _serve(self, conn: socket.socket) -> None:
        reader = _Reader(conn)
        while self._handle(conn, reader):
            pass

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

    def _handle(self, conn: socket.socket, reader: _Reader) -> bool:
        """One request; False when the connection is done (closed by the peer, or refused)."""
        head = reader.take(REQ.size)
        if head is None:
            return False
        magic, version, op, _res, seg, offset, length = REQ.unpack(head)
        if magic != REQ_MAGIC:
            return self._fail(conn, ST_BAD_MAGIC, repr(bytes(head[:4])))
        if version != VERSION:
            return self._fail(conn, ST_BAD_VERSION, str(version))
        if op in (OP_READV, OP_WRITEV):
            return self._vector(conn, reader, op, length)
        if op not in (OP_READ, OP_WRITE):
            return self._fail(conn, ST_BAD_OP, str(op))
        grant = reader.take(GRANT.size)
        if grant is None:
            return False
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
    ) -> memoryview | tuple[int, str]:
        """The segment bytes a range names, or the status that refuses it and why. ``op``
        is grants.OP_READ or OP_WRITE; ``now_ms`` the node's clock less the skew allowance."""
        entry = self._segments.get(seg)
        if entry is None:
            return ST_UNKNOWN_SEGMENT, f"segment {seg:#x}"
        mem, check = entry
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
        return mem[offset : offset + length]

    def _vector(self, conn: socket.socket, reader: _Reader, op: int, count: int) -> bool:
        """A READV or WRITEV of ``count`` ranges; all are checked before any byte moves."""
        if not 1 <= count <= MAX_RANGES:
            return self._fail(conn, ST_BAD_COUNT, str(count))
        table = reader.take(count * RANGE.size)
        if table is None:
            return False
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
        self, conn: socket.socket, reader: _Reader, read: bool, regions: list[memoryview]
    ) -> bool:
        """Sends the regions after an OK reply (a read), or receives into them and then
        replies OK (a write); the same for one range and for a vector of them."""
        total = sum(len(r) for r in regions)
        if read:
            send_parts(conn, [REP.pack(REP_MAGIC, ST_OK, total), *regions])
            self._read += total
            return True
        if not reader.fill(regions):
            return self._fail(conn, ST_SHORT_PAYLOAD, f"expected {total} bytes")
        self._written += total
        self._reply(conn, ST_OK, total)
        return True


class TcpTransport(Transport):
    """Client side: a small pool of persistent blocking sockets per node address."""

    name = "tcp"
    kind = kvstore_pb2.TRANSPORT_TCP

    def __init__(self, timeout_s: float = 5.0, pool_size: int = 8) -> None:
        self.timeout_s = timeout_s
        self.pool_size = pool_size
        # address -> idle connections, the most recently used last (deque's append and pop
        # are atomic: no lock on the hot path)
        self._pools: dict[str, collections.deque[socket.socket]] = {}
        self._lock = threading.Lock()
        self._threads = TransferThreads(4 * (PARALLEL_STREAMS - 1), "kv-tcp-stream")
        self._closed = False

    def _pool(self, address: str) -> collections.deque[socket.socket]:
        pool = self._pools.get(address)
        if pool is None:
            with self._lock:
                pool = self._pools.setdefault(address, collections.deque())
        return pool

    def _connect(self, address: str) -> socket.socket:
        host, _, port = address.rpartition(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _tune(sock)  # before connect: the receive window is sized at the handshake
        sock.settimeout(self.timeout_s)
        try:
            sock.connect((host, int(port)))
        except (OSError, ValueError) as exc:
            sock.close()
            raise TransportError(f"cannot connect to {address}: {exc}") from exc
        kernel_timeouts(sock, self.timeout_s)
        return sock

    def _request(
        self, address: str, request: list, length: int, out: list[memoryview] | None
    ) -> None:
        """One request on a pooled connection: ``request`` (header, then ranges or payload)
        goes out in one sendmsg; a read's ``length`` payload bytes land in ``out`` (buffers
        filled in order), the reply header with them in one recvmsg_into. A pooled
        connection the node closed meanwhile (its idle timeout, a restart) fails before any
        reply byte: the request is sent again once, on a fresh connection."""
        pool = self._pool(address)
        for pooled in (True, False):
            sock = None
            if pooled:
                try:
                    sock = pool.pop()
                except IndexError:
                    continue
            if sock is None:
                sock = self._connect(address)
            ok = False
            try:
                try:
                    send_parts(sock, request)
                    rep = memoryview(bytearray(REP.size))
                    received = self._recv_reply(sock, rep, [] if out is None else out)
                except (BrokenPipeError, ConnectionResetError):
                    if pooled:
                        continue  # stale: nothing of the reply arrived, nothing was served
                    raise
                if not received:
                    if pooled:
                        continue
                    raise TransportError(f"node {address} closed the connection")
                if rep[: min(received, 4)] != REP_MAGIC[:received]:
                    raise TransportError(f"node {address} sent a malformed reply")
                status = rep[4] if received > 4 else ST_OK
                if status != ST_OK:
                    raise TransportError(
                        f"node {address} rejected the request: {STATUS_TEXT.get(status, status)}"
                    )
                if received < REP.size:
                    raise TransportError(
                        f"node {address} closed the connection after {received} bytes of a "
                        f"{REP.size}-byte reply header (a node of another protocol version?)"
                    )
                _magic, _status, rlength = REP.unpack(rep)
                if rlength != length:
                    raise TransportError(f"node {address} replied {rlength} bytes, want {length}")
                if out is not None and not recv_parts(sock, out):
                    raise TransportError(f"node {address} closed the connection mid-payload")
                ok = True
                return
            except OSError as exc:
                raise TransportError(f"tcp transfer with {address} failed: {exc}") from exc
            finally:
                if ok and not self._closed and len(pool) < self.pool_size:
                    pool.append(sock)
                else:
                    sock.close()

    @staticmethod
    def _recv_reply(sock: socket.socket, rep: memoryview, out: list[memoryview]) -> int:
        """Receives the reply header and the payload's first slice in one receive that
        waits for all of it (a refusal ends it early: the node closes the connection after
        one) and trims ``out`` to what is still missing. Returns how many header bytes
        arrived: fewer than ``REP.size`` when the peer closed first."""
        got = sock.recvmsg_into([rep, *iov(out, 1)], 0, socket.MSG_WAITALL)[0]
        if got < REP.size:
            return got
        advance(out, got - REP.size)
        return REP.size

    def _run(self, jobs: list[Callable[[], None]]) -> list[TransportError | None]:
        """Runs the callables in ``jobs`` at once (the first on this thread); the error of
        each, or None."""

        def attempt(job: Callable[[], None]) -> TransportError | None:
            try:
                job()
            except TransportError as exc:
                return exc
            return None

        return self._threads.run([functools.partial(attempt, job) for job in jobs])

    def _ranges(
        self, items: Sequence[tuple[kvstore_pb2.Replica, memoryview]], what: str
    ) -> tuple[dict[str, list[_Range]], list]:
        """Per node address, the ranges ``(item, segment key, offset, length, buffer,
        grant)`` that move ``items`` (objects from PARALLEL_MIN_BYTES on in PARALLEL_STREAMS
        pieces, each with the replica's whole grant), and each item's error so far."""
        errors: list[TransportError | None] = [None] * len(items)
        by_node: dict[str, list[_Range]] = {}
        for i, (rep, buf) in enumerate(items):
            ep = self.endpoint(rep)
            if ep is None:
                errors[i] = TransportError("replica has no tcp endpoint")
                continue
            try:
                if what == "read":
                    check_range(rep, len(buf), "tcp read")
                else:
                    check_write(rep, len(buf))
            except TransportError as exc:
                errors[i] = exc
                continue
            seg = segment_key(rep.segment_id)
            grant = (rep.offset, rep.size, rep.token_expires_ms, rep.alloc_id, rep.token)
            parts = PARALLEL_STREAMS if rep.size >= PARALLEL_MIN_BYTES else 1
            for k in range(parts):
                lo, hi = rep.size * k // parts, rep.size * (k + 1) // parts
                by_node.setdefault(ep.address, []).append(
                    (i, seg, rep.offset + lo, hi - lo, buf[lo:hi], grant)
                )
        return by_node, errors

    def _many(
        self, op: int, items: Sequence[tuple[kvstore_pb2.Replica, memoryview]]
    ) -> list[TransportError | None]:
        by_node, errors = self._ranges(items, "read" if op == OP_READV else "write")
        if len(by_node) == 1 and len(items) == 1:
            # One object on one connection (the common single get): no split, no threads.
            ((address, ranges),) = by_node.items()
            if len(ranges) == 1:
                try:
                    self._vector(op, address, ranges)
                except TransportError as exc:
                    errors[0] = exc
                return errors
        for address, ranges in by_node.items():
            groups = _split(ranges, PARALLEL_STREAMS)
            jobs = [functools.partial(self._vector, op, address, g) for g in groups]
            for group, err in zip(groups, self._run(jobs), strict=True):
                if err is not None:
                    for i, *_ in group:
                        errors[i] = errors[i] or err
        return errors

    def _vector(self, op: int, address: str, ranges: list[_Range]) -> None:
        """READV / WRITEV requests for ``ranges`` on one connection."""
        for lo in range(0, len(ranges), MAX_RANGES):
            batch = ranges[lo : lo + MAX_RANGES]
            head = REQ.pack(REQ_MAGIC, VERSION, op, 0, 0, 0, len(batch))
            table = b"".join(RANGE.pack(seg, off, n, *g) for _i, seg, off, n, _b, g in batch)
            bufs = [r[4] for r in batch]
            total = sum(r[3] for r in batch)
            if op == OP_READV:
                self._request(address, [head, table], total, bufs)
            else:
                pad = writev_pad(len(batch))
                self._request(address, [head, table, pad, *bufs], total, None)

    def read_many(
        self, items: Sequence[tuple[kvstore_pb2.Replica, memoryview]]
    ) -> list[TransportError | None]:
        """One READV round trip per node for all ``items`` (split over PARALLEL_STREAMS
        connections from PARALLEL_MIN_BYTES in all)."""
        return self._many(OP_READV, items)

    def write_many(
        self, items: Sequence[tuple[kvstore_pb2.Replica, memoryview]]
    ) -> list[TransportError | None]:
        """One WRITEV round trip per node for all ``items``, split as reads are."""
        return self._many(OP_WRITEV, items)

    def read_into(self, replica: kvstore_pb2.Replica, buf: memoryview) -> None:
        (err,) = self.read_many([(replica, buf)])
        if err is not None:
            raise err

    def write(self, replica: kvstore_pb2.Replica, data: memoryview) -> None:
        (err,) = self.write_many([(replica, data)])
        if err is not None:
            raise err

    def close(self) -> None:
        self._closed = True
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
        self._threads.close()
        for pool in pools:
            while True:
                try:
                    pool.pop().close()
                except IndexError:
                    break
