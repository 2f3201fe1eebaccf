"""The local limits a store run is read against: numpy memcpy of the same objects, and plain
loopback TCP with pdserve's socket settings and nothing else (``tcp-plain``: distinct, cold
regions, as a store reads distinct objects; ``tcp-plain-warm``: one warm buffer again and
again). The disk limit is in :mod:`pdserve.bench.kvstore.disk`."""

from __future__ import annotations

import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pdserve.bench.kvstore.measure import Row, batch_for, iterations_for, measure, timed_row


def bench_memcpy(sizes: list[int], iterations: int, batch: int) -> list[Row]:
    """numpy memcpy of what a get moves: as many distinct objects as the store run reads
    (so a source is as far from the CPU caches as a stored object), into the same
    destination buffers the store run reuses."""
    rows = []
    for size in sizes:
        for nb in (1, batch_for(size, batch)) if batch > 1 else (1,):
            n = iterations_for(size * nb, iterations)
            src = np.full((n, nb, size), 7, dtype=np.uint8)  # touches every page
            dst = np.empty((nb, size), dtype=np.uint8)

            def copy(i: int, d: np.ndarray = dst, s: np.ndarray = src) -> None:
                for j in range(len(d)):  # one copy per object, as a store reads them
                    np.copyto(d[j], s[i, j])

            copy(0)
            res = measure(n, copy)
            rows.append(timed_row("memcpy", size, n, res, res, nb))
            del src
    return rows


#: The buffer each side of tcp-plain cycles through: at least this many bytes (far beyond
#: any CPU cache) and enough regions that no timed read repeats one ...
TCP_COLD_MIN_BYTES = 256 * 1024 * 1024
#: ... but at most this many bytes per side, and at most an eighth of the memory available.
TCP_COLD_MAX_BYTES = 1024 * 1024 * 1024
#: Multiplier of tcp-plain's source pattern: 8-byte word ``w`` holds ``w * _GOLDEN`` (mod
#: 2**64), so every region differs and every byte of a word varies.
_GOLDEN = 0x9E3779B97F4A7C15
#: A tcp-plain request: offset and length of the bytes to send, and whether it is one of the
#: parallel streams of one get (the peer then serves it as a pdserve node serves a stream).
_REQ = struct.Struct("<QQQ")


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def cold_regions(size: int, n: int) -> int:
    """Regions of ``size`` bytes in each side's buffer for ``n`` timed reads (and a warm-up):
    every read a distinct region, the buffer at least :data:`TCP_COLD_MIN_BYTES`, at most
    :data:`TCP_COLD_MAX_BYTES` and an eighth of the available memory (the regions are then
    reused, the cycle still far beyond the caches), and never fewer than two."""
    want = max(TCP_COLD_MIN_BYTES, size * (n + 1))
    cap = min(TCP_COLD_MAX_BYTES, _mem_available() // 8)
    return max(2, min(want, cap) // size)


def plain_pattern(lo: int, hi: int) -> np.ndarray:
    """Bytes ``lo`` to ``hi`` of tcp-plain's source buffer (what the peer sends)."""
    w0, w1 = lo // 8, -(-hi // 8)
    words = np.arange(w0, w1, dtype=np.uint64) * np.uint64(_GOLDEN)
    return words.view(np.uint8)[lo - 8 * w0 : hi - 8 * w0]


def _tcp_limit_peer(port_out, total: int) -> None:
    """Child process of :func:`bench_tcp_limit`: an anonymous mapping of ``total`` bytes,
    every page written (:func:`plain_pattern`); each request on any connection (an offset and
    a length) is answered with those bytes, a stream of a split get on the CPU it came from as
    a pdserve node serves one (:mod:`pdserve.store.affinity`). Runs until killed."""
    import socket
    import threading

    from pdserve.store.affinity import CpuFollower
    from pdserve.store.transports.tcp import tune_socket

    mm = mmap.mmap(-1, total)
    arr = np.frombuffer(mm, dtype=np.uint8)
    step = 64 << 20
    for lo in range(0, total, step):
        arr[lo : min(total, lo + step)] = plain_pattern(lo, min(total, lo + step))
    view = memoryview(mm)
    listener = socket.socket()
    tune_socket(listener)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port_out.put(listener.getsockname()[1])

    def serve(conn: socket.socket) -> None:
        cpu = CpuFollower(conn)
        while len(req := conn.recv(_REQ.size, socket.MSG_WAITALL)) == _REQ.size:
            offset, length, stream = _REQ.unpack(req)
            cpu.request(bool(stream))
            conn.sendall(view[offset : offset + length])

    while True:
        conn = listener.accept()[0]
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _peer_port(q, peer, timeout_s: float = 120.0) -> int:
    """The port the tcp-plain peer listens on, once it has filled its buffer; raises if it
    dies first (not waiting the whole timeout)."""
    import queue
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            if not peer.is_alive():
                raise RuntimeError(f"tcp-plain peer exited ({peer.exitcode})") from None
            if time.monotonic() > deadline:
                raise


def bench_tcp_limit(
    sizes: list[int], iterations: int, verify: bool = False, batch: int = 1
) -> list[Row]:
    """Loopback TCP with nothing else, with pdserve's socket settings, stream count and
    placement of a split get's streams: what any tcp transport on this machine works against
    (gets only; put mirrors get).

    ``tcp-plain`` (the bound the report's ratios use): a peer process holds a large buffer
    of distinct bytes (:func:`cold_regions`: at least 256 MiB, every timed read its own
    region, up to 1 GiB) and each get asks it for the next region, received into the
    matching region of an equally large buffer here. So, as a store get reads a distinct,
    cold object, no read finds its source or destination in a CPU cache: the copies into
    and out of the kernel pay for memory, as the store's do. ``tcp-plain-warm``: the figure
    this row used to be, one region sent and received again and again (both ends stay in
    the caches up to about the last-level cache's size): flattering, kept for comparison.

    ``batch`` > 1: also a batch row per size (:func:`batch_for` objects), each get the
    batch's bytes in one region split over the streams as pdserve's client splits a batch
    (the store reads a batch into adjacent buffers too): what a batched get works against.

    ``verify``: after the timing, check every region received holds the bytes sent."""
    rows = []
    for size in sizes:
        gets = [(size, 1, iterations_for(size, iterations))]
        nb = batch_for(size, batch) if batch > 1 else 1
        if nb > 1:
            gets.append((size, nb, iterations_for(size * nb, iterations)))
        rows += _tcp_limit_size(gets, verify)
    return rows


class PlainPeer:
    """A tcp-plain peer (:func:`_tcp_limit_peer`, a child process holding ``total`` bytes)
    and this side's connections to it (pdserve's socket settings, PARALLEL_STREAMS of them)
    and equally large receive buffer (``dst``, every page touched). :meth:`get` reads one
    region as pdserve's client reads an object or a batch. Use as a context manager: the
    peer is killed on exit."""

    def __init__(self, total: int) -> None:
        import multiprocessing
        import socket

        from pdserve.store.transports import tcp

        self.total = total
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        self.peer = ctx.Process(target=_tcp_limit_peer, args=(q, total), daemon=True)
        self.peer.start()
        self.pool = ThreadPoolExecutor(max(1, tcp.PARALLEL_STREAMS - 1))
        self.socks: list[socket.socket] = []
        try:
            port = _peer_port(q, self.peer)
            for _ in range(tcp.PARALLEL_STREAMS):
                sock = socket.socket()
                self.socks.append(sock)
                tcp.tune_socket(sock)
                sock.connect(("127.0.0.1", port))
            self.dst = np.frombuffer(mmap.mmap(-1, total), dtype=np.uint8)
            self.dst.fill(0xA5)  # every page touched before the timing
        except BaseException:
            self.close()
            raise
        self.buf = memoryview(self.dst)

    def get(self, size: int, r: int) -> None:
        """Reads region ``r`` of ``size`` bytes (bytes ``r * size`` on) into the same region
        of :attr:`dst`, split over PARALLEL_STREAMS connections from PARALLEL_MIN_BYTES on (as
        pdserve's client splits an object or a batch), the first part on this thread."""
        from pdserve.store import netio
        from pdserve.store.transports import tcp

        streams = tcp.PARALLEL_STREAMS if size >= tcp.PARALLEL_MIN_BYTES else 1
        part = size // streams

        def one(i: int) -> None:
            lo = r * size + i * part
            hi = r * size + (size if i == streams - 1 else (i + 1) * part)
            self.socks[i].sendall(_REQ.pack(lo, hi - lo, streams > 1))
            if not netio.recv_parts(self.socks[i], [self.buf[lo:hi]]):
                raise RuntimeError("the tcp-plain peer closed the connection")

        others = [self.pool.submit(one, i) for i in range(1, streams)]
        one(0)
        for f in others:
            f.result()

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.pool.shutdown()
        self.peer.kill()
        self.peer.join(10)

    def __enter__(self) -> PlainPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tcp_limit_size(gets: list[tuple[int, int, int]], verify: bool) -> list[Row]:
    """:func:`bench_tcp_limit` at one object size, one peer for all its rows: per
    ``(object size, objects per get, timed gets)`` in ``gets``, the tcp-plain and
    tcp-plain-warm rows. Each get's bytes are one region of a buffer as large as the most
    cold regions any of them wants (:meth:`PlainPeer.get`)."""
    total = max(cold_regions(obj * nb, n) * obj * nb for obj, nb, n in gets)
    with PlainPeer(total) as peer:
        rows: list[Row] = []
        for obj, nb, n in gets:
            rows += _tcp_plain_rows(obj, nb, n, total // (obj * nb), peer)
            if verify:
                _check_plain(peer.dst, obj * nb, min(total // (obj * nb), n + 1))
        return rows


def _tcp_plain_rows(obj: int, nb: int, n: int, regions: int, peer: PlainPeer) -> list[Row]:
    """The tcp-plain row (``n`` gets, each the next of ``regions`` regions of ``obj * nb``
    bytes) and the tcp-plain-warm row (region 0 again and again)."""
    import itertools

    size = obj * nb
    nxt = itertools.count(1)

    def row(system: str, res: tuple[list[float], float]) -> Row:
        return timed_row(system, obj, n, res, res, nb)

    peer.get(size, 0)  # connections, slow start
    rows = [row("tcp-plain", measure(n, lambda _i: peer.get(size, next(nxt) % regions)))]
    rows.append(row("tcp-plain-warm", measure(n, lambda _i: peer.get(size, 0))))
    return rows


def _check_plain(dst: np.ndarray, size: int, regions: int) -> None:
    """The first ``regions`` regions of ``size`` bytes (those the gets read: region 0 and
    then the next ones in turn) hold the bytes the peer sent."""
    for r in range(regions):
        got = dst[r * size : (r + 1) * size]
        if not np.array_equal(got, plain_pattern(r * size, (r + 1) * size)):
            raise RuntimeError(f"tcp-plain {size} B: region {r} received wrong bytes")
