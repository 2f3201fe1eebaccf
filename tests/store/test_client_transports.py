"""pdserve's StoreClient on real processes: a round trip over each transport (node in
another process), chunk verification with per-replica fallback and the corruption counter,
and errors for an unreachable master."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from pdserve import errors, grpcutil
from pdserve.store import open_store
from pdserve.store.api import CORRUPT_CHUNKS, StoreOptions
from pdserve.store.transports.mooncake import available as mooncake_available
from pdserve.store.transports.shm import ShmTransport
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc

FP = bytes(range(32))


def _blob(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.slow
@pytest.mark.parametrize(
    "transport",
    ["shm", "tcp", pytest.param("mooncake", marks=pytest.mark.mooncake), "auto"],
)
def test_client_roundtrip_over_each_transport(cluster, transport: str) -> None:
    if transport == "mooncake" and not mooncake_available():
        pytest.skip("mooncake-transfer-engine is not installed")
    client = open_store(cluster.address, transport=transport)
    key = f"{transport}-{uuid.uuid4().hex}"
    data = _blob(2 * 1024 * 1024 + 1, 4)
    assert client.put(key, data, StoreOptions(replicas=2))
    assert client.get(key) == data
    items = [(f"{key}-{i}", _blob(1000 + i, i)) for i in range(8)]
    assert client.batch_put(items) == [True] * 8
    assert client.batch_get([k for k, _ in items]) == [d for _, d in items]
    client.close()


@pytest.mark.slow
def test_client_corrupt_replica_falls_over_then_misses(cluster) -> None:
    client = open_store(cluster.address, transport="shm")
    kv = torch.randn(2, 2, 2, 64, 16)  # 32 KiB: above inline_max_bytes, read from replicas
    key = f"chunk-{uuid.uuid4().hex}"
    assert client.put_chunk(key, kv, FP, StoreOptions(replicas=2))
    stub = kvstore_pb2_grpc.KVMasterServiceStub(grpcutil.sync_channel(cluster.address))
    (res,) = stub.BatchGetReplicaList(
        kvstore_pb2.BatchGetReplicaListRequest(client_id="t", keys=[key]), timeout=5
    ).results
    assert len(res.replicas) == 2
    shm = ShmTransport(client.host_id)
    before = CORRUPT_CHUNKS.metric._value.get()
    # Flip one payload byte in the first replica: the read verifies and takes the second.
    first = res.replicas[0]
    raw = bytearray(first.size)
    shm.read_into(first, memoryview(raw))
    raw[-1] ^= 0xFF
    shm.write(first, memoryview(bytes(raw)))
    back = client.get_chunk(key, FP)
    assert back is not None and torch.equal(back, kv)
    assert CORRUPT_CHUNKS.metric._value.get() == before
    # Corrupt the second as well: now a miss, counted once.
    second = res.replicas[1]
    shm.write(second, memoryview(bytes(raw)))
    assert client.get_chunk(key, FP) is None
    assert CORRUPT_CHUNKS.metric._value.get() == before + 1
    assert client.get(key) == bytes(raw)  # raw gets do not verify
    client.close()


def test_client_unreachable_master_is_unavailable() -> None:
    client = open_store("127.0.0.1:1", timeout_s=0.5)
    with pytest.raises(errors.Unavailable):
        client.put("k", b"v")
    with pytest.raises(errors.Unavailable):
        client.get("k")
    client.close()
    with pytest.raises(errors.InvalidArgument):
        open_store("127.0.0.1:1", transport="carrier-pigeon")


@pytest.mark.slow
def test_client_no_space_is_resource_exhausted(cluster) -> None:
    client = open_store(cluster.address)
    with pytest.raises(errors.ResourceExhausted):
        client.put(f"huge-{uuid.uuid4().hex}", bytes(200 * 1024 * 1024))
    client.close()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_client_is_thread_safe(cluster, transport: str) -> None:
    """One client shared by several threads (as in the engines): every thread reads back
    exactly its own bytes."""
    from concurrent.futures import ThreadPoolExecutor

    client = open_store(cluster.address, transport=transport)
    tag = uuid.uuid4().hex

    def work(t: int) -> bool:
        ok = True
        for i in range(15):
            key, data = f"{tag}-{t}-{i}", _blob(20_000 + 997 * t + i, t * 100 + i)
            client.put(key, data, StoreOptions(replicas=2))
            buf = bytearray(len(data))
            ok &= client.get_into(key, memoryview(buf)) == len(data) and buf == data
            ok &= client.batch_get([key, f"{tag}-missing"]) == [data, None]
        return ok

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(4)))
    assert client.remove([f"{tag}-{t}-{i}" for t in range(4) for i in range(15)]) == 60
    client.close()


@pytest.mark.slow
def test_client_reports_a_failed_put_end_as_a_failure(cluster) -> None:
    """A put whose commit fails (every replica's node died meanwhile) raises; it is not the
    "already existed" False of an idempotent put."""
    from pdserve import errors

    client = open_store(cluster.address)
    real = client.master.call

    def call(method, request):
        if method == "BatchPutEnd":
            return kvstore_pb2.BatchKeysResponse(
                results=[
                    kvstore_pb2.KeyResult(
                        key=k, code=kvstore_pb2.KV_NOT_ENOUGH_NODES, message="nodes died"
                    )
                    for k in request.keys
                ]
            )
        return real(method, request)

    client.master.call = call
    with pytest.raises(errors.PdserveError, match="KV_NOT_ENOUGH_NODES: nodes died"):
        client.put(f"end-fails-{uuid.uuid4().hex}", b"x" * 100)
    client.close()
