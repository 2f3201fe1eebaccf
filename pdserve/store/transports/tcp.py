"""pdserve's built-in TCP transport: raw sockets, a fixed binary header, raw payload bytes.

Request header (little-endian, 32 bytes)::

    magic b"PDKT" | version u8 | op u8 (1 READ, 2 WRITE) | reserved u16
    | segment key u64 (first 8 bytes of BLAKE3(segment id)) | offset u64 | length u64

A WRITE header is followed by ``length`` payload bytes. The node answers every request with
a 16-byte reply ``magic b"PDKR" | status u8 | reserved 3 | length u64``; a successful READ
reply is followed by ``length`` payload bytes. The node validates every header (magic,
version, op, known segment, ``offset + length`` inside the segment) before touching memory;
on a bad header it answers with an error status and closes the connection, because the byte
stream can no longer be trusted. Payloads go straight from / into the segment mapping and
the caller's buffer (``socket.recv_into``), never through an intermediate copy.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import struct
import threading
from collections.abc import Sequence

import blake3

from pdserve.store.segment import SegmentMemory
from pdserve.store.transports.base import Transport, TransportError, TransportServer, check_range
from pdserve.v1 import kvstore_pb2

log = logging.getLogger(__name__)

REQ = struct.Struct("<4sBBHQQQ")
REP = struct.Struct("<4sB3xQ")
REQ_MAGIC = b"PDKT"
REP_MAGIC = b"PDKR"
VERSION = 1
OP_READ = 1
OP_WRITE = 2

ST_OK = 0
ST_BAD_MAGIC = 1
ST_BAD_VERSION = 2
ST_BAD_OP = 3
ST_UNKNOWN_SEGMENT = 4
ST_OUT_OF_BOUNDS = 5
ST_SHORT_PAYLOAD = 6
STATUS_TEXT = {
    ST_BAD_MAGIC: "bad magic",
    ST_BAD_VERSION: "unsupported protocol version",
    ST_BAD_OP: "unknown op",
    ST_UNKNOWN_SEGMENT: "unknown segment",
    ST_OUT_OF_BOUNDS: "range outside the segment",
    ST_SHORT_PAYLOAD: "connection closed before the payload was complete",
}
#: Explicit SO_SNDBUF/SO_RCVBUF (bytes); 0 = leave the buffers to the kernel's autotuning.
#: Setting them disables autotuning and is capped at net.core.[rw]mem_max (4 MiB here), while
#: autotuning grows them up to net.ipv4.tcp_[rw]mem's maximum (32 MiB here): on Linux the
#: large buffers come from *not* setting them. Measured on loopback: no worse, often better.
SOCK_BUF = 0
#: Largest slice handed to one send/recv call (keeps each syscall bounded).
_IO_SLICE = 4 * 1024 * 1024


def segment_key(segment_id: str) -> int:
    """The u64 that names a segment on the wire."""
    return int.from_bytes(blake3.blake3(segment_id.encode()).digest(length=8), "little")


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCK_BUF:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)


def recv_exact(sock: socket.socket, buf: memoryview) -> bool:
    """Fills ``buf`` from ``sock``; False when the peer closed first."""
    got, n = 0, len(buf)
    while got < n:
        k = sock.recv_into(buf[got : min(n, got + _IO_SLICE)])
        if k == 0:
            return False
        got += k
    return True


class TcpServer(TransportServer):
    """Threaded server: one thread per connection (payload copies release the GIL)."""

    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.requested_port = port
        self.port = 0
        self._segments: dict[int, memoryview] = {}
        self._sock: socket.socket | None = None
        self._stopping = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._read = 0
        self._written = 0

    @property
    def bytes_read(self) -> int:
        return self._read

    @property
    def bytes_written(self) -> int:
        return self._written

    def start(self, segments: Sequence[SegmentMemory]) -> None:
        self._segments = {segment_key(s.segment_id): s.view for s in segments}
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.requested_port))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self._sock = sock
        threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True).start()

    def endpoint(self, segment: SegmentMemory, host_id: str) -> kvstore_pb2.Endpoint:
        return kvstore_pb2.Endpoint(
            transport=kvstore_pb2.TRANSPORT_TCP, address=f"{self.host}:{self.port}", host_id=host_id
        )

    def stop(self) -> None:
        self._stopping.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            self._sock = None
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    def _accept_loop(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while not self._stopping.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            _tune(conn)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="kv-tcp-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        head = bytearray(REQ.size)
        hview = memoryview(head)
        try:
            while not self._stopping.is_set():
                if not recv_exact(conn, hview):
                    return
                if not self._handle(conn, head):
                    return
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

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

    def _handle(self, conn: socket.socket, head: bytearray) -> bool:
        magic, version, op, _res, seg, offset, length = REQ.unpack(head)
        if magic != REQ_MAGIC:
            return self._fail(conn, ST_BAD_MAGIC, repr(bytes(head[:4])))
        if version != VERSION:
            return self._fail(conn, ST_BAD_VERSION, str(version))
        if op not in (OP_READ, OP_WRITE):
            return self._fail(conn, ST_BAD_OP, str(op))
        mem = self._segments.get(seg)
        if mem is None:
            return self._fail(conn, ST_UNKNOWN_SEGMENT, f"{seg:#x}")
        if length == 0 or offset > len(mem) or length > len(mem) - offset:
            return self._fail(conn, ST_OUT_OF_BOUNDS, f"offset {offset} length {length}")
        region = mem[offset : offset + length]
        if op == OP_READ:
            self._reply(conn, ST_OK, length)
            conn.sendall(region)
            self._read += length
            return True
        if not recv_exact(conn, region):
            return self._fail(conn, ST_SHORT_PAYLOAD, f"expected {length} bytes")
        self._written += length
        self._reply(conn, ST_OK, length)
        return True


class TcpTransport(Transport):
    """Client side: a small pool of persistent blocking sockets per node address."""

    name = "tcp"
    kind = kvstore_pb2.TRANSPORT_TCP

    def __init__(self, timeout_s: float = 5.0, pool_size: int = 4) -> None:
        self.timeout_s = timeout_s
        self.pool_size = pool_size
        self._pools: dict[str, queue.LifoQueue[socket.socket]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _pool(self, address: str) -> queue.LifoQueue[socket.socket]:
        with self._lock:
            pool = self._pools.get(address)
            if pool is None:
                pool = self._pools[address] = queue.LifoQueue()
            return pool

    def _connect(self, address: str) -> socket.socket:
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
        except (OSError, ValueError) as exc:
            raise TransportError(f"cannot connect to {address}: {exc}") from exc
        _tune(sock)
        return sock

    def _request(
        self,
        replica: kvstore_pb2.Replica,
        op: int,
        payload: memoryview | None,
        out: memoryview | None,
    ) -> None:
        ep = self.endpoint(replica)
        if ep is None:
            raise TransportError("replica has no tcp endpoint")
        pool = self._pool(ep.address)
        try:
            sock = pool.get_nowait()
        except queue.Empty:
            sock = self._connect(ep.address)
        ok = False
        try:
            head = REQ.pack(
                REQ_MAGIC,
                VERSION,
                op,
                0,
                segment_key(replica.segment_id),
                replica.offset,
                replica.size,
            )
            if payload is not None:
                sock.sendall(head)
                for i in range(0, len(payload), _IO_SLICE):
                    sock.sendall(payload[i : i + _IO_SLICE])
            else:
                sock.sendall(head)
            rep = bytearray(REP.size)
            if not recv_exact(sock, memoryview(rep)):
                raise TransportError(f"node {ep.address} closed the connection")
            magic, status, length = REP.unpack(rep)
            if magic != REP_MAGIC:
                raise TransportError(f"node {ep.address} sent a malformed reply")
            if status != ST_OK:
                raise TransportError(
                    f"node {ep.address} rejected the request: {STATUS_TEXT.get(status, status)}"
                )
            if length != replica.size:
                raise TransportError(
                    f"node {ep.address} replied {length} bytes, want {replica.size}"
                )
            if out is not None and not recv_exact(sock, out[: replica.size]):
                raise TransportError(f"node {ep.address} closed the connection mid-payload")
            ok = True
        except OSError as exc:
            raise TransportError(f"tcp transfer with {ep.address} failed: {exc}") from exc
        finally:
            if ok and not self._closed and pool.qsize() < self.pool_size:
                pool.put(sock)
            else:
                sock.close()

    def write(self, replica: kvstore_pb2.Replica, data: memoryview) -> None:
        if len(data) != replica.size:
            raise TransportError(f"write of {len(data)} bytes into a {replica.size}-byte replica")
        self._request(replica, OP_WRITE, data, None)

    def read_into(self, replica: kvstore_pb2.Replica, buf: memoryview) -> None:
        check_range(replica, len(buf), "tcp read")
        self._request(replica, OP_READ, None, buf)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            while True:
                try:
                    pool.get_nowait().close()
                except queue.Empty:
                    break
