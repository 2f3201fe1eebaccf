"""pdserve's disk tier under ``pdserve bench kvstore --disk-dir``: gets of objects whose only
copy is on a storage node's disk segment, the page cache dropped first, read against
:mod:`.disk`'s raw reads of the same sizes from the same file system.

Per size, a store of its own: a master (every object gets a disk copy once it is committed:
``demote_watermark`` 0) and one node with a small memory segment and a disk tier in the
given directory. The bench puts the objects :data:`FILL_GROUP` at a time, waiting after each
group until its disk copies are made (the master's next housekeeping passes), so memory
evicts only copies that disk also holds; the objects memory no longer holds are then
disk-only (the rows' put figures are the puts alone, not the waits). Their disk file is
dropped from the page cache (:func:`.disk.drop_cache`) and each is read once, in the order
written, timed two ways as the store's own rows are: half of them one by one
(``pdserve/tcp-disk`` single rows: ``get_into``, the master lookup then the read the node
serves from its disk file), the other half in batches of 16 as the connector reads a prompt
(batch rows: ``longest_prefix``, then ``batch_get_into``; the cache dropped again before).
Every byte read is checked against what was written, after each read's clock stopped. Stored
as the other pdserve rows store (no raw-object checksum, as KV chunks are stored).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pdserve.bench.kvstore.disk import drop_cache, raw_object
from pdserve.bench.kvstore.measure import (
    Row,
    fmt_size,
    iterations_for,
    measure,
    progress,
    timed_row,
)
from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.v1 import kvstore_pb2 as pb

#: Objects memory holds in these runs (its segment is this many objects, at least 4 MiB).
MEMORY_OBJECTS = 4
#: Objects per batched read (the connector reads a prompt's chunks in one batch).
BATCH = 16
#: Objects put before the bench waits for their disk copies: half of what memory holds, so
#: the group's objects, the most recently used, are never the ones memory evicts to make
#: room (one wait per object made the fill, each wait a housekeeping pass or two, most of
#: the bench's time).
FILL_GROUP = MEMORY_OBJECTS // 2


def bench_disk_tier(
    directory: str | Path, sizes: list[int], iterations: int, log_dir: Path
) -> list[Row]:
    from pdserve.procs import local_store

    rows: list[Row] = []
    for size in sizes:
        n = max(iterations_for(size, iterations), 2 * (MEMORY_OBJECTS + BATCH))
        memory = MEMORY_OBJECTS * size + min(size, 64 << 10)
        # every object below the master's eviction watermark: past it the tier evicts its
        # least recently used copies, the last ones written
        disk = math.ceil((n + 2) * size / MasterConfig.high_watermark) + (16 << 20)
        tier_dir = Path(directory) / f"pdserve-disk-tier-{size}"
        progress(f"pdserve/tcp-disk {fmt_size(size)} x {n}: filling the disk tier")
        with local_store(
            log_dir / f"disk-tier-{size}",
            segment_size=memory,
            transports="tcp",
            master_flags={"demote_watermark": 0.0, "inline_max_bytes": 0},
            node_flags={"disk_path": tier_dir, "disk_size": disk},
        ) as (master, _node):
            rows += _one_size(master.info["grpc"], size, n, tier_dir)
        for f in tier_dir.glob("*"):
            f.unlink(missing_ok=True)
        tier_dir.rmdir()
    return rows


def _one_size(address: str, size: int, n: int, tier_dir: Path) -> list[Row]:
    """Fills the disk tier with ``n`` objects of ``size``; reads half of the disk-only ones
    one by one and the other half in batches, each half from a cold page cache."""
    from pdserve.store import open_store

    client = open_store(address, transport="tcp", timeout_s=30)
    keys = [f"disk-{size}-{i}" for i in range(n)]
    wrong: list[str] = []
    missed: list[str] = []
    try:
        put = _fill(client, keys, size)
        on_disk = _disk_only(client, keys)
        half = len(on_disk) // 2
        if half < BATCH:
            raise RuntimeError(f"only {len(on_disk)} of {n} objects left memory; expected more")
        singles, rest = on_disk[:half], on_disk[half:]
        batches = [rest[i : i + BATCH] for i in range(0, len(rest) - BATCH + 1, BATCH)]
        buf = np.empty(size * BATCH, dtype=np.uint8)
        views = [memoryview(buf[k * size : (k + 1) * size]) for k in range(BATCH)]

        def check(i: int, view: memoryview, got: int | None) -> None:
            if got != size:
                missed.append(f"{keys[i]} ({got})")
            elif bytes(view) != raw_object(size, i):
                wrong.append(keys[i])

        def get(j: int) -> Callable[[], None]:
            got = client.get_into(keys[singles[j]], views[0])

            def verify() -> None:
                check(singles[j], views[0], got)

            return verify

        def batch(j: int) -> Callable[[], None]:
            names = [keys[i] for i in batches[j]]
            client.longest_prefix(names)  # as the connector looks a prompt up, then reads it
            got = client.batch_get_into(names, views[: len(names)])

            def verify() -> None:
                for k, i in enumerate(batches[j]):
                    check(i, views[k], got[k])

            return verify

        drop_cache(tier_dir)
        rows = [timed_row("pdserve/tcp-disk", size, half, put, _timed_then_checked(half, get))]
        drop_cache(tier_dir)
        got = _timed_then_checked(len(batches), batch)
        rows.append(timed_row("pdserve/tcp-disk", size, len(batches), put, got, BATCH))
        if wrong:
            raise RuntimeError(f"pdserve/tcp-disk read back different bytes: {wrong[:3]}")
        if missed:
            raise RuntimeError(
                f"pdserve/tcp-disk: {len(missed)} disk-only objects not served (bytes read): "
                f"{missed[:3]}"
            )
        return rows
    finally:
        client.remove(keys)
        client.close()


def _timed_then_checked(
    n: int, op: Callable[[int], Callable[[], None]]
) -> tuple[list[float], float]:
    """As :func:`measure`, but ``op`` returns its check, run after the clock stopped: the
    bytes are compared out of the timing (a reference object costs more to make than the
    read). The total is the reads' own time."""
    lat = []
    for i in range(n):
        start = time.perf_counter()
        verify = op(i)
        lat.append(time.perf_counter() - start)
        verify()
    return lat, sum(lat)


def _fill(client, keys: list[str], size: int) -> tuple[list[float], float]:
    """Puts ``keys`` (``raw_object(size, i)`` each; as the other pdserve rows store: no
    raw-object checksum, as KV chunks are stored), :data:`FILL_GROUP` at a time, and waits
    after each group until the master made a disk copy of every object put so far. Returns
    the puts' own seconds and their total, as :func:`measure` does (the objects are made, and
    the copies waited for, outside the clock)."""
    from pdserve.store.api import StoreOptions

    lat: list[float] = []
    for lo in range(0, len(keys), FILL_GROUP):
        hi = min(len(keys), lo + FILL_GROUP)
        data = [raw_object(size, i) for i in range(lo, hi)]  # made before the clock starts

        def put(i: int, lo: int = lo, data: list[bytes] = data) -> None:
            if not client.put(keys[lo + i], data[i], StoreOptions(checksum=False)):
                raise RuntimeError(f"put of {keys[lo + i]} failed")

        lat += measure(hi - lo, put)[0]
        _wait_for_demotions(client, hi, keys[hi - 1])
    return lat, sum(lat)


def _wait_for_demotions(client, count: int, last: str, timeout_s: float = 30.0) -> None:
    """Waits until the master made ``count`` disk copies in all (``last``: the newest key,
    named in the error)."""
    end = time.monotonic() + timeout_s
    while client.stats().demotions < count:
        if time.monotonic() > end:
            raise RuntimeError(f"{last}: no disk copy after {timeout_s:.0f} s (is the tier full?)")
        time.sleep(0.01)


def _disk_only(client, keys: list[str]) -> list[int]:
    """Indexes of ``keys`` whose every copy is on a disk segment."""
    results = client.reads.replica_lists(keys)
    client.leases.release([r.key for r in results if r.code == pb.KV_OK])
    return [
        i
        for i, r in enumerate(results)
        if r.code == pb.KV_OK
        and r.replicas
        and all(x.tier == pb.STORAGE_TIER_DISK for x in r.replicas)
    ]
