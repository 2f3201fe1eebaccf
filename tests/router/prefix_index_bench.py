"""The router's longest-prefix lookup both ways on one real master and node: the KV-event
index (``prefix_source: events``, in sync) against a LongestPrefix round trip to the master
per lookup (``prefix_source: master``, the router's asyncio gRPC call). Stores ``prompts``
chains of ``chunks`` keys first (half of each prompt stored), then times ``lookups`` lookups
of whole prompts one at a time (latency) and 32 at a time (throughput), and the event lag:
from a put's return to the index holding its key.

    .venv/bin/python tests/router/prefix_index_bench.py [prompts] [chunks] [lookups]
"""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

from pdserve import grpcutil, procs
from pdserve.hashing import ModelFingerprint, chunk_keys
from pdserve.services.router.prefix_index import IndexedLookup
from pdserve.services.router.server import prefix_lookup
from pdserve.store import open_store
from pdserve.v1 import kvstore_pb2_grpc

FP = ModelFingerprint("prefix-index-bench", chunk_size=32)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def measure(name: str, lookup, queries: list[list[str]]) -> None:
    lat = []
    for keys in queries:
        t = time.perf_counter()
        await lookup(keys)
        lat.append(time.perf_counter() - t)
    sem = asyncio.Semaphore(32)

    async def one(keys: list[str]) -> None:
        async with sem:
            await lookup(keys)

    t = time.perf_counter()
    await asyncio.gather(*(one(k) for k in queries))
    rate = len(queries) / (time.perf_counter() - t)
    print(
        f"{name:>7}: p50 {pct(lat, 0.5) * 1e6:8.1f} us  p99 {pct(lat, 0.99) * 1e6:8.1f} us  "
        f"{len(queries) / sum(lat):8.0f} lookups/s sequential  {rate:8.0f} lookups/s at 32"
    )


async def main(n_prompts: int, n_chunks: int, n_lookups: int, client, address: str) -> None:
    rng = random.Random(1)
    chains = [
        chunk_keys(FP, [rng.randrange(50_000) for _ in range(n_chunks * FP.chunk_size)])
        for _ in range(n_prompts)
    ]
    for c in chains:
        client.batch_put([(k, b"v" * 64) for k in c[: n_chunks // 2]])
    master = prefix_lookup(address)
    channel = grpcutil.channel(address)
    indexed = IndexedLookup(master, kvstore_pb2_grpc.KVMasterServiceStub(channel))
    indexed.start()
    while not indexed.index.synced:
        await asyncio.sleep(0.01)
    print(f"{n_prompts} prompts x {n_chunks} chunks, {len(indexed.index.keys)} keys stored")
    queries = [rng.choice(chains) for _ in range(n_lookups)]
    for keys in queries[:200]:  # both answer the same
        assert await indexed(keys) == await master(keys)
    await measure("master", master, queries)
    await measure("index", indexed, queries)
    lags = []
    for i in range(50):
        (key,) = chunk_keys(FP, [i + 10**6] * FP.chunk_size)
        await asyncio.to_thread(client.batch_put, [(key, b"v" * 64)])
        t = time.perf_counter()
        while key not in indexed.index.keys:
            await asyncio.sleep(0)
        lags.append(time.perf_counter() - t)
    print(f"event lag (put returned -> index has it): p50 {pct(lags, 0.5) * 1e3:.2f} ms")
    await indexed.aclose()


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    prompts, chunks, lookups = (args + [1000, 16, 2000][len(args) :])[:3]
    with (
        tempfile.TemporaryDirectory() as tmp,
        procs.local_store(Path(tmp), segment_size="64MiB", master_flags={"state_dir": ""}) as (
            m,
            _node,
        ),
        open_store(m.info["grpc"]) as c,
    ):
        asyncio.run(main(prompts, chunks, lookups, c, m.info["grpc"]))
