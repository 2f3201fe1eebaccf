"""The local limits a store run is read against: numpy memcpy of the same objects, and plain
loopback TCP with pdserve's socket settings and nothing else (``tcp-plain``)."""

from __future__ import annotations

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


def _tcp_limit_peer(port_out, size: int, streams: int) -> None:
    """Child process of :func:`bench_tcp_limit`: sends a /dev/shm-backed buffer on request."""
    import mmap
    import socket
    import threading

    from pdserve.store.transports.tcp import tune_socket

    mm = mmap.mmap(-1, size)
    mm.write(b"\x07" * size)
    view = memoryview(mm)
    listener = socket.socket()
    tune_socket(listener)
    listener.bind(("127.0.0.1", 0))
    listener.listen(streams)
    port_out.put(listener.getsockname()[1])
    part = size // streams

    def serve(conn: socket.socket, i: int) -> None:
        lo, hi = i * part, size if i == streams - 1 else (i + 1) * part
        while conn.recv(1):
            conn.sendall(view[lo:hi])

    conns = [listener.accept()[0] for _ in range(streams)]
    threads = [threading.Thread(target=serve, args=(c, i)) for i, c in enumerate(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def bench_tcp_limit(sizes: list[int], iterations: int) -> list[Row]:
    """Loopback TCP with nothing else: one process sends a buffer, this one receives it
    into a reused buffer, with pdserve's socket settings and stream count: what any tcp
    transport on this machine works against (gets only)."""
    import multiprocessing
    import socket

    from pdserve.store import netio
    from pdserve.store.transports import tcp

    rows = []
    ctx = multiprocessing.get_context("spawn")
    for size in sizes:
        streams = tcp.PARALLEL_STREAMS if size >= tcp.PARALLEL_MIN_BYTES else 1
        q = ctx.Queue()
        peer = ctx.Process(target=_tcp_limit_peer, args=(q, size, streams), daemon=True)
        peer.start()
        try:
            port = q.get(timeout=60)
            socks = []
            for _ in range(streams):
                sock = socket.socket()
                tcp.tune_socket(sock)
                sock.connect(("127.0.0.1", port))
                socks.append(sock)
            buf = memoryview(np.empty(size, dtype=np.uint8))
            part = size // streams
            views = [
                buf[i * part : size if i == streams - 1 else (i + 1) * part] for i in range(streams)
            ]

            pool = ThreadPoolExecutor(max(1, streams - 1))

            def one(i: int, socks: list = socks, views: list = views) -> None:
                socks[i].sendall(b"r")
                netio.recv_parts(socks[i], [views[i]])

            def get(_i: int, streams: int = streams, pool: ThreadPoolExecutor = pool) -> None:
                others = [pool.submit(one, i) for i in range(1, streams)]  # as pdserve's client
                one(0)
                for f in others:
                    f.result()

            get(0)
            n = iterations_for(size, iterations)
            res = measure(n, get)
            rows.append(timed_row("tcp-plain", size, n, res, res))
            for s in socks:
                s.close()
            pool.shutdown()
        finally:
            peer.join(10)
            if peer.is_alive():
                peer.kill()
    return rows
