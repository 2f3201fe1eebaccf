"""The KV master's control wire: KVMasterService's unary client calls without HTTP/2.

A store operation is one or two master round trips plus the data transfer. Over Python
gRPC a round trip costs about 0.5 ms on loopback, ten times a 4 KiB tcp read, so small
gets and prefix lookups were all control path. The wire carries *the same protobuf
messages* as the gRPC methods (the protos stay the contract) in a lean framing that the
master answers from a thread per connection (:mod:`pdserve.services.kvstore.master.wire`).

Connection: the client first sends an 8-byte hello ``b"PDKC" | version u8 | 3 zero
bytes``. Then any number of calls, one at a time per connection, each a frame::

    request: body length u32 | method id u16 | reserved u16 | body (request message)
    reply:   body length u32 | status u16    | reserved u16 | body

all little-endian. ``status`` is a gRPC status code value: 0 (OK) carries the response
message, anything else a UTF-8 error message. Method ids are positions in
:data:`METHODS` (from 1); an unknown id answers UNIMPLEMENTED and a malformed body
INVALID_ARGUMENT, and the connection stays usable. A request body over :data:`MAX_BODY`
answers RESOURCE_EXHAUSTED and closes the connection (the byte stream can no longer be
trusted); a bad hello closes it with no answer.

With TLS configured (:mod:`pdserve.identity`) both sides wrap the connection in mutual TLS
before the hello; the master then runs each call as the peer certificate's identity.

Clients find the wire with ``GetControlWire`` over gRPC (port 0 = off) and use gRPC for
everything when it is off or unreachable.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading

import grpc
from google.protobuf.message import DecodeError, Message

from pdserve import errors, identity
from pdserve.grpcutil import DEFAULT_MAX_MESSAGE_BYTES
from pdserve.store.netio import kernel_timeouts
from pdserve.v1 import kvstore_pb2 as pb

VERSION = 1
HELLO = b"PDKC" + bytes([VERSION, 0, 0, 0])
FRAME = struct.Struct("<IHH")
#: Largest body either side accepts (the gRPC servers' message limit).
MAX_BODY = DEFAULT_MAX_MESSAGE_BYTES

#: (method, request type, response type); a method's id is its position from 1.
METHODS: tuple[tuple[str, type[Message], type[Message]], ...] = (
    ("BatchPutStart", pb.BatchPutStartRequest, pb.BatchPutStartResponse),
    ("BatchPutEnd", pb.BatchKeysRequest, pb.BatchKeysResponse),
    ("BatchPutRevoke", pb.BatchKeysRequest, pb.BatchKeysResponse),
    ("BatchGetReplicaList", pb.BatchGetReplicaListRequest, pb.BatchGetReplicaListResponse),
    ("BatchReleaseLease", pb.BatchKeysRequest, pb.BatchKeysResponse),
    ("BatchExists", pb.BatchKeysRequest, pb.BatchExistsResponse),
    ("LongestPrefix", pb.LongestPrefixRequest, pb.LongestPrefixResponse),
    ("BatchRemove", pb.BatchKeysRequest, pb.BatchKeysResponse),
    ("Stats", pb.StatsRequest, pb.StatsResponse),
)
METHOD_IDS = {name: i for i, (name, _req, _resp) in enumerate(METHODS, 1)}
_STATUS = {c.value[0]: c for c in grpc.StatusCode}


class FrameReader:
    """Buffered reads from a socket: a reply (or request) that arrived whole costs one recv,
    not one for its header and one for its body. Receives land in one reused buffer
    (``recv_into``: no fresh 64 KiB object per receive); a body larger than it is received
    straight into a buffer of its own."""

    #: Bytes of the reused receive buffer.
    SIZE = 65536

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray(self.SIZE)
        self.view = memoryview(self.buf)
        self.start = self.end = 0  # received, not yet read: buf[start:end]

    def read(self, n: int) -> bytes | bytearray:
        """``n`` bytes; ConnectionResetError when the peer closes first."""
        avail = self.end - self.start
        if avail < n:
            if n > len(self.buf):
                out = bytearray(n)
                view = memoryview(out)
                view[:avail] = self.view[self.start : self.end]
                self.start = self.end = 0
                while avail < n:
                    got = self.sock.recv_into(view[avail:])
                    if not got:
                        raise ConnectionResetError("the peer closed the control wire")
                    avail += got
                return out
            if self.start:  # what is left goes to the front
                self.buf[:avail] = self.buf[self.start : self.end]
                self.start, self.end = 0, avail
            while self.end - self.start < n:
                got = self.sock.recv_into(self.view[self.end :])
                if not got:
                    raise ConnectionResetError("the peer closed the control wire")
                self.end += got
        self.start += n
        return bytes(self.view[self.start - n : self.start])


class WireUnreachable(Exception):
    """No connection to the wire could be made (nothing was sent): the caller may retry the
    call over gRPC."""


class WireClient:
    """Blocking, thread-safe client of one master's control wire: a small pool of
    persistent connections, one call at a time on each."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout_s: float,
        pool_size: int = 8,
        tls: identity.TlsFiles | bool | None = True,
    ) -> None:
        """``tls``: the files to present (True = the process's, :func:`identity.tls`, renewed
        ones from the next connection on)."""
        if tls is True:
            tls = True if identity.tls() is not None else None
        self._tls = tls or None
        self.address = f"{host}:{port}"
        self._host = host.strip("[]")
        self._port = port
        self.timeout_s = timeout_s
        self.pool_size = pool_size
        self._pool: queue.LifoQueue[FrameReader] = queue.LifoQueue()
        self._closed = threading.Event()

    def _connect(self) -> FrameReader:
        try:
            sock = socket.create_connection((self._host, self._port), timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            kernel_timeouts(sock, self.timeout_s)
            files = identity.tls() if self._tls is True else self._tls
            if files is not None:  # the master's wire is mutual TLS when its gRPC port is
                sock = identity.client_context(files).wrap_socket(sock, server_hostname=self._host)
                # a TLS read retries a receive that SO_RCVTIMEO ended, so Python's timeout
                # bounds the wait (TimeoutError) instead
                sock.settimeout(self.timeout_s)
                server = identity.socket_caller(sock)
                if server.role != "master":  # any cluster certificate is valid for the host
                    sock.close()
                    raise WireUnreachable(
                        f"control wire {self.address}: the server is {server}, not a KV master"
                    )
            sock.sendall(HELLO)
        except (OSError, errors.Unauthenticated) as exc:
            raise WireUnreachable(f"control wire {self.address}: {exc}") from exc
        return FrameReader(sock)

    def call(self, method: str, request: Message) -> Message:
        """One call; raises the :mod:`pdserve.errors` class of the status the master
        answered, :class:`WireUnreachable` when no connection could be made, or
        Unavailable / DeadlineExceeded when the connection failed mid-call."""
        mid = METHOD_IDS[method]
        resp_type = METHODS[mid - 1][2]
        body = request.SerializeToString()
        frame = FRAME.pack(len(body), mid, 0) + body
        # A pooled connection may have been closed by the master (it restarted): a call that
        # fails on one before any reply byte is tried once more on a fresh connection.
        for pooled in (True, False):
            conn = None
            if pooled:
                try:
                    conn = self._pool.get_nowait()
                except queue.Empty:
                    pooled = False
            if conn is None:
                conn = self._connect()
            sock = conn.sock
            replied = False
            try:
                sock.sendall(frame)
                length, status, _ = FRAME.unpack(conn.read(FRAME.size))
                replied = True
                if length > MAX_BODY:
                    raise ConnectionError(f"reply of {length} bytes is over the limit")
                payload = conn.read(length)
            except (TimeoutError, BlockingIOError) as exc:  # BlockingIOError: SO_RCVTIMEO ran out
                sock.close()
                raise errors.DeadlineExceeded(
                    f"kvstore master wire {self.address} {method}: no answer within "
                    f"{self.timeout_s:g} s"
                ) from exc
            except OSError as exc:
                sock.close()
                if pooled and not replied:
                    continue
                raise errors.Unavailable(
                    f"kvstore master wire {self.address} {method}: {exc}"
                ) from exc
            if self._closed.is_set() or self._pool.qsize() >= self.pool_size:
                sock.close()
            else:
                self._pool.put(conn)
            if status:
                code = _STATUS.get(status, grpc.StatusCode.UNKNOWN)
                raise errors.from_status(
                    code,
                    f"kvstore master {self.address} {method}: {code.name}: "
                    + payload.decode("utf-8", "replace"),
                )
            try:
                return resp_type.FromString(payload)
            except DecodeError as exc:
                raise errors.Unavailable(
                    f"kvstore master wire {self.address} {method}: malformed reply"
                ) from exc
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._closed.set()
        while True:
            try:
                self._pool.get_nowait().sock.close()
            except queue.Empty:
                return
