"""``pdserve bench kvstore``: data-plane throughput and latency of the KV store.

Starts a ``pdserve kvstore master`` and a ``pdserve kvstore node`` as real processes and
measures from this (a different) process, per transport and object size: put and get GB/s
(bytes moved / wall time of sequential operations) and p50/p99 latency of each operation.
A put is the whole client flow (BatchPutStart, write, BatchPutEnd); a get is ``get_into`` a
preallocated buffer (BatchGetReplicaList, read, BatchReleaseLease). Alongside: numpy memcpy
of the same sizes (the local limit), Mooncake Store's own client (``put_from`` / ``get_into``
with registered buffers against ``mooncake_master`` and a storage process) when Mooncake is
installed, and ``longest_prefix`` over 64 keys.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pdserve.store.segment import parse_size

#: Bytes moved per (transport, size, direction) at most; bounds the run time of big sizes.
BYTES_BUDGET = 512 * 1024 * 1024


@dataclass
class Row:
    system: str  # "pdserve/shm", "pdserve/tcp", "pdserve/mooncake", "mooncake-store", "memcpy"
    size: int
    iterations: int
    put_gbps: float
    put_p50_us: float
    put_p99_us: float
    get_gbps: float
    get_p50_us: float
    get_p99_us: float


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
    system: str, size: int, n: int, put: tuple[list[float], float], get: tuple[list[float], float]
) -> Row:
    (pl, pt), (gl, gt) = put, get
    return Row(
        system,
        size,
        n,
        size * n / pt / 1e9,
        _pct(pl, 0.5) * 1e6,
        _pct(pl, 0.99) * 1e6,
        size * n / gt / 1e9,
        _pct(gl, 0.5) * 1e6,
        _pct(gl, 0.99) * 1e6,
    )


def iterations_for(size: int, iterations: int) -> int:
    return max(3, min(iterations, BYTES_BUDGET // size))


def _progress(msg: str) -> None:
    print(f"[bench kvstore] {msg}", file=sys.stderr, flush=True)


def bench_memcpy(sizes: list[int], iterations: int) -> list[Row]:
    rows = []
    for size in sizes:
        n = iterations_for(size, iterations)
        src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        res = _measure(n, lambda _i, d=dst, s=src: np.copyto(d, s))
        rows.append(_row("memcpy", size, n, res, res))
    return rows


def bench_pdserve(address: str, transport: str, sizes: list[int], iterations: int) -> list[Row]:
    from pdserve.store.client import StoreClient

    client = StoreClient(address, transport=transport, timeout_s=30)
    rows = []
    try:
        for size in sizes:
            n = iterations_for(size, iterations)
            _progress(f"pdserve/{transport} {size} B x {n}")
            data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            view = memoryview(data)
            buf = np.empty(size, dtype=np.uint8)
            keys = [f"bench-{transport}-{size}-{i}-{os.getpid()}" for i in range(n)]
            client.put(f"warm-{transport}-{size}", view)  # connections, mappings
            client.get_into(f"warm-{transport}-{size}", memoryview(buf))
            put = _measure(n, lambda i, k=keys, v=view: client.put(k[i], v))
            bview = memoryview(buf)
            get = _measure(n, lambda i, k=keys, b=bview: client.get_into(k[i], b))
            if not np.array_equal(buf, data):
                raise RuntimeError(f"pdserve/{transport}: read back different bytes")
            client.remove([*keys, f"warm-{transport}-{size}"])
            rows.append(_row(f"pdserve/{transport}", size, n, put, get))
    finally:
        client.close()
    return rows


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
    sizes: list[int], iterations: int, log_dir: Path, segment: int
) -> tuple[list[Row], dict[str, float]]:
    """Mooncake Store's own client: put_from / get_into with registered buffers."""
    from mooncake.store import MooncakeDistributedStore

    from pdserve.store.mooncake_backend import MooncakeCluster

    cluster = MooncakeCluster.start(log_dir, segment)
    rows = []
    try:
        store = MooncakeDistributedStore()
        if (
            store.setup(
                "127.0.0.1", "P2PHANDSHAKE", 0, max(sizes) + (1 << 20), "tcp", "", cluster.address
            )
            != 0
        ):
            raise RuntimeError("MooncakeDistributedStore.setup failed")
        src = np.empty(max(sizes), dtype=np.uint8)
        dst = np.empty(max(sizes), dtype=np.uint8)
        for arr in (src, dst):
            if store.register_buffer(arr.ctypes.data, arr.nbytes) != 0:
                raise RuntimeError("register_buffer failed")
        for size in sizes:
            n = iterations_for(size, iterations)
            _progress(f"mooncake-store {size} B x {n}")
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
            time.sleep(0.25)  # let read leases lapse
            for k in [*keys, f"warm-{size}"]:
                store.remove(k, True)
            rows.append(_row("mooncake-store", size, n, p, g))
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


def _fmt_size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def render(rows: list[Row], prefix: dict[str, dict[str, float]]) -> str:
    head = f"{'system':<18}{'size':>8}{'n':>5}  {'put GB/s':>9}{'p50 us':>10}{'p99 us':>10}  {'get GB/s':>9}{'p50 us':>10}{'p99 us':>10}"
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r.size, r.system)):
        lines.append(
            f"{r.system:<18}{_fmt_size(r.size):>8}{r.iterations:>5}  {r.put_gbps:>9.2f}{r.put_p50_us:>10.0f}"
            f"{r.put_p99_us:>10.0f}  {r.get_gbps:>9.2f}{r.get_p50_us:>10.0f}{r.get_p99_us:>10.0f}"
        )
    lines.append("")
    for name, p in prefix.items():
        lines.append(
            f"longest_prefix over {p['keys']:.0f} keys ({name}): p50 {p['p50_us']:.0f} us, p99 {p['p99_us']:.0f} us"
        )
    by = {(r.system, r.size): r for r in rows}
    for r in rows:
        mc = by.get(("mooncake-store", r.size))
        mem = by.get(("memcpy", r.size))
        if r.system == "pdserve/tcp" and mc is not None:
            lines.append(
                f"tcp get / mooncake-store get at {_fmt_size(r.size)}: {r.get_gbps / mc.get_gbps:.2f}x"
            )
        if r.system == "pdserve/shm" and mem is not None:
            lines.append(
                f"shm / memcpy at {_fmt_size(r.size)}: put {r.put_gbps / mem.put_gbps:.0%}, get {r.get_gbps / mem.get_gbps:.0%}"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from pdserve.procs import local_store
    from pdserve.store.mooncake_backend import available as mooncake_available

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = set(transports) - {"shm", "tcp", "mooncake"}
    if unknown:
        raise SystemExit(f"--transports: unknown {sorted(unknown)}; choose shm, tcp, mooncake")
    have_mc = mooncake_available()
    if not have_mc:
        _progress("mooncake is not installed: skipping the mooncake transport and Mooncake Store")
        transports = [t for t in transports if t != "mooncake"]
    n_max = max(iterations_for(s, args.iterations) for s in sizes)
    segment = max(
        64 << 20, max(s * (iterations_for(s, args.iterations) + 1) for s in sizes) + (16 << 20)
    )
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-kvstore-"))
    _progress(f"logs in {log_dir}; up to {n_max} iterations per size; segment {_fmt_size(segment)}")
    rows = bench_memcpy(sizes, args.iterations)
    prefix: dict[str, dict[str, float]] = {}
    served = ",".join(["shm", "tcp", *(["mooncake"] if "mooncake" in transports else [])])
    with local_store(log_dir, segment_size=segment, transports=served) as (master, _node):
        for t in transports:
            rows += bench_pdserve(master.info["grpc"], t, sizes, args.iterations)
        _progress("longest_prefix (pdserve)")
        prefix["pdserve"] = bench_longest_prefix(master.info["grpc"])
    if have_mc and not args.no_mooncake_store:
        # Mooncake evicts above 90 % use and frees removed objects lazily: give it room for
        # every object of the run (and at least 64 MiB: its setup fails on tiny segments).
        mc_segment = max(
            64 << 20, 2 * sum(s * (iterations_for(s, args.iterations) + 1) for s in sizes)
        )
        mc_rows, mc_prefix = bench_mooncake(sizes, args.iterations, log_dir, mc_segment)
        rows += mc_rows
        prefix["mooncake-store batch_is_exist"] = mc_prefix
    print(render(rows, prefix))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": [asdict(r) for r in rows], "longest_prefix": prefix}, indent=2)
        )
    return 0
