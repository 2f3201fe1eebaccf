"""A read never hands out wrong bytes: the cases where the master hands the same region to
two owners, or a write is torn, end as misses (real master and node processes; the faulty
writer writes through the node's real tcp data port)."""

from __future__ import annotations

import os
import time

import torch

from pdserve import kvformat
from pdserve.store.api import StoreOptions
from pdserve.store.client import READ_FAILOVERS, StoreClient
from pdserve.v1 import kvstore_pb2 as pb

FP = bytes(range(32))
SIZE = 256 * 1024


def _failovers() -> float:
    return READ_FAILOVERS.labels("tcp")._value.get()


def _replica(client: StoreClient, key: str) -> pb.Replica:
    (res,) = client._replica_lists([key])
    client._finish([res])
    return res.replicas[0]


def _late_writer(client: StoreClient, key: str, size: int) -> pb.Replica:
    """Starts a put of ``key`` and stalls before writing: the region it was given."""
    resp = client._call(
        "BatchPutStart",
        pb.BatchPutStartRequest(client_id="late", items=[pb.PutStartItem(key=key, size=size)]),
    )
    assert resp.results[0].code == pb.KV_OK
    return resp.results[0].replicas[0]


def _write(client: StoreClient, rep: pb.Replica, data: bytes) -> None:
    (err,) = client._get_transport("tcp").write_many([(rep, memoryview(data))])
    assert err is None


def test_a_late_writer_cannot_corrupt_the_object_that_reused_its_region(cluster_factory):
    """Put timeout: the master reclaims a stalled put's region and gives it to the next put.
    When the late writer's bytes land there, a reader of the new object gets a miss (raw
    objects: their checksum; KV chunks: their header binds the key), never those bytes."""
    c = cluster_factory(put_timeout_s=0.5)
    c.add_node(transports="tcp", segment_sizes="8MiB")
    with StoreClient(c.address, transport="tcp") as client:
        late = _late_writer(client, "late-raw", SIZE)
        time.sleep(1.0)  # the put times out; its region is free again
        mine = os.urandom(SIZE)
        assert client.put("mine", mine)
        assert _replica(client, "mine").offset == late.offset  # first fit: the same region
        assert client.get("mine") == mine
        before = _failovers()
        _write(client, late, os.urandom(SIZE))  # the late writer wakes up
        assert client.get("mine") is None
        assert _failovers() > before

        client._flush_releases()
        assert client.exists(["mine"]) == [False]  # removed: its next writer stores it again

        # The same with KV chunks: a whole, valid chunk of another key is refused.
        kv = torch.randn(2, 2, 2, 16, 32)
        size = len(kvformat.encode(kv, FP, "x"))
        late = _late_writer(client, "late-chunk", size)
        time.sleep(1.0)
        assert client.put_chunk("chunk", kv * 2, FP)
        assert _replica(client, "chunk").offset == late.offset
        assert torch.equal(client.get_chunk("chunk", FP), kv * 2)
        _write(client, late, kvformat.encode(kv, FP, "late-chunk"))
        assert client.get_chunk("chunk", FP) is None


def test_a_torn_write_is_a_miss(cluster_factory):
    """A write that stopped half way (the writer died, the connection broke) leaves bytes
    that match no checksum: readers miss, before and after the object is committed."""
    c = cluster_factory()
    c.add_node(transports="tcp", segment_sizes="8MiB")
    with StoreClient(c.address, transport="tcp") as client:
        data = os.urandom(SIZE)
        assert client.put("torn", data)
        rep = _replica(client, "torn")
        half = pb.Replica()
        half.CopyFrom(rep)
        half.size = SIZE // 2
        _write(client, half, bytes(SIZE // 2))
        buf = bytearray(SIZE)
        assert client.get_into("torn", memoryview(buf)) is None
        assert client.get("torn") is None
        # The reader removes what no replica holds right, so the next writer stores it again
        # instead of skipping it as already there.
        client._flush_releases()
        assert client.exists(["torn"]) == [False]
        assert client.put("torn", data) and client.get("torn") == data
        # Without a checksum (the writer turned it off) nothing can tell: that is what the
        # default prevents.
        assert client.put("unchecked", data, StoreOptions(checksum=False))
        rep = _replica(client, "unchecked")
        rep.size = SIZE // 2
        _write(client, rep, bytes(SIZE // 2))
        assert client.get("unchecked") == bytes(SIZE // 2) + data[SIZE // 2 :]


def test_a_read_that_outlives_its_lease_is_discarded(cluster_factory):
    """Past its read lease the region may already hold another object: a read that ends
    later is a miss, though every byte arrived."""
    big = 16 << 20
    short = cluster_factory(default_lease_ms=1)  # shorter than moving 16 MiB
    short.add_node(transports="tcp", segment_sizes="64MiB")
    data = os.urandom(big)
    with StoreClient(short.address, transport="tcp") as client:
        assert client.put("big", data)
        assert client.get("big") is None
        assert client.batch_get(["big"]) == [None]
    normal = cluster_factory()
    normal.add_node(transports="tcp", segment_sizes="64MiB")
    with StoreClient(normal.address, transport="tcp") as client:
        assert client.put("big", data)
        assert client.get("big") == data
