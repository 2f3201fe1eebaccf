"""SIGKILL of a storage node with replication 2: reads fall over to the surviving replica at
once, within 3 s the master stops handing out the dead node's replicas, and no new put lands
on it. Real processes: one master, three nodes, the client here (tcp: the killed node's shm
file would still be readable through an existing mapping)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdserve import grpcutil
from pdserve.store import open_store
from pdserve.store.api import StoreOptions
from pdserve.telemetry import REGISTRY
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc


def _replica_nodes(stub, keys: list[str]) -> dict[str, set[str]]:
    resp = stub.BatchGetReplicaList(
        kvstore_pb2.BatchGetReplicaListRequest(client_id="probe", keys=keys, lease_ms=1),
        timeout=5,
    )
    stub.BatchReleaseLease(kvstore_pb2.BatchKeysRequest(client_id="probe", keys=keys), timeout=5)
    return {r.key: {rep.node_id for rep in r.replicas} for r in resp.results}


@pytest.mark.slow
def test_node_sigkill_failover(cluster_factory) -> None:
    c = cluster_factory()
    nodes = [c.add_node(segment_sizes="32MiB", transports="tcp") for _ in range(3)]
    stub = kvstore_pb2_grpc.KVMasterServiceStub(grpcutil.sync_channel(c.address))
    client = open_store(c.address, transport="tcp", timeout_s=2.0)
    rng = np.random.default_rng(5)
    blobs = {
        f"obj-{i}": rng.integers(0, 256, 50_000 + i, dtype=np.uint8).tobytes() for i in range(30)
    }
    assert client.batch_put(list(blobs.items()), StoreOptions(replicas=2)) == [True] * 30
    placement = _replica_nodes(stub, list(blobs))
    assert all(len(v) == 2 for v in placement.values())
    victim = nodes[0]
    victim_id = victim.info["node_id"]
    on_victim = [k for k, v in placement.items() if victim_id in v]
    assert on_victim, "placement put nothing on the victim; the test would prove nothing"

    resp = stub.BatchGetReplicaList(
        kvstore_pb2.BatchGetReplicaListRequest(client_id="probe", keys=on_victim, lease_ms=1),
        timeout=5,
    )
    victim_first = sum(r.replicas[0].node_id == victim_id for r in resp.results)

    victim.kill()
    killed_at = time.monotonic()
    # Reads fall over right away, before the master has even noticed; the client tries the
    # failed node last from then on, so it costs one failover, not one per object.
    before = REGISTRY.get_sample_value("pdserve_store_read_failovers_total", {"transport": "tcp"})
    assert client.batch_get(on_victim) == [blobs[k] for k in on_victim]
    after = REGISTRY.get_sample_value("pdserve_store_read_failovers_total", {"transport": "tcp"})
    assert victim_first >= 2, "the victim was listed first for too few objects to tell"
    assert (after or 0) - (before or 0) == 1
    # Within 3 s the master stops handing out the dead node's replicas.
    while True:
        placement = _replica_nodes(stub, list(blobs))
        if not any(victim_id in v for v in placement.values()):
            break
        assert time.monotonic() - killed_at < 3.0, "master still hands out the dead node"
        time.sleep(0.05)
    elapsed = time.monotonic() - killed_at
    assert elapsed < 3.0
    assert client.batch_get(list(blobs)) == list(blobs.values())
    # The objects that lost their copy on the victim get a second one on the third node.
    while not all(len(placement[k]) == 2 for k in on_victim):
        assert time.monotonic() - killed_at < 10.0, "lost replicas were not made again"
        time.sleep(0.1)
        placement = _replica_nodes(stub, list(blobs))
    assert not any(victim_id in v for v in placement.values())
    # New puts avoid the dead node and still get two replicas.
    fresh = {f"new-{i}": rng.integers(0, 256, 10_000, dtype=np.uint8).tobytes() for i in range(20)}
    assert client.batch_put(list(fresh.items()), StoreOptions(replicas=2)) == [True] * 20
    for nodes_of in _replica_nodes(stub, list(fresh)).values():
        assert victim_id not in nodes_of and len(nodes_of) == 2
    assert client.batch_get(list(fresh)) == list(fresh.values())
    assert client.stats().alive_nodes == 2
    client.close()
