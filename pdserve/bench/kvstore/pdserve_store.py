"""pdserve's own store client under ``pdserve bench kvstore``: put and get per transport, one
object and a batch per call, one master round trip and ``longest_prefix``.

Two kinds of get rows per transport (the main run's; not the +sum, -notok and -tls
variants):

* ``pdserve/<t>``: gets of keys the client never looked up: each get pays its own master
  lookup (``BatchGetReplicaList``), then its bytes.
* ``pdserve/<t>+lookup``: what a KV connector pays, its ``longest_prefix`` inside the timed
  operation. Single: one ``longest_prefix`` of the next 16 keys before every 16th get (the
  gets read the locations it answered, no master call of their own). Batch: the batch's
  ``longest_prefix``, then ``batch_get_into`` of the same keys, as one operation. Its put
  figures are the plain row's (the same puts).
"""

from __future__ import annotations

import os

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

#: Keys per ``longest_prefix`` in the single-get +lookup rows (a prompt's worth of chunks).
LOOKUP_KEYS = 16


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
    stores everything. ``suffix`` ends the rows' system name (e.g. "-notok"). The main run
    (no suffix, no checksums) adds the ``+lookup`` rows (see the module's doc)."""
    from pdserve.store import open_store
    from pdserve.store.api import StoreOptions

    client = open_store(address, transport=transport, timeout_s=30)
    opts = StoreOptions(checksum=checksums)
    name = f"pdserve/{transport}" + ("+sum" if checksums else "") + suffix
    lookups = not checksums and not suffix
    rows = []
    tag = f"{transport}-{int(checksums)}-{os.getpid()}"
    try:
        for size in sizes:
            n = iterations_for(size, iterations)
            progress(f"{name} {fmt_size(size)} x {n}")
            data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            view = memoryview(data)
            buf = np.empty(size, dtype=np.uint8)
            keys = [f"bench-{tag}-{size}-{i}" for i in range(n)]
            client.put(f"warm-{tag}-{size}", view, opts)  # connections, mappings
            client.get_into(f"warm-{tag}-{size}", memoryview(buf))
            put = measure(n, lambda i, k=keys, v=view: client.put(k[i], v, opts))
            bview = memoryview(buf)
            # Keys this client never looked up: each get asks the master where its object is.
            got: list[int | None] = []
            get = measure(n, lambda i, k=keys, b=bview, g=got: g.append(client.get_into(k[i], b)))
            if not np.array_equal(buf, data) or got.count(size) != n:
                raise RuntimeError(f"{name}: read back different bytes, or missed")
            rows.append(timed_row(name, size, n, put, get))
            if lookups:
                buf[:] = 0
                get = measure(n, lambda i, k=keys, b=bview: looked_up_get(client, k, i, b))
                if not np.array_equal(buf, data):
                    raise RuntimeError(f"{name}+lookup: read back different bytes")
                rows.append(timed_row(f"{name}+lookup", size, n, put, get))
            client.remove([*keys, f"warm-{tag}-{size}"])
            if batch > 1:
                rows += _bench_pdserve_batch(
                    client, name, opts, tag, size, iterations, batch, lookups
                )
    finally:
        client.close()
    return rows


def looked_up_get(client, keys: list[str], i: int, buf: memoryview) -> None:
    """The ``i``-th get of the single +lookup row: every :data:`LOOKUP_KEYS`-th one first
    looks up the next :data:`LOOKUP_KEYS` keys (as a connector looks up a prompt's chunks)."""
    if i % LOOKUP_KEYS == 0:
        ahead = keys[i : i + LOOKUP_KEYS]
        if client.longest_prefix(ahead) != len(ahead):
            raise RuntimeError("+lookup: longest_prefix missed keys")
    if client.get_into(keys[i], buf) is None:
        raise RuntimeError(f"+lookup: {keys[i]} missed")


def looked_up_batch(client, keys: list[str], bufs: list[memoryview], size: int) -> None:
    """A batch of the batch +lookup rows, as a connector reads a prompt's chunks:
    ``longest_prefix`` of ``keys``, then ``batch_get_into`` of them (each ``size`` bytes)."""
    if client.longest_prefix(keys) != len(keys):
        raise RuntimeError("+lookup batch: longest_prefix missed keys")
    if client.batch_get_into(keys, bufs).count(size) != len(keys):
        raise RuntimeError(f"+lookup batch: {keys[0]}.. missed")


def _bench_pdserve_batch(
    client,
    name: str,
    opts,
    tag: str,
    size: int,
    iterations: int,
    batch: int,
    lookups: bool = False,
) -> list[Row]:
    """The batch row (and with ``lookups`` the batch +lookup row: ``longest_prefix`` of the
    batch's keys, then their ``batch_get_into``, timed as one operation)."""
    nb = batch_for(size, batch)
    n = iterations_for(size * nb, iterations)
    progress(f"{name} batches of {nb} x {fmt_size(size)}, {n} batches")
    data = np.random.default_rng(size + 1).integers(0, 256, (nb, size), dtype=np.uint8)
    srcs = [memoryview(row) for row in data]
    out = np.empty_like(data)
    dsts = [memoryview(row) for row in out]
    keys = [[f"batch-{tag}-{size}-{i}-{j}" for j in range(nb)] for i in range(n + 1)]
    client.batch_put(list(zip(keys[n], srcs, strict=True)), opts)  # warm-up batch
    client.batch_get_into(keys[n], dsts)
    put = measure(n, lambda i: client.batch_put(list(zip(keys[i], srcs, strict=True)), opts))
    got: list[list[int | None]] = []
    get = measure(n, lambda i: got.append(client.batch_get_into(keys[i], dsts)))
    if not np.array_equal(out, data) or any(g.count(size) != nb for g in got):
        raise RuntimeError(f"{name} batch: read back different bytes, or missed")
    rows = [timed_row(name, size, n, put, get, nb)]
    if lookups:
        out[:] = 0

        get = measure(n, lambda i: looked_up_batch(client, keys[i], dsts, size))
        if not np.array_equal(out, data):
            raise RuntimeError(f"{name}+lookup batch: read back different bytes")
        rows.append(timed_row(f"{name}+lookup", size, n, put, get, nb))
    client.remove([k for ks in keys for k in ks])
    return rows


def bench_control(address: str, rounds: int = 500) -> dict[str, dict[str, float]]:
    """One master round trip, over gRPC and over the control wire: BatchGetReplicaList of
    one key (what a get waits for before its data moves) and LongestPrefix of 64 keys."""
    from pdserve.store import open_store

    out: dict[str, dict[str, float]] = {}
    keys = [f"control-{os.getpid()}-{i}" for i in range(64)]
    for control in ("grpc", "auto"):
        client = open_store(address, control=control)
        try:
            if control == "auto" and client.control_path != "wire":
                progress("the master's control wire is off: skipping it")
                continue
            client.batch_put([(k, b"c" * 256) for k in keys[:48]])
            # NOTE: the lookup alone is the client's read part (no public call stops there).
            reads = client.reads
            for _ in range(50):
                reads.replica_lists(keys[:1])
                client.longest_prefix(keys)
            lookup, _ = measure(rounds, lambda _i, r=reads: r.replica_lists(keys[:1]))
            prefix, _ = measure(rounds, lambda _i, c=client: c.longest_prefix(keys))
            reads.leases.release(keys[:1])  # the lookups' lease (remove flushes it first)
            client.remove(keys)
        finally:
            client.close()
        out["grpc" if control == "grpc" else "wire"] = {
            "lookup_p50_us": pct(lookup, 0.5) * 1e6,
            "lookup_p99_us": pct(lookup, 0.99) * 1e6,
            "prefix64_p50_us": pct(prefix, 0.5) * 1e6,
            "prefix64_p99_us": pct(prefix, 0.99) * 1e6,
        }
    return out


def bench_longest_prefix(
    address: str, rounds: int = 300, locations: bool = True
) -> dict[str, float]:
    """``longest_prefix`` over 64 keys, 48 of them stored. ``locations``: as a KV connector
    calls it (the found keys' replicas come back, read-leased and granted, and the client
    keeps them for the gets that follow); without, the length alone (what Mooncake Store's
    ``batch_is_exist`` answers)."""
    from pdserve.store import open_store

    client = open_store(address)
    client.prefix_replicas = locations
    keys = [f"prefix-{os.getpid()}-{i}" for i in range(64)]
    client.batch_put([(k, b"p" * 256) for k in keys[:48]])
    for _ in range(20):
        client.longest_prefix(keys)
    lat, _ = measure(rounds, lambda _i: client.longest_prefix(keys))
    if client.longest_prefix(keys) != 48:
        raise RuntimeError("longest_prefix answered wrong")
    client.remove(keys)
    client.close()
    return {"keys": 64, "p50_us": pct(lat, 0.5) * 1e6, "p99_us": pct(lat, 0.99) * 1e6}
