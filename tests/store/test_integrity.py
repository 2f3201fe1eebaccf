"""A read never hands out wrong bytes: the cases where the master hands the same region to
two owners, or a write is torn, end as misses (real master and node processes; the faulty
writer writes through the node's real tcp data port)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from pdserve import errors, kvformat, procs
from pdserve.store import open_store
from pdserve.store.api import StoreOptions
from pdserve.store.client import StoreClient
from pdserve.store.client.reads import READ_FAILOVERS
from pdserve.v1 import kvstore_pb2 as pb

FP = bytes(range(32))
SIZE = 256 * 1024


def _failovers() -> float:
    return READ_FAILOVERS.metric.labels("tcp")._value.get()


def _replica(client: StoreClient, key: str) -> pb.Replica:
    (res,) = client.reads.replica_lists([key])
    client.leases.release([key])
    return res.replicas[0]


def _late_writer(client: StoreClient, key: str, size: int) -> pb.Replica:
    """Starts a put of ``key`` and stalls before writing: the region it was given."""
    resp = client.master.call(
        "BatchPutStart",
        pb.BatchPutStartRequest(client_id="late", items=[pb.PutStartItem(key=key, size=size)]),
    )
    assert resp.results[0].code == pb.KV_OK
    return resp.results[0].replicas[0]


def _write(client: StoreClient, rep: pb.Replica, data: bytes) -> None:
    (err,) = client.routes.get("tcp").write_many([(rep, memoryview(data))])
    assert err is None


@pytest.mark.slow
def test_a_late_writer_cannot_corrupt_the_object_that_reused_its_region(cluster_factory):
    """Put timeout: the master reclaims a stalled put's region and gives it to the next put.
    When the late writer's bytes land there, a reader of the new object gets a miss (raw
    objects: their checksum; KV chunks: their header binds the key), never those bytes."""
    c = cluster_factory(put_timeout_s=0.5)
    c.add_node(transports="tcp", segment_sizes="8MiB")
    with open_store(c.address, transport="tcp") as client:
        late = _late_writer(client, "late-raw", SIZE)
        time.sleep(1.0)  # the put times out; its region is free again
        mine = os.urandom(SIZE)
        assert client.put("mine", mine)
        assert _replica(client, "mine").offset == late.offset  # first fit: the same region
        assert client.get("mine") == mine
        before = _failovers()
        # The late writer wakes up, its write grant still good within the node's clock skew
        # allowance (2 s): the checksum is what catches its bytes.
        _write(client, late, os.urandom(SIZE))
        assert client.get("mine") is None
        assert _failovers() > before

        client.release_leases()
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


@pytest.mark.slow
def test_a_torn_write_is_a_miss(cluster_factory):
    """A write that stopped half way (the writer died, the connection broke) leaves bytes
    that match no checksum: readers miss, before and after the object is committed. (Data
    tokens off, so the test can tear a committed object's bytes with its read replica; with
    them on only a writer holding the object's write grant could.)"""
    c = cluster_factory(data_tokens=False)
    c.add_node(transports="tcp", segment_sizes="8MiB")
    with open_store(c.address, transport="tcp") as client:
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
        client.release_leases()
        assert client.exists(["torn"]) == [False]
        assert client.put("torn", data) and client.get("torn") == data
        # Without a checksum (the writer turned it off) nothing can tell: that is what the
        # default prevents.
        assert client.put("unchecked", data, StoreOptions(checksum=False))
        rep = _replica(client, "unchecked")
        rep.size = SIZE // 2
        _write(client, rep, bytes(SIZE // 2))
        assert client.get("unchecked") == bytes(SIZE // 2) + data[SIZE // 2 :]


@pytest.mark.slow
def test_a_read_that_outlives_its_lease_is_discarded(cluster_factory):
    """Past its read lease the region may already hold another object: a read that ends
    later is a miss, though every byte arrived."""
    big = 16 << 20
    short = cluster_factory(default_lease_ms=1)  # shorter than moving 16 MiB
    short.add_node(transports="tcp", segment_sizes="64MiB")
    data = os.urandom(big)
    with open_store(short.address, transport="tcp") as client:
        assert client.put("big", data)
        assert client.get("big") is None
        assert client.batch_get(["big"]) == [None]
    normal = cluster_factory()
    normal.add_node(transports="tcp", segment_sizes="64MiB")
    with open_store(normal.address, transport="tcp") as client:
        assert client.put("big", data)
        assert client.get("big") == data


def _end(client: StoreClient, key: str) -> pb.KeyResult:
    resp = client.master.call("BatchPutEnd", pb.BatchKeysRequest(client_id="late", keys=[key]))
    return resp.results[0]


@pytest.mark.slow
def test_a_master_restart_with_a_put_in_flight(tmp_path):
    """SIGKILL of the master while a put is in flight: the restarted master does not know the
    put's region and hands it out again. The first writer's late bytes are refused by the
    node (their grant is the old master's: the node's remount brought the new master's key)
    and so is its put end; nobody reads them as the other object."""
    state = tmp_path / "state"
    master = procs.start_master(tmp_path / "logs", state_dir=state)
    address = master.info["grpc"]
    node = procs.start_node(address, tmp_path / "logs", segment_sizes="8MiB", transports="tcp")
    try:
        with open_store(address, transport="tcp") as client:
            late = _late_writer(client, "in-flight", SIZE)
            master.kill()
            master = procs.start_master(
                tmp_path / "logs2", state_dir=state, port=address.rsplit(":", 1)[1]
            )
            mine = os.urandom(SIZE)
            deadline = time.monotonic() + 10
            while True:  # the node remounts on its next heartbeat
                try:
                    if client.put("mine", mine):
                        break
                except errors.PdserveError:
                    assert time.monotonic() < deadline, "the node did not remount"
                    time.sleep(0.2)
            assert _replica(client, "mine").offset == late.offset
            (err,) = client.routes.get("tcp").write_many([(late, memoryview(mine[::-1]))])
            assert err is not None and "no valid grant" in str(err)
            assert _end(client, "in-flight").code == pb.KV_NO_PENDING_PUT
            assert client.get("mine") == mine
            assert client.exists(["in-flight"]) == [False]
    finally:
        node.stop()
        procs.remove_shm(node)
        master.stop()


@pytest.mark.slow
def test_a_node_blip_during_a_put(cluster_factory):
    """The node pauses long enough to be declared dead while a put to it is in flight: its
    committed objects come back when it remounts with its bytes; the put in flight fails at
    its end, and its late bytes in the region the master has since reused read as a miss."""
    c = cluster_factory(heartbeat_interval_ms=200, heartbeat_miss_limit=3)
    node = c.add_node(transports="tcp", segment_sizes="8MiB")
    with open_store(c.address, transport="tcp") as client:
        kept = os.urandom(SIZE)
        assert client.put("kept", kept)
        late = _late_writer(client, "blip", SIZE)
        os.kill(node.pid, signal.SIGSTOP)
        try:
            time.sleep(1.5)  # 3 missed 200 ms heartbeats: declared dead
            assert client.exists(["kept"]) == [False]
        finally:
            os.kill(node.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while client.exists(["kept"]) != [True]:  # remounted with its bytes: revived
            assert time.monotonic() < deadline, "the node's objects did not come back"
            time.sleep(0.1)
        assert client.get("kept") == kept
        assert _end(client, "blip").code == pb.KV_NOT_ENOUGH_NODES
        mine = os.urandom(SIZE)
        assert client.put("mine", mine)
        assert _replica(client, "mine").offset == late.offset
        _write(client, late, os.urandom(SIZE))
        assert client.get("mine") is None


@pytest.mark.slow
def test_a_lost_replica_is_made_again_on_another_node(cluster_factory):
    """Two copies on three nodes; the node of one copy is SIGKILLed: the master copies the
    object to the third node, so losing the node of the other copy next loses nothing."""
    c = cluster_factory(heartbeat_interval_ms=200, heartbeat_miss_limit=3)
    nodes = {}
    for _ in range(3):
        n = c.add_node(transports="tcp", segment_sizes="8MiB")
        nodes[n.info["node_id"]] = n
    with open_store(c.address, transport="tcp") as client:
        data = {f"r{i}": os.urandom(SIZE) for i in range(4)}
        client.batch_put(list(data.items()), StoreOptions(replicas=2))
        first = _replica(client, "r0").node_id
        nodes[first].kill()
        deadline = time.monotonic() + 15
        while True:
            results = client.reads.replica_lists(list(data))
            client.leases.release(list(data))
            held = [{r.node_id for r in res.replicas} for res in results]
            if all(len(h) == 2 and first not in h for h in held):
                break
            assert time.monotonic() < deadline, f"not re-replicated: {held}"
            time.sleep(0.2)
        nodes[next(n for n in nodes if n != first)].kill()
        time.sleep(1.0)  # declared dead
        assert client.batch_get(list(data)) == list(data.values())
