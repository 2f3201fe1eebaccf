"""The gets the Mooncake Store comparison turns on, measured side by side: plain loopback tcp
(``tcp-plain``), pdserve's tcp get as a KV connector reads (``pdserve/tcp+lookup``) and
Mooncake Store's own client, one get of each in turn with every server up (who goes first
rotates), per size one object per get and a batch per get.

The rows of a round measure one system after the other, seconds to minutes apart, with
different processes alive (plain tcp runs before any store is started), and this machine's
speed moves between them: Mooncake Store's own 1 MiB p50 moved 2x between runs of one day.
Here every system meets the same moment, so the ratios hold for one set of conditions, and
``tcp-plain / mooncake-store`` is how far ahead any tcp get over this loopback with these
socket settings can be in those conditions (a store's get moves the same bytes and does more).

Each system reads distinct objects (tcp-plain: distinct cold regions), as the main rows do:
pdserve's single gets look up the next 16 keys before every 16th get, a batch looks its keys
up first (``longest_prefix``, then ``batch_get_into``); Mooncake's single get is
``get_into`` and its batch ``batch_get_into``, into registered buffers. After the timing, the
bytes of each store's last get are compared with what was put."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pdserve.bench.kvstore.limits import PlainPeer, cold_regions
from pdserve.bench.kvstore.measure import batch_for, fmt_size, iterations_for, pct, progress
from pdserve.bench.kvstore.pdserve_store import looked_up_batch, looked_up_get

#: The systems in the order of the first get (it rotates get by get).
SYSTEMS = ("tcp-plain", "pdserve/tcp+lookup", "mooncake-store")


@dataclass
class SideBySide:
    """One size and mode: per system its get p50 and GB/s over the same ``iterations``."""

    size: int
    batch: int
    iterations: int
    p50_us: dict[str, float]
    gbps: dict[str, float]

    def line(self) -> str:
        mode = "single" if self.batch == 1 else f"batch of {self.batch}"
        plain, pd, mc = (self.p50_us[s] for s in SYSTEMS)
        gplain, gpd, gmc = (self.gbps[s] for s in SYSTEMS)
        return (
            f"side by side at {fmt_size(self.size)} {mode} ({self.iterations} gets each, in "
            f"turn): pdserve/tcp+lookup p50 {pd:.0f} us, tcp-plain {plain:.0f}, "
            f"mooncake-store {mc:.0f}; tcp+lookup / mooncake-store {gpd / gmc:.2f}x GB/s "
            f"({mc / pd:.2f}x p50), ceiling tcp-plain / mooncake-store {gplain / gmc:.2f}x "
            f"({mc / plain:.2f}x p50), tcp+lookup at {gpd / gplain:.0%} of tcp-plain"
        )

    def as_dict(self) -> dict:
        return asdict(self)


def bench_side_by_side(
    sizes: list[int], iterations: int, batch: int, log_dir: Path
) -> list[SideBySide]:
    """Per size, single gets and (``batch`` > 1) batched gets of the three systems in turn."""
    from mooncake.store import MooncakeDistributedStore

    from pdserve.procs import local_store
    from pdserve.store import open_store
    from pdserve.store.mooncake_cluster import MooncakeCluster

    runs = [(s, 1) for s in sizes] + [(s, batch_for(s, batch)) for s in sizes if batch > 1]
    plan = [(size, nb, iterations_for(size * nb, iterations)) for size, nb in runs]
    steps = [size * nb * (n + 1) for size, nb, n in plan]  # stored at once, one step each
    biggest = max(size * nb for size, nb, _n in plan)
    plain_total = max(cold_regions(size * nb, n) * size * nb for size, nb, n in plan)
    # Mooncake frees removed objects lazily: room for every step, as the rounds give it
    cluster = MooncakeCluster.start(log_dir / "mooncake", 2 * sum(steps) + (64 << 20))
    mc = MooncakeDistributedStore()
    try:
        if mc.setup(
            "127.0.0.1", "P2PHANDSHAKE", 0, biggest + (1 << 20), "tcp", "", cluster.address
        ):
            raise RuntimeError("MooncakeDistributedStore.setup failed")
        # pdserve frees a step's objects on removal: room for the largest step, below the
        # master's high watermark
        segment = int(max(steps) / 0.9) + (32 << 20)
        with (
            PlainPeer(plain_total) as plain,
            local_store(log_dir / "pdserve", segment_size=segment, transports="tcp") as (
                master,
                _node,
            ),
        ):
            client = open_store(master.info["grpc"], transport="tcp", timeout_s=30)
            try:
                return [_one(plain, client, mc, size, nb, n) for size, nb, n in plan]
            finally:
                client.close()
    finally:
        mc.close()
        cluster.stop()


def _one(plain: PlainPeer, client, mc, size: int, nb: int, n: int) -> SideBySide:
    from pdserve.store.api import StoreOptions

    progress(f"side by side: {fmt_size(size)} x {nb}, {n} gets of each system")
    total = size * nb
    data = np.random.default_rng(size * 31 + nb).integers(0, 256, (n + 1, nb, size), np.uint8)
    keys = [[f"sbs-{size}-{nb}-{i}-{j}" for j in range(nb)] for i in range(n + 1)]
    # pdserve: objects stored as KV chunks are (no raw-object checksum), read into one buffer
    opts = StoreOptions(checksum=False)
    for i in range(n + 1):
        if not all(
            client.batch_put([(k, memoryview(data[i, j])) for j, k in enumerate(keys[i])], opts)
        ):
            raise RuntimeError(f"side by side: pdserve put of {keys[i][0]} failed")
    out = np.empty((nb, size), np.uint8)
    dsts = [memoryview(row) for row in out]
    # Mooncake: registered source and destination buffers, as its own benchmarks use
    src = np.ascontiguousarray(data.reshape(n + 1, total))
    mdst = np.empty(total, np.uint8)
    for arr in (src, mdst):
        if mc.register_buffer(arr.ctypes.data, arr.nbytes):
            raise RuntimeError("Mooncake register_buffer failed")
    sizes = [size] * nb
    mkeys = [[f"mc-{k}" for k in ks] for ks in keys]
    for i in range(n + 1):
        ptrs = [src.ctypes.data + i * total + j * size for j in range(nb)]
        if any(mc.batch_put_from(mkeys[i], ptrs, sizes)):
            raise RuntimeError("Mooncake batch_put_from failed")
    dptrs = [mdst.ctypes.data + j * size for j in range(nb)]
    regions = plain.total // total
    flat = [k for ks in keys for k in ks]

    def pdserve_get(i: int) -> None:  # as the rows pdserve/tcp+lookup read
        if nb > 1:
            looked_up_batch(client, keys[i], dsts, size)
        else:
            looked_up_get(client, flat, i, dsts[0])

    def mooncake_get(i: int) -> None:
        got = (
            mc.batch_get_into(mkeys[i], dptrs, sizes)
            if nb > 1
            else [mc.get_into(mkeys[i][0], dptrs[0], size)]
        )
        if any(g != size for g in got):
            raise RuntimeError(f"side by side: Mooncake get of {mkeys[i][0]} failed: {got}")

    ops = {
        "tcp-plain": lambda i: plain.get(total, (i + 1) % regions),
        "pdserve/tcp+lookup": pdserve_get,
        "mooncake-store": mooncake_get,
    }
    for op in ops.values():  # connections, mappings, slow start: the spare object n
        op(n)
    lat: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for i in range(n):
        turn = SYSTEMS[i % 3 :] + SYSTEMS[: i % 3]
        for system in turn:
            start = time.perf_counter()
            ops[system](i)
            lat[system].append(time.perf_counter() - start)
    if not np.array_equal(out, data[n - 1]) or not np.array_equal(mdst, src[n - 1]):
        raise RuntimeError("side by side: a store read back different bytes")
    try:
        client.remove(flat)
        time.sleep(0.25)  # Mooncake: let the read leases lapse
        for k in (k for ks in mkeys for k in ks):
            mc.remove(k, True)
    finally:
        for arr in (src, mdst):
            mc.unregister_buffer(arr.ctypes.data)
    return SideBySide(
        size,
        nb,
        n,
        {s: pct(v, 0.5) * 1e6 for s, v in lat.items()},
        {s: total * n / sum(v) / 1e9 for s, v in lat.items()},
    )
