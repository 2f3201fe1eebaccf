"""``pdserve bench kvstore``: data-plane throughput and latency of the KV store.

Starts a ``pdserve kvstore master`` and a ``pdserve kvstore node`` as real processes and
measures from this (a different) process, per transport and object size, in two modes:

* ``single``: one object per operation. A put is the whole client flow (BatchPutStart,
  write, BatchPutEnd); a get is ``get_into`` a preallocated buffer (BatchGetReplicaList,
  read, lease release).
* ``batch``: N objects per operation, as an engine saves and loads one prompt's chunks:
  ``batch_put`` (one BatchPutStart and one BatchPutEnd for all) and ``batch_get_into`` (one
  lookup, network reads pipelined). N is ``--batch``, fewer for big objects
  (:data:`BATCH_BYTES`).

Reported: put and get GB/s (bytes moved / wall time of sequential operations) and p50/p99
latency per operation. Every system is measured ``--rounds`` times (default 3), in turn, each
store started afresh for each round, and each figure is the median across the rounds: the
machines are noisy, and a slow spell during one system's turn would otherwise decide a
ratio. Alongside: numpy memcpy of the same objects (the local limit: as many distinct
sources as the store run reads, so they are as far from the CPU caches), plain
loopback TCP with the same socket settings and nothing else (``tcp-plain``: what any tcp
transport here works against; machine noise can put a run of it below pdserve's), Mooncake Store's own client
(``put_from`` / ``get_into`` and ``batch_put_from`` / ``batch_get_into`` with registered
buffers against ``mooncake_master`` and a storage process) when Mooncake is installed,
``longest_prefix`` over 64 keys, and the control path alone: one master round trip over gRPC
and over the control wire. ``--tokens-compare`` adds pdserve's tcp against a second store whose
master runs with ``data_tokens`` off (``pdserve/tcp-notok``): what the per-range grant costs;
``--tls-compare`` adds it against a store with mutual TLS on the master's gRPC port and control
wire (``pdserve/tcp-tls``, certificates made for the run, this process a worker identity): what
``pdserve up``'s secure default costs. The tcp data port itself is never encrypted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pdserve.sizes import parse_size

#: Bytes moved per (transport, size, direction) at most; bounds the run time of big sizes.
BYTES_BUDGET = 512 * 1024 * 1024
#: Bytes in one batch at most (a batch of 64 MiB objects has 4).
BATCH_BYTES = 256 * 1024 * 1024


@dataclass
class Row:
    # "pdserve/shm", "pdserve/tcp", "pdserve/tcp+sum", "pdserve/tcp-notok" (data tokens off),
    # "pdserve/mooncake", "mooncake-store", "memcpy", "tcp-plain"
    system: str
    size: int  # bytes per object
    iterations: int  # operations timed per direction
    mode: str  # "single" or "batch"
    batch: int  # objects per operation (1 in single mode)
    put_gbps: float
    put_p50_us: float
    put_p99_us: float
    get_gbps: float
    get_p50_us: float
    get_p99_us: float
    rounds: int = 1  # rounds this row is the median of (iterations: summed over them)


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _measure(n: int, op: Callable[[int], object]) -> tuple[list[float], float]:
    lat = []
    start = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        op(i)
        lat.append(time.perf_counter() - t)
    return lat, time.perf_counter() - start


def _row(
    system: str,
    size: int,
    n: int,
    put: tuple[list[float], float],
    get: tuple[list[float], float],
    batch: int = 1,
) -> Row:
    (pl, pt), (gl, gt) = put, get
    moved = size * batch * n
    return Row(
        system,
        size,
        n,
        "single" if batch == 1 else "batch",
        batch,
        moved / pt / 1e9,
        _pct(pl, 0.5) * 1e6,
        _pct(pl, 0.99) * 1e6,
        moved / gt / 1e9,
        _pct(gl, 0.5) * 1e6,
        _pct(gl, 0.99) * 1e6,
    )


def iterations_for(size: int, iterations: int) -> int:
    """Operations of ``size`` bytes each timed per direction."""
    return max(3, min(iterations, BYTES_BUDGET // size))


def batch_for(size: int, batch: int) -> int:
    """Objects per batch of ``size``-byte objects."""
    return max(1, min(batch, BATCH_BYTES // size))


def _progress(msg: str) -> None:
    print(f"[bench kvstore] {msg}", file=sys.stderr, flush=True)


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
            res = _measure(n, copy)
            rows.append(_row("memcpy", size, n, res, res, nb))
            del src
    return rows


def _tcp_limit_peer(port_out, size: int, streams: int) -> None:
    """Child process of :func:`bench_tcp_limit`: sends a /dev/shm-backed buffer on request."""
    import mmap
    import socket
    import threading

    from pdserve.store.transports.tcp import _tune

    mm = mmap.mmap(-1, size)
    mm.write(b"\x07" * size)
    view = memoryview(mm)
    listener = socket.socket()
    _tune(listener)
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
                tcp._tune(sock)
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
            res = _measure(n, get)
            rows.append(_row("tcp-plain", size, n, res, res))
            for s in socks:
                s.close()
            pool.shutdown()
        finally:
            peer.join(10)
            if peer.is_alive():
                peer.kill()
    return rows


def bench_pdserve(
    address: str,
    transport: str,
    sizes: list[int],
    iterations: int,
    batch: int,
    checksums: bool = False,
    suffix: str = "",
) -> list[Row]:
    """pdserve's client over ``transport``. ``checksums``: objects stored with the raw
    checksum every read verifies (the default for raw objects); without, as KV chunks are
    stored (their header carries their checksum, checked when decoded) and as Mooncake
    stores everything. ``suffix`` ends the rows' system name (e.g. "-notok")."""
    from pdserve.store.api import StoreOptions
    from pdserve.store.client import StoreClient

    client = StoreClient(address, transport=transport, timeout_s=30)
    opts = StoreOptions(checksum=checksums)
    name = f"pdserve/{transport}" + ("+sum" if checksums else "") + suffix
    rows = []
    tag = f"{transport}-{int(checksums)}-{os.getpid()}"
    try:
        for size in sizes:
            n = iterations_for(size, iterations)
            _progress(f"{name} {_fmt_size(size)} x {n}")
            data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            view = memoryview(data)
            buf = np.empty(size, dtype=np.uint8)
            keys = [f"bench-{tag}-{size}-{i}" for i in range(n)]
            client.put(f"warm-{tag}-{size}", view, opts)  # connections, mappings
            client.get_into(f"warm-{tag}-{size}", memoryview(buf))
            put = _measure(n, lambda i, k=keys, v=view: client.put(k[i], v, opts))
            bview = memoryview(buf)
            get = _measure(n, lambda i, k=keys, b=bview: client.get_into(k[i], b))
            if not np.array_equal(buf, data):
                raise RuntimeError(f"{name}: read back different bytes")
            client.remove([*keys, f"warm-{tag}-{size}"])
            rows.append(_row(name, size, n, put, get))
            if batch > 1:
                rows.append(_bench_pdserve_batch(client, name, opts, tag, size, iterations, batch))
    finally:
        client.close()
    return rows


def _bench_pdserve_batch(
    client, name: str, opts, tag: str, size: int, iterations: int, batch: int
) -> Row:
    nb = batch_for(size, batch)
    n = iterations_for(size * nb, iterations)
    _progress(f"{name} batches of {nb} x {_fmt_size(size)}, {n} batches")
    data = np.random.default_rng(size + 1).integers(0, 256, (nb, size), dtype=np.uint8)
    srcs = [memoryview(row) for row in data]
    out = np.empty_like(data)
    dsts = [memoryview(row) for row in out]
    keys = [[f"batch-{tag}-{size}-{i}-{j}" for j in range(nb)] for i in range(n + 1)]
    client.batch_put(list(zip(keys[n], srcs, strict=True)), opts)  # warm-up batch
    client.batch_get_into(keys[n], dsts)
    put = _measure(n, lambda i: client.batch_put(list(zip(keys[i], srcs, strict=True)), opts))
    get = _measure(n, lambda i: client.batch_get_into(keys[i], dsts))
    if not np.array_equal(out, data):
        raise RuntimeError(f"{name} batch: read back different bytes")
    client.remove([k for ks in keys for k in ks])
    return _row(name, size, n, put, get, nb)


def bench_control(address: str, rounds: int = 500) -> dict[str, dict[str, float]]:
    """One master round trip, over gRPC and over the control wire: BatchGetReplicaList of
    one key (what a get waits for before its data moves) and LongestPrefix of 64 keys."""
    from pdserve.store.client import StoreClient

    out: dict[str, dict[str, float]] = {}
    keys = [f"control-{os.getpid()}-{i}" for i in range(64)]
    for control in ("grpc", "auto"):
        client = StoreClient(address, control=control)
        try:
            if control == "auto" and client.control_path != "wire":
                _progress("the master's control wire is off: skipping it")
                continue
            client.batch_put([(k, b"c" * 256) for k in keys[:48]])
            for _ in range(50):
                client._replica_lists(keys[:1])
                client.longest_prefix(keys)
            lookup, _ = _measure(rounds, lambda _i, c=client: c._replica_lists(keys[:1]))
            prefix, _ = _measure(rounds, lambda _i, c=client: c.longest_prefix(keys))
            client._release(keys[:1])  # the lookups' lease (remove flushes it first)
            client.remove(keys)
        finally:
            client.close()
        out["grpc" if control == "grpc" else "wire"] = {
            "lookup_p50_us": _pct(lookup, 0.5) * 1e6,
            "lookup_p99_us": _pct(lookup, 0.99) * 1e6,
            "prefix64_p50_us": _pct(prefix, 0.5) * 1e6,
            "prefix64_p99_us": _pct(prefix, 0.99) * 1e6,
        }
    return out


def bench_longest_prefix(address: str, rounds: int = 300) -> dict[str, float]:
    from pdserve.store.client import StoreClient

    client = StoreClient(address)
    keys = [f"prefix-{os.getpid()}-{i}" for i in range(64)]
    client.batch_put([(k, b"p" * 256) for k in keys[:48]])
    for _ in range(20):
        client.longest_prefix(keys)
    lat, _ = _measure(rounds, lambda _i: client.longest_prefix(keys))
    if client.longest_prefix(keys) != 48:
        raise RuntimeError("longest_prefix answered wrong")
    client.remove(keys)
    client.close()
    return {"keys": 64, "p50_us": _pct(lat, 0.5) * 1e6, "p99_us": _pct(lat, 0.99) * 1e6}


def bench_mooncake(
    sizes: list[int], iterations: int, batch: int, log_dir: Path, segment: int
) -> tuple[list[Row], dict[str, float]]:
    """Mooncake Store's own client: put_from / get_into and batch_put_from /
    batch_get_into with registered buffers."""
    from mooncake.store import MooncakeDistributedStore

    from pdserve.store.mooncake_backend import MooncakeCluster

    cluster = MooncakeCluster.start(log_dir, segment)
    rows = []
    try:
        store = MooncakeDistributedStore()
        biggest = max(max(sizes), max(s * batch_for(s, batch) for s in sizes))
        if (
            store.setup(
                "127.0.0.1", "P2PHANDSHAKE", 0, biggest + (1 << 20), "tcp", "", cluster.address
            )
            != 0
        ):
            raise RuntimeError("MooncakeDistributedStore.setup failed")
        src = np.empty(biggest, dtype=np.uint8)
        dst = np.empty(biggest, dtype=np.uint8)
        for arr in (src, dst):
            if store.register_buffer(arr.ctypes.data, arr.nbytes) != 0:
                raise RuntimeError("register_buffer failed")
        for size in sizes:
            n = iterations_for(size, iterations)
            _progress(f"mooncake-store {_fmt_size(size)} x {n}")
            src[:size] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            keys = [f"mc-{size}-{i}" for i in range(n)]
            store.put_from(f"warm-{size}", src.ctypes.data, size)
            store.get_into(f"warm-{size}", dst.ctypes.data, size)

            def put(i: int, size: int = size, keys: list[str] = keys) -> None:
                if store.put_from(keys[i], src.ctypes.data, size) != 0:
                    raise RuntimeError("mooncake put_from failed")

            def get(i: int, size: int = size, keys: list[str] = keys) -> None:
                rc = store.get_into(keys[i], dst.ctypes.data, size)
                if rc != size:
                    raise RuntimeError(f"mooncake get_into of {keys[i]} failed: {rc}")

            p, g = _measure(n, put), _measure(n, get)
            if not np.array_equal(src[:size], dst[:size]):
                raise RuntimeError("mooncake-store read back different bytes")
            _mooncake_remove(store, [*keys, f"warm-{size}"])
            rows.append(_row("mooncake-store", size, n, p, g))
            if batch > 1:
                rows.append(_bench_mooncake_batch(store, src, dst, size, iterations, batch))
        pkeys = [f"mcprefix-{i}" for i in range(64)]
        for k in pkeys[:48]:
            store.put(k, b"p" * 256)

        def prefix(_i: int) -> int:
            found = store.batch_is_exist(pkeys)
            return next((i for i, r in enumerate(found) if r != 1), len(found))

        lat, _ = _measure(300, prefix)
        store.close()
        return rows, {"keys": 64, "p50_us": _pct(lat, 0.5) * 1e6, "p99_us": _pct(lat, 0.99) * 1e6}
    finally:
        cluster.stop()


def _mooncake_remove(store, keys: list[str]) -> None:
    time.sleep(0.25)  # let read leases lapse
    for k in keys:
        store.remove(k, True)


def _bench_mooncake_batch(
    store, src: np.ndarray, dst: np.ndarray, size: int, iterations: int, batch: int
) -> Row:
    nb = batch_for(size, batch)
    n = iterations_for(size * nb, iterations)
    _progress(f"mooncake-store batches of {nb} x {_fmt_size(size)}, {n} batches")
    src[: size * nb] = np.random.default_rng(size + 1).integers(0, 256, size * nb, dtype=np.uint8)
    sptrs = [src.ctypes.data + j * size for j in range(nb)]
    dptrs = [dst.ctypes.data + j * size for j in range(nb)]
    sizes = [size] * nb
    keys = [[f"mcb-{size}-{i}-{j}" for j in range(nb)] for i in range(n + 1)]

    def put(i: int) -> None:
        rcs = store.batch_put_from(keys[i], sptrs, sizes)
        if any(rc != 0 for rc in rcs):
            raise RuntimeError(f"mooncake batch_put_from failed: {rcs}")

    def get(i: int) -> None:
        got = store.batch_get_into(keys[i], dptrs, sizes)
        if any(g != size for g in got):
            raise RuntimeError(f"mooncake batch_get_into failed: {got}")

    put(n)  # warm-up batch
    get(n)
    p, g = _measure(n, put), _measure(n, get)
    if not np.array_equal(src[: size * nb], dst[: size * nb]):
        raise RuntimeError("mooncake-store batch read back different bytes")
    _mooncake_remove(store, [k for ks in keys for k in ks])
    return _row("mooncake-store", size, n, p, g, nb)


def _fmt_size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def render(
    rows: list[Row], prefix: dict[str, dict[str, float]], control: dict[str, dict[str, float]]
) -> str:
    head = (
        f"{'system':<18}{'size':>8}{'batch':>6}{'n':>5}  {'put GB/s':>9}{'p50 us':>10}"
        f"{'p99 us':>10}  {'get GB/s':>9}{'p50 us':>10}{'p99 us':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r.mode != "single", r.size, r.system)):
        lines.append(
            f"{r.system:<18}{_fmt_size(r.size):>8}{r.batch:>6}{r.iterations:>5}  "
            f"{r.put_gbps:>9.2f}{r.put_p50_us:>10.0f}{r.put_p99_us:>10.0f}  "
            f"{r.get_gbps:>9.2f}{r.get_p50_us:>10.0f}{r.get_p99_us:>10.0f}"
        )
    lines.append("")
    for name, c in control.items():
        lines.append(
            f"one master round trip over {name}: lookup of 1 key p50 {c['lookup_p50_us']:.0f} us"
            f" (p99 {c['lookup_p99_us']:.0f}), longest_prefix of 64 p50 "
            f"{c['prefix64_p50_us']:.0f} us (p99 {c['prefix64_p99_us']:.0f})"
        )
    for name, p in prefix.items():
        lines.append(
            f"longest_prefix over {p['keys']:.0f} keys ({name}): p50 {p['p50_us']:.0f} us, "
            f"p99 {p['p99_us']:.0f} us"
        )
    lines += ratios(rows)
    return "\n".join(lines)


def ratios(rows: list[Row]) -> list[str]:
    """The comparisons the issue's targets name, one line each."""
    by = {(r.system, r.size, r.mode): r for r in rows}
    lines = []
    for r in sorted(rows, key=lambda r: (r.mode, r.size)):
        mc = by.get(("mooncake-store", r.size, r.mode))
        mem = by.get(("memcpy", r.size, r.mode))
        plain = by.get(("tcp-plain", r.size, "single"))
        where = f"{_fmt_size(r.size)} {r.mode}"
        if r.system in ("pdserve/tcp", "pdserve/tcp+sum") and mc is not None:
            lines.append(
                f"{r.system[8:]} / mooncake-store at {where}: get {r.get_gbps / mc.get_gbps:.2f}x "
                f"(p50 {r.get_p50_us:.0f} vs {mc.get_p50_us:.0f} us), "
                f"put {r.put_gbps / mc.put_gbps:.2f}x"
            )
        tls = by.get(("pdserve/tcp-tls", r.size, r.mode))
        if r.system == "pdserve/tcp" and tls is not None:
            lines.append(
                f"tcp with / without mutual TLS on the control path at {where}: get "
                f"{tls.get_gbps:.2f} vs {r.get_gbps:.2f} GB/s (p50 {tls.get_p50_us:.0f} vs "
                f"{r.get_p50_us:.0f} us), put p50 {tls.put_p50_us:.0f} vs {r.put_p50_us:.0f} us"
            )
        notok = by.get(("pdserve/tcp-notok", r.size, r.mode))
        if r.system == "pdserve/tcp" and notok is not None:
            lines.append(
                f"tcp with / without data tokens at {where}: get {r.get_gbps:.2f} vs "
                f"{notok.get_gbps:.2f} GB/s (p50 {r.get_p50_us:.0f} vs {notok.get_p50_us:.0f} us), "
                f"put p50 {r.put_p50_us:.0f} vs {notok.put_p50_us:.0f} us"
            )
        if r.system == "pdserve/tcp" and plain is not None and r.size >= 1 << 20:
            lines.append(
                f"tcp / plain loopback tcp at {where}: get {r.get_gbps / plain.get_gbps:.0%}"
            )
        if r.system == "pdserve/shm" and mem is not None:
            lines.append(
                f"shm / memcpy at {where}: put {r.put_gbps / mem.put_gbps:.0%}, "
                f"get {r.get_gbps / mem.get_gbps:.0%}"
            )
    return lines


def plot(rows: list[Row], path: Path) -> Path:
    """get GB/s per object size, one line per system, single and batch side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("single", "batch") if any(r.mode == m for r in rows)]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        for system in sorted({r.system for r in rows if r.mode == mode}):
            pts = sorted(
                (r.size, r.get_gbps) for r in rows if r.mode == mode and r.system == system
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("object size (bytes)")
        ax.set_ylabel("get GB/s")
        ax.set_title(f"KV store get, {'one object' if mode == 'single' else 'batched'} per call")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    from pdserve.store.mooncake_backend import available as mooncake_available

    sizes = [parse_size(s, what="--sizes") for s in args.sizes.split(",")]
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = set(transports) - {"shm", "tcp", "mooncake"}
    if unknown:
        raise SystemExit(f"--transports: unknown {sorted(unknown)}; choose shm, tcp, mooncake")
    if args.batch < 1:
        raise SystemExit("--batch must be >= 1 (1 = no batched runs)")
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    have_mc = mooncake_available()
    if not have_mc:
        _progress("mooncake is not installed: skipping the mooncake transport and Mooncake Store")
        transports = [t for t in transports if t != "mooncake"]
    n_max = max(iterations_for(s, args.iterations) for s in sizes)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-kvstore-"))
    _progress(f"logs in {log_dir}; up to {n_max} iterations per size; {args.rounds} round(s)")
    rounds = []
    for i in range(args.rounds):
        _progress(f"round {i + 1} of {args.rounds}")
        rounds.append(_round(args, sizes, transports, have_mc, log_dir / f"round-{i + 1}"))
    rows = median_rows([r[0] for r in rounds])
    prefix = _median_dicts([r[1] for r in rounds])
    control = _median_dicts([r[2] for r in rounds])
    print(render(rows, prefix, control))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "rows": [asdict(r) for r in rows],
                    "longest_prefix": prefix,
                    "control": control,
                    "rounds": [
                        {"rows": [asdict(r) for r in rr], "longest_prefix": p, "control": c}
                        for rr, p, c in rounds
                    ],
                },
                indent=2,
            )
        )
    if args.plot:
        print(f"plot: {plot(rows, Path(args.plot))}")
    return 0


def _round(
    args: argparse.Namespace,
    sizes: list[int],
    transports: list[str],
    have_mc: bool,
    log_dir: Path,
) -> tuple[list[Row], dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Every system once, one after the other, each store started afresh: the rows, the
    longest-prefix figures and the control-path figures of one round."""
    from pdserve.procs import local_store

    segment = max(64 << 20, max(_bytes_per_size(s, args) for s in sizes) + (16 << 20))
    rows = bench_memcpy(sizes, args.iterations, args.batch)
    if "tcp" in transports:
        _progress("plain loopback tcp")
        rows += bench_tcp_limit(sizes, args.iterations)
    prefix: dict[str, dict[str, float]] = {}
    served = ",".join(["shm", "tcp", *(["mooncake"] if "mooncake" in transports else [])])
    with local_store(log_dir, segment_size=segment, transports=served) as (master, _node):
        for t in transports:
            rows += bench_pdserve(master.info["grpc"], t, sizes, args.iterations, args.batch)
            if args.checksums and t == "tcp":
                rows += bench_pdserve(
                    master.info["grpc"], t, sizes, args.iterations, args.batch, checksums=True
                )
        _progress("longest_prefix and the control path (pdserve)")
        prefix["pdserve"] = bench_longest_prefix(master.info["grpc"])
        control = bench_control(master.info["grpc"])
    if args.tokens_compare and "tcp" in transports:
        _progress("pdserve tcp again, its master with data tokens off")
        with local_store(
            log_dir / "no-tokens",
            segment_size=segment,
            transports="tcp",
            master_flags={"data_tokens": False},
        ) as (master, _node):
            rows += bench_pdserve(
                master.info["grpc"], "tcp", sizes, args.iterations, args.batch, suffix="-notok"
            )
    if args.tls_compare and "tcp" in transports:
        _progress("pdserve tcp again, mutual TLS on the master and its control wire")
        rows_tls, control_tls = _bench_tls(log_dir / "tls", segment, sizes, args)
        rows += rows_tls
        control |= {f"{path} + mutual TLS": c for path, c in control_tls.items()}
    if have_mc and not args.no_mooncake_store:
        # Mooncake evicts above 90 % use and frees removed objects lazily: give it room for
        # every object of the run (and at least 64 MiB: its setup fails on tiny segments).
        mc_segment = max(64 << 20, 2 * sum(_bytes_per_size(s, args) for s in sizes))
        mc_rows, mc_prefix = bench_mooncake(sizes, args.iterations, args.batch, log_dir, mc_segment)
        rows += mc_rows
        prefix["mooncake-store batch_is_exist"] = mc_prefix
    return rows, prefix, control


def median_rows(rounds: list[list[Row]]) -> list[Row]:
    """One row per (system, size, batch) over the rounds: each figure the median of that
    figure across the rounds that measured it, ``iterations`` their sum, ``rounds`` their
    count. The machines are noisy and the systems run one after the other: medians over
    alternating rounds keep one slow spell from deciding a ratio."""
    groups: dict[tuple[str, int, int], list[Row]] = {}
    for rows in rounds:
        for r in rows:
            groups.setdefault((r.system, r.size, r.batch), []).append(r)
    out = []
    for (system, size, batch), rs in groups.items():
        figures = {
            f: statistics.median([getattr(r, f) for r in rs])
            for f in (
                "put_gbps",
                "put_p50_us",
                "put_p99_us",
                "get_gbps",
                "get_p50_us",
                "get_p99_us",
            )
        }
        out.append(
            Row(
                system,
                size,
                sum(r.iterations for r in rs),
                rs[0].mode,
                batch,
                **figures,
                rounds=len(rs),
            )
        )
    return out


def _median_dicts(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """``{name: {figure: value}}`` per round -> the median of each figure across rounds."""
    out: dict[str, dict[str, float]] = {}
    for name in rounds[0]:
        got = [r[name] for r in rounds if name in r]
        out[name] = {f: statistics.median([g[f] for g in got]) for f in got[0]}
    return out


def _bench_tls(
    log_dir: Path, segment: int, sizes: list[int], args: argparse.Namespace
) -> tuple[list[Row], dict[str, float]]:
    """pdserve tcp (and one control round trip) against a store whose master and node run
    with mutual TLS, this process presenting a worker certificate."""
    from pdserve import identity
    from pdserve.commands import certs
    from pdserve.procs import local_store

    d = log_dir / "certs"
    certs.make(d, ["master:bench-master", "node:bench-node", "worker:bench"])

    def tls(name: str) -> dict[str, object]:
        return {"tls_ca": d / "ca.crt", "tls_cert": d / f"{name}.crt", "tls_key": d / f"{name}.key"}

    identity.configure_files(identity.TlsFiles.load(*(str(v) for v in tls("bench").values())))
    try:
        with local_store(
            log_dir,
            segment_size=segment,
            transports="tcp",
            node_id="bench-node",
            node_flags=tls("bench-node"),
            master_flags=tls("bench-master"),
        ) as (master, _node):
            rows = bench_pdserve(
                master.info["grpc"], "tcp", sizes, args.iterations, args.batch, suffix="-tls"
            )
            control = bench_control(master.info["grpc"])
    finally:
        identity.configure_files(None)
    return rows, control


def _bytes_per_size(size: int, args: argparse.Namespace) -> int:
    """Bytes stored at once while one size runs (single-mode objects plus the warm-up)."""
    single = size * (iterations_for(size, args.iterations) + 1)
    if args.batch <= 1:
        return single
    nb = batch_for(size, args.batch)
    return max(single, size * nb * (iterations_for(size * nb, args.iterations) + 1))
