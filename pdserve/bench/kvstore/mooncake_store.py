"""Mooncake Store's own client, the baseline of ``pdserve bench kvstore``: ``put_from`` /
``get_into`` and their batched forms with registered buffers against ``mooncake_master``."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from pdserve.bench.kvstore.measure import (
    Row,
    batch_for,
    fmt_size,
    iterations_for,
    measure,
    pct,
    progress,
    timed_row,
)


def bench_mooncake(
    sizes: list[int], iterations: int, batch: int, log_dir: Path, segment: int
) -> tuple[list[Row], dict[str, float]]:
    """Mooncake Store's own client: put_from / get_into and batch_put_from /
    batch_get_into with registered buffers."""
    from mooncake.store import MooncakeDistributedStore

    from pdserve.store.mooncake_cluster import MooncakeCluster

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
            progress(f"mooncake-store {fmt_size(size)} x {n}")
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

            p, g = measure(n, put), measure(n, get)
            if not np.array_equal(src[:size], dst[:size]):
                raise RuntimeError("mooncake-store read back different bytes")
            _mooncake_remove(store, [*keys, f"warm-{size}"])
            rows.append(timed_row("mooncake-store", size, n, p, g))
            if batch > 1:
                rows.append(_bench_mooncake_batch(store, src, dst, size, iterations, batch))
        pkeys = [f"mcprefix-{i}" for i in range(64)]
        for k in pkeys[:48]:
            store.put(k, b"p" * 256)

        def prefix(_i: int) -> int:
            found = store.batch_is_exist(pkeys)
            return next((i for i, r in enumerate(found) if r != 1), len(found))

        lat, _ = measure(300, prefix)
        store.close()
        return rows, {"keys": 64, "p50_us": pct(lat, 0.5) * 1e6, "p99_us": pct(lat, 0.99) * 1e6}
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
    progress(f"mooncake-store batches of {nb} x {fmt_size(size)}, {n} batches")
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
    p, g = measure(n, put), measure(n, get)
    if not np.array_equal(src[: size * nb], dst[: size * nb]):
        raise RuntimeError("mooncake-store batch read back different bytes")
    _mooncake_remove(store, [k for ks in keys for k in ks])
    return timed_row("mooncake-store", size, n, p, g, nb)
