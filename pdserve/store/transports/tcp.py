"""pdserve's built-in TCP transport: raw sockets, a fixed binary header, raw payload bytes.
This module is its protocol (the wire format below, the status codes, the socket tuning);
the client is :mod:`.tcp_client` (:class:`~.tcp_client.TcpTransport`), the node's server
:mod:`.tcp_server` (:class:`~.tcp_server.TcpServer`).

Protocol version 3. Request header (little-endian, 32 bytes)::

    magic b"PDKT" | version u8 (3) | op u8 (1 READ, 2 WRITE, 3 READV, 4 WRITEV)
    | flags u16 | segment key u64 (first 8 bytes of BLAKE3(segment id)) | offset u64
    | length u64

Flags are hints; a node ignores the bits it does not know (they were reserved, always 0,
before :data:`FLAG_STREAM`). :data:`FLAG_STREAM`: the request is one of the parallel streams
of one transfer, and a node serves it from a client on its own host on the CPU it came from
(:mod:`pdserve.store.affinity`).

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

import functools
import socket
import struct

import blake3

from pdserve.store import grants

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
#: Request flag: one of a transfer's parallel streams (see the module's doc).
FLAG_STREAM = 1
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


@functools.lru_cache(maxsize=4096)
def segment_key(segment_id: str) -> int:
    """The u64 that names a segment on the wire (memoized: every range names one)."""
    return int.from_bytes(blake3.blake3(segment_id.encode()).digest(length=8), "little")


def tune_socket(sock: socket.socket) -> None:
    """Sets a data-plane socket's options (client and node alike)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCK_BUF:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
