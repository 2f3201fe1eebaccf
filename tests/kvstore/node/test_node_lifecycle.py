"""Storage node lifecycle on real processes: clean SIGTERM leaves no /dev/shm behind, the
node's Stats RPC counts data-plane bytes, garbage on its data port damages nothing, and a
master restart loses no byte (the node remounts the same segments)."""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from pdserve import grpcutil, procs
from pdserve.store import open_store
from pdserve.store.api import StoreOptions
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc


def _blob(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def shm_leftovers(node: procs.ServiceProcess) -> list[str]:
    return [n for n in node.info.get("shm_names", []) if (Path("/dev/shm") / n).exists()]


@pytest.mark.slow
def test_node_sigterm_unlinks_shm_and_unmounts(cluster_factory) -> None:
    c = cluster_factory()
    node = c.add_node(segment_sizes="16MiB,8MiB")
    names = node.info["shm_names"]
    assert len(names) == 2 and all((Path("/dev/shm") / n).exists() for n in names)
    client = open_store(c.address)
    assert client.stats().capacity_bytes == 24 * 1024 * 1024
    assert node.stop() == 0
    assert shm_leftovers(node) == []
    deadline = time.monotonic() + 3
    while client.stats().capacity_bytes != 0:
        assert time.monotonic() < deadline, "the master still counts the stopped node"
        time.sleep(0.05)
    client.close()


@pytest.mark.slow
def test_node_stats_and_garbage_on_data_port(cluster_factory) -> None:
    c = cluster_factory()
    node = c.add_node(transports="tcp", metrics_port=0)
    client = open_store(c.address, transport="tcp")
    data = _blob(1_000_000, 1)
    assert client.put("keep", data)
    rng = np.random.default_rng(2)
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", node.info["tcp_port"]), timeout=5) as s:
            s.sendall(rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes())
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
    assert node.alive()
    assert client.get("keep") == data
    ch = grpcutil.sync_channel(f"127.0.0.1:{node.info['port']}")
    stats = kvstore_pb2_grpc.KVNodeServiceStub(ch).Stats(kvstore_pb2.NodeStatsRequest(), timeout=5)
    assert stats.node_id == node.info["node_id"]
    assert stats.bytes_written == len(data) and stats.bytes_read == len(data)
    assert stats.segments[0].endpoints[0].transport == kvstore_pb2.TRANSPORT_TCP
    ch.close()
    import urllib.request

    metrics_url = f"http://127.0.0.1:{node.info['metrics_port']}/metrics"
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    values = dict(
        line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert float(values["pdserve_kvnode_bytes_written"]) == len(data)
    client.close()


@pytest.mark.slow
def test_node_survives_master_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    master = procs.start_master(tmp_path / "logs", state_dir=state)
    port = master.info["grpc"].rsplit(":", 1)[1]
    node = procs.start_node(master.info["grpc"], tmp_path / "logs", segment_sizes="16MiB")
    try:
        client = open_store(master.info["grpc"], transport="tcp")
        data = {f"k{i}": _blob(200_000 + i, i) for i in range(5)}
        client.batch_put(list(data.items()), StoreOptions(replicas=1))
        master.stop()
        master = procs.start_master(tmp_path / "logs2", state_dir=state, port=port)
        deadline = time.monotonic() + 10
        while client.batch_get(list(data)) != list(data.values()):
            assert time.monotonic() < deadline, "objects did not come back after the restart"
            time.sleep(0.1)
        assert node.alive()
        assert client.put("after-restart", b"x" * 100)
        client.close()
    finally:
        node.stop()
        master.stop()
    assert shm_leftovers(node) == []


@pytest.mark.slow
def test_node_duplicate_id_refused_and_restart_keeps_bytes(cluster_factory) -> None:
    from pdserve.procs import ProcessStartError

    c = cluster_factory()
    node = c.add_node(node_id=f"dup{uuid.uuid4().hex[:6]}", segment_sizes="8MiB", transports="tcp")
    node_id = node.info["node_id"]
    # A second node with the same id must not take over (or wipe) the live node's memory.
    with pytest.raises(ProcessStartError, match="same node id"):
        c.add_node(node_id=node_id, segment_sizes="8MiB", transports="tcp")
    client = open_store(c.address, transport="tcp")
    data = _blob(500_000, 9)
    assert client.put("survivor", data)
    # SIGKILL and an immediate restart with the same id, before the master declares the node
    # dead: the master keeps the replica, and the bytes behind it are still the same.
    node.kill()
    again = c.add_node(node_id=node_id, segment_sizes="8MiB", transports="tcp")
    assert again.info["shm_names"] == node.info["shm_names"]
    assert client.get("survivor") == data
    client.close()


@pytest.mark.slow
def test_a_node_advertises_its_advertise_host_in_segment_endpoints(cluster_factory) -> None:
    """Bound to one address, reached at another (a NAT, a container name): the tcp endpoint
    the master hands to readers carries --advertise-host, and reads through it work."""
    c = cluster_factory()
    node = c.add_node(transports="tcp", advertise_host="localhost")
    with open_store(c.address, transport="tcp") as client:
        data = _blob(100_000, 3)
        assert client.put("adv", data) and client.get("adv") == data
        (res,) = client.reads.replica_lists(["adv"])
        client.leases.release(["adv"])
    (rep,) = res.replicas
    assert [e.address for e in rep.endpoints] == [f"localhost:{node.info['tcp_port']}"]
