"""The client side of pdserve's tcp transport (protocol: :mod:`pdserve.store.transports.tcp`):
a small pool of persistent blocking sockets per node, READV / WRITEV only, large transfers
split over :data:`~pdserve.store.transports.tcp.PARALLEL_STREAMS` connections at once."""

from __future__ import annotations

import collections
import functools
import socket
import threading
from collections.abc import Callable, Sequence

from pdserve.store.netio import advance, iov, kernel_timeouts, recv_parts, send_parts
from pdserve.store.transports.base import (
    TransferThreads,
    Transport,
    TransportError,
    balanced_groups,
    check_range,
    check_write,
)
from pdserve.store.transports.tcp import (
    FLAG_STREAM,
    MAX_RANGES,
    OP_READV,
    OP_WRITEV,
    PARALLEL_MIN_BYTES,
    PARALLEL_STREAMS,
    RANGE,
    REP,
    REP_MAGIC,
    REQ,
    REQ_MAGIC,
    ST_OK,
    STATUS_TEXT,
    VERSION,
    segment_key,
    tune_socket,
    writev_pad,
)
from pdserve.v1 import kvstore_pb2

#: A range as the client sends it: (item index, segment key, offset, length, buffer, grant
#: as in :data:`GRANT`).
_Range = tuple[int, int, int, int, memoryview, tuple[int, int, int, int, bytes]]


def _split(ranges: list, streams: int) -> list[list]:
    """``ranges`` (4th field: bytes) cut into at most ``streams`` consecutive groups of
    about equal bytes; one group below PARALLEL_MIN_BYTES in all."""
    sizes = [r[3] for r in ranges]
    if sum(sizes) < PARALLEL_MIN_BYTES or len(ranges) == 1:
        return [ranges]
    return balanced_groups(ranges, sizes, streams)


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
        tune_socket(sock)  # before connect: the receive window is sized at the handshake
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
            flags = FLAG_STREAM if len(groups) > 1 else 0
            jobs = [functools.partial(self._vector, op, address, g, flags) for g in groups]
            for group, err in zip(groups, self._run(jobs), strict=True):
                if err is not None:
                    for i, *_ in group:
                        errors[i] = errors[i] or err
        return errors

    def _vector(self, op: int, address: str, ranges: list[_Range], flags: int = 0) -> None:
        """READV / WRITEV requests for ``ranges`` on one connection (``flags``: the
        header's, :data:`FLAG_STREAM` for one of a transfer's parallel streams)."""
        for lo in range(0, len(ranges), MAX_RANGES):
            batch = ranges[lo : lo + MAX_RANGES]
            head = REQ.pack(REQ_MAGIC, VERSION, op, flags, 0, 0, len(batch))
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
