"""Reads from the locations a client kept from its ``longest_prefix`` (real master and node
processes): no master call of their own, exact bytes, and never another object's bytes from
a location that went stale: a right object or a miss."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from pdserve.store import open_store
from pdserve.store.client import StoreClient
from pdserve.store.client.reads import READ_LOCATIONS
from pdserve.v1 import kvstore_pb2 as pb

SIZE = 64 * 1024
FP = bytes(range(32))


def _counting(client: StoreClient) -> Counter:
    """Counts the client's master calls by method name from now on."""
    calls: Counter = Counter()
    call = client.master.call

    def counted(method, request):
        calls[method] += 1
        return call(method, request)

    client.master.call = counted  # type: ignore[method-assign]
    return calls


def _sources() -> dict[str, float]:
    return {s: READ_LOCATIONS.metric.labels(s)._value.get() for s in ("cache", "master", "retry")}


def _delta(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in _sources().items()}


@pytest.fixture
def short_lease(cluster_factory) -> Iterator[str]:
    """A master whose read leases last 600 ms (kept entries: 350 ms), objects never inline,
    and one tcp node of 8 MiB (first fit: a freed region goes to the next put)."""
    c = cluster_factory(default_lease_ms=600, inline_max_bytes=0)
    c.add_node(transports="tcp", segment_sizes="8MiB")
    yield c.address


@pytest.mark.slow
def test_a_batch_get_after_longest_prefix_asks_the_master_nothing(cluster) -> None:
    keys = [f"loc-{os.getpid()}-{i}" for i in range(16)]
    data = [os.urandom(SIZE) for _ in keys]
    with open_store(cluster.address) as client, open_store(cluster.address) as worker:
        assert all(client.batch_put(list(zip(keys, data, strict=True))))
        stats = client.stats()
        calls, worker_calls = _counting(client), _counting(worker)
        before = _sources()
        assert client.longest_prefix([*keys, f"missing-{os.getpid()}"]) == 16
        assert client.batch_get(keys) == data
        assert calls == Counter({"LongestPrefix": 1})
        # Another client of the same master in this process (a connector's worker side)
        # reads what the scheduler side looked up, the same way.
        bufs = [bytearray(SIZE) for _ in keys]
        assert worker.batch_get_into(keys, [memoryview(b) for b in bufs]) == [SIZE] * 16
        assert [bytes(b) for b in bufs] == data
        assert not worker_calls
        assert _delta(before) == {"cache": 32, "master": 0, "retry": 0}
        after = client.stats()
        assert after.prefix_queries == stats.prefix_queries + 1
        assert after.gets == stats.gets + 16 and after.get_hits == stats.get_hits + 16
        # Keys not looked up: one lookup for them alone, read in the same batch.
        extra = f"loc-extra-{os.getpid()}"
        assert client.put(extra, b"x" * SIZE)
        calls.clear()
        looked_up: list[list[str]] = []
        lists = client.reads.replica_lists
        client.reads.replica_lists = lambda ks: looked_up.append(ks) or lists(ks)  # type: ignore[method-assign]
        assert client.batch_get([keys[0], extra, keys[1]]) == [data[0], b"x" * SIZE, data[1]]
        assert looked_up == [[extra]]
        # Our own kept leases do not block our removal.
        assert client.remove([*keys, extra]) == 17
        assert client.batch_get(keys[:2]) == [None, None]


@pytest.mark.slow
def test_an_expired_entry_is_not_used(cluster_factory) -> None:
    c = cluster_factory(default_lease_ms=2000)
    c.add_node(transports="tcp", segment_sizes="8MiB")
    with open_store(c.address) as client:
        data = os.urandom(SIZE)
        assert client.put("e", data)
        calls = _counting(client)
        assert client.longest_prefix(["e"]) == 1
        assert client.get("e") == data
        assert calls["BatchGetReplicaList"] == 0
        time.sleep(1.6)  # past the lease less its 500 ms margin, within the lease
        assert client.get("e") == data
        assert calls["BatchGetReplicaList"] == 1
        assert "e" not in client.locations
        # Its lease, still running, went back with the entry: our removal is not refused.
        assert client.remove(["e"]) == 1


@pytest.mark.slow
def test_a_stale_location_never_reads_the_object_that_reused_its_space(short_lease) -> None:
    """The object a kept location named is removed after its lease ended and another object
    takes its space: a get of its key reads the key's current object or misses, never the
    other object's bytes. First as the cache runs (the entry ended with the lease), then with
    the stale entry forced back in (as after a master restart, which loses leases): the
    node still honours the old grant within its clock skew allowance, so the checksum (raw
    objects) or the chunk header (KV chunks) catches the bytes, and the key is looked up
    again."""
    with open_store(short_lease, transport="tcp") as client:
        old, other, new = os.urandom(SIZE), os.urandom(SIZE), os.urandom(SIZE)
        assert client.put("k", old)
        assert client.longest_prefix(["k"]) == 1
        (stale,) = client.locations.take(["k"])
        assert stale is not None
        client.locations.done(["k"])
        time.sleep(0.7)  # the lease ended on the master
        # Another client (another process: no kept location to drop) removes the object.
        (res,) = client.master.call("BatchRemove", pb.BatchKeysRequest(keys=["k"])).results
        assert res.code == pb.KV_OK
        assert client.put("other", other)
        (now,) = client.reads.replica_lists(["other"])
        client.leases.release(["other"])
        assert now.replicas[0].offset == stale.result.replicas[0].offset  # the same space
        assert client.get("k") is None  # the entry ended with its lease: the master says so
        assert client.put("k", new)
        assert client.get("k") == new

        # The stale entry forced back in: over tcp its old grant is still honoured (clock skew
        # allowance), so the bytes come back and fail the checksum; the retry reads the key's
        # current object.
        before = _sources()
        _force(client, stale.result)
        assert client.batch_get(["k"]) == [new]
        assert _delta(before) == {"cache": 1, "master": 0, "retry": 1}
        assert "k" not in client.locations
        assert client.exists(["k"]) == [True]  # a stale location is no corrupt object
        # ... and a miss when the key is gone.
        client.release_leases()
        assert client.remove(["k"]) == 1
        _force(client, stale.result)
        assert client.batch_get(["k"]) == [None]

        # KV chunks (no raw checksum: their header binds the key): the same.
        kv = torch.randn(2, 2, 2, 16, 32)
        assert client.put_chunk("c", kv, FP)
        assert client.longest_prefix(["c"]) == 1
        (chunk_loc,) = client.locations.take(["c"])
        client.locations.done(["c"])
        assert chunk_loc is not None
        time.sleep(0.7)
        client.master.call("BatchRemove", pb.BatchKeysRequest(keys=["c"]))
        assert client.put_chunk("c2", kv * 3, FP)
        (now,) = client.reads.replica_lists(["c2"])
        client.leases.release(["c2"])
        assert now.replicas[0].offset == chunk_loc.result.replicas[0].offset  # the same space
        _force(client, chunk_loc.result)
        assert client.get_chunk("c", FP) is None
        assert torch.equal(client.get_chunk("c2", FP), kv * 3)


def _force(client: StoreClient, result: pb.ReplicaListResult) -> None:
    """Puts ``result`` back among the kept locations as if its lease had just begun."""
    client.locations.put([result], time.monotonic())
