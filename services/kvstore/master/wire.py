"""The master's side of the control wire (framing in :mod:`pdserve.store.wire`).

One thread per connection with blocking sockets: measured on loopback, a call answered this
way costs about 30 us less than through an asyncio protocol on the event loop. Every call
runs :meth:`MasterHandlers.call`, which holds the state lock, so wire and gRPC calls see
:class:`MasterState` one at a time; errors map to statuses as for gRPC
(:func:`pdserve.grpcutil.error_status`). With the process's TLS set the wire is mutual TLS too,
and each connection's calls run as its peer's identity. Connection limits (in all and per peer
address) and timeouts (the TLS handshake and hello within the handshake timeout, then the idle
one) are :class:`~pdserve.store.netio.ConnectionServer`'s, as on a node's tcp data port.
"""

from __future__ import annotations

import functools
import logging
import socket
import ssl
import time
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from pdserve import identity
from pdserve.grpcutil import SERVER_CALLS, SERVER_SECONDS, error_status
from pdserve.identity import Identity
from pdserve.services.kvstore.master.servicer import MasterHandlers
from pdserve.store.netio import ConnectionServer
from pdserve.store.wire import FRAME, HELLO, MAX_BODY, METHODS, FrameReader
from pdserve.v1 import kvstore_pb2

log = logging.getLogger(__name__)
#: The service whose methods the wire carries (its calls are counted under their gRPC names).
WIRE_SERVICE = kvstore_pb2.DESCRIPTOR.services_by_name["KVMasterService"].full_name


def answer(
    handlers: MasterHandlers, mid: int, body: bytes, caller: Identity | None = None
) -> tuple[grpc.StatusCode, bytes]:
    """The status and reply body for one request frame from ``caller``."""
    if not 1 <= mid <= len(METHODS):
        return grpc.StatusCode.UNIMPLEMENTED, f"unknown method id {mid}".encode()
    name, req_type, _resp = METHODS[mid - 1]
    try:
        request = req_type.FromString(body)
    except DecodeError:
        return grpc.StatusCode.INVALID_ARGUMENT, f"{name}: malformed {req_type.__name__}".encode()
    start = time.perf_counter()
    try:
        return grpc.StatusCode.OK, handlers.call(name, request, caller).SerializeToString()
    except Exception as exc:
        code, message = error_status(exc, name)
        return code, message.encode()
    finally:  # counted as the same call through gRPC is
        calls, seconds = _counters(name)
        calls.inc()
        seconds.inc(time.perf_counter() - start)


@functools.cache
def _counters(name: str) -> tuple[Any, Any]:
    """The call and time counters of wire method ``name``, found once per method (every
    store call of every worker comes through :func:`answer`)."""
    method = f"/{WIRE_SERVICE}/{name}"
    return SERVER_CALLS.labels(method), SERVER_SECONDS.labels(method)


class WireServer:
    """The control wire's listener: a thread per connection answering its frames in turn."""

    def __init__(self, handlers: MasterHandlers, host: str, port: int) -> None:
        self.handlers = handlers
        files = identity.tls()
        # Mutual TLS as on the gRPC port; each handshake runs on its connection's thread.
        tls = identity.server_context(files) if files is not None else None
        self._server = ConnectionServer(host, port, self._serve, "kv-wire", tls=tls)
        self.port = self._server.port

    def _serve(self, conn: socket.socket) -> None:
        caller = identity.socket_caller(conn) if isinstance(conn, ssl.SSLSocket) else None
        reader = FrameReader(conn)  # the peer closing ends it with ConnectionResetError
        if reader.read(len(HELLO)) != HELLO:
            log.warning("control wire: a peer sent a bad hello; closing")
            return
        self._server.established(conn)
        while True:
            length, mid, _ = FRAME.unpack(reader.read(FRAME.size))
            if length > MAX_BODY:
                msg = f"request of {length} bytes is over the {MAX_BODY}-byte limit".encode()
                conn.sendall(
                    FRAME.pack(len(msg), grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], 0) + msg
                )
                return
            status, reply = answer(self.handlers, mid, reader.read(length), caller)
            conn.sendall(FRAME.pack(len(reply), status.value[0], 0) + reply)

    def close(self) -> None:
        self._server.close()
