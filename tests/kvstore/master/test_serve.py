"""The real ``pdserve kvstore master`` process over gRPC, with a fake node that only mounts
segments and heartbeats (the master never sees payload bytes)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest

from pdserve import procs
from pdserve.v1 import kvstore_pb2 as pb
from pdserve.v1 import kvstore_pb2_grpc

KB = 1024


class FakeNode:
    """Mounts segments and heartbeats from a thread; remounts when the master asks."""

    def __init__(self, address: str, node_id: str, segments: dict[str, int]) -> None:
        self.node_id = node_id
        self.segments = segments
        self.remounts = 0
        self._stop = threading.Event()
        self.connect(address)
        self._mount_all()
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

    def connect(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = kvstore_pb2_grpc.KVMasterServiceStub(self.channel)

    def _mount_all(self) -> None:
        for sid, size in self.segments.items():
            self.stub.MountSegment(
                pb.MountSegmentRequest(
                    segment=pb.Segment(segment_id=sid, node_id=self.node_id, size=size),
                    keeps_bytes=True,
                ),
                timeout=5,
            )

    def _beat(self) -> None:
        while not self._stop.wait(0.2):
            try:
                resp = self.stub.Heartbeat(
                    pb.NodeHeartbeatRequest(node_id=self.node_id, segment_ids=list(self.segments)),
                    timeout=2,
                )
                if resp.remount_required:
                    self._mount_all()
                    self.remounts += 1
            except grpc.RpcError:
                pass  # master down: keep trying

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.channel.close()


def start_master(tmp_path: Path, *extra: str, name: str = "master") -> procs.ServiceProcess:
    return procs.start_master(tmp_path / "logs", *extra, name=name)


@pytest.fixture
def master(tmp_path: Path):
    proc = start_master(
        tmp_path,
        "--max-batch-keys",
        "16",
        "--max-key-bytes",
        "32",
        "--max-object-bytes",
        str(64 * KB),
    )
    yield proc
    proc.stop()


def stub_for(
    proc: procs.ServiceProcess,
) -> tuple[grpc.Channel, kvstore_pb2_grpc.KVMasterServiceStub]:
    ch = grpc.insecure_channel(proc.info["grpc"])
    return ch, kvstore_pb2_grpc.KVMasterServiceStub(ch)


def put(stub, keys: list[str], size: int = KB, replicas: int = 1) -> list[pb.PutStartResult]:
    start = stub.BatchPutStart(
        pb.BatchPutStartRequest(
            client_id="t",
            items=[pb.PutStartItem(key=k, size=size) for k in keys],
            options=pb.PutOptions(replicas=replicas),
        ),
        timeout=5,
    )
    ok = [r.key for r in start.results if r.code == pb.KV_OK and not r.already_exists]
    if ok:
        end = stub.BatchPutEnd(pb.BatchKeysRequest(client_id="t", keys=ok), timeout=5)
        assert all(r.code == pb.KV_OK for r in end.results), end
    return list(start.results)


def expect_status(call, code: grpc.StatusCode, *words: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    for w in words:
        assert w in info.value.details()


@pytest.mark.slow
def test_bad_input_statuses_and_messages(master) -> None:
    ch, stub = stub_for(master)
    node = FakeNode(master.info["grpc"], "n1", {"s1": 1024 * KB})
    try:
        put(stub, ["kept"])
        seg = pb.Segment(segment_id="s1", node_id="n1", size=1024 * KB)
        # Whole-call problems are gRPC statuses naming what was wrong.
        expect_status(
            lambda: stub.BatchExists(pb.BatchKeysRequest(keys=[])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "no keys",
        )
        expect_status(
            lambda: stub.LongestPrefix(pb.LongestPrefixRequest(keys=["k"] * 17)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "max_batch_keys=16",
        )
        expect_status(
            lambda: stub.UnmountSegment(pb.UnmountSegmentRequest(segment_id="nope")),
            grpc.StatusCode.NOT_FOUND,
            "nope",
            "not mounted",
        )
        dup = pb.Segment(segment_id="s1", node_id="n2", size=1024 * KB)
        expect_status(
            lambda: stub.MountSegment(pb.MountSegmentRequest(segment=dup)),
            grpc.StatusCode.ALREADY_EXISTS,
            "already mounted",
        )
        zero = pb.Segment(segment_id="s9", node_id="n1", size=0)
        expect_status(
            lambda: stub.MountSegment(pb.MountSegmentRequest(segment=zero)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "size must be > 0",
        )
        expect_status(
            lambda: stub.BatchPutStart(
                pb.BatchPutStartRequest(
                    items=[pb.PutStartItem(key="a", size=1)], options=pb.PutOptions(replicas=50)
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_replicas",
        )
        expect_status(
            lambda: stub.BatchPutStart(pb.BatchPutStartRequest()),
            grpc.StatusCode.INVALID_ARGUMENT,
            "no items",
        )
        # The same node remounting the same segment is idempotent.
        stub.MountSegment(pb.MountSegmentRequest(segment=seg, keeps_bytes=True), timeout=5)
        # Per-item problems are KVErrorCodes with messages.
        res = put(stub, ["", "x" * 33], size=KB) + put(stub, ["zero"], size=0)
        res += put(stub, ["huge"], size=64 * KB + 1)
        assert [r.code for r in res] == [pb.KV_INVALID] * 4
        assert "empty" in res[0].message
        assert "max_key_bytes=32" in res[1].message
        assert "> 0" in res[2].message
        assert "max_object_bytes" in res[3].message
        end = stub.BatchPutEnd(pb.BatchKeysRequest(keys=["never-started"]))
        assert end.results[0].code == pb.KV_NO_PENDING_PUT
        assert "no put in progress" in end.results[0].message
        again = put(stub, ["kept"])
        assert again[0].code == pb.KV_OK and again[0].already_exists
        # Nothing stored was damaged.
        assert list(stub.BatchExists(pb.BatchKeysRequest(keys=["kept"])).exists) == [True]
        stats = stub.Stats(pb.StatsRequest())
        assert stats.objects == 1 and stats.alive_nodes == 1
    finally:
        node.stop()
        ch.close()


@pytest.mark.slow
def test_events_and_dead_node(master) -> None:
    ch, stub = stub_for(master)
    n1 = FakeNode(master.info["grpc"], "n1", {"s1": 1024 * KB})
    n2 = FakeNode(master.info["grpc"], "n2", {"s2": 1024 * KB})
    events = stub.WatchEvents(pb.WatchEventsRequest())
    try:
        time.sleep(0.2)  # let the watch subscribe
        put(stub, ["both"], replicas=2)
        placed = put(stub, [f"k{i}" for i in range(8)])
        on_n1 = [r.key for r in placed if r.replicas[0].node_id == "n1"]
        assert on_n1, "free-ratio-first should spread objects over both nodes"
        first = next(events)
        assert (first.type, first.key, first.size) == (pb.KV_EVENT_STORED, "both", KB)
        n1.stop()
        t0 = time.monotonic()
        while stub.Stats(pb.StatsRequest()).alive_nodes != 1:
            assert time.monotonic() - t0 < 3.0, "dead node not detected within 3 s"
            time.sleep(0.05)
        got = stub.BatchGetReplicaList(pb.BatchGetReplicaListRequest(keys=["both", *on_n1]))
        assert [r.node_id for r in got.results[0].replicas] == ["n2"]
        assert all(r.code == pb.KV_NOT_FOUND for r in got.results[1:])
        removed = []
        for ev in events:
            if ev.type == pb.KV_EVENT_REMOVED:
                removed.append((ev.key, ev.reason))
            if len(removed) == len(on_n1):
                break
        assert sorted(removed) == sorted((k, pb.KV_EVENT_REASON_NODE_DEAD) for k in on_n1)
        # No new placement on the dead node.
        assert all(r.replicas[0].node_id == "n2" for r in put(stub, [f"new{i}" for i in range(6)]))
    finally:
        events.cancel()
        n2.stop()
        ch.close()


@pytest.mark.slow
def test_restart_keeps_committed_objects(tmp_path: Path) -> None:
    state = tmp_path / "state"
    proc = start_master(tmp_path, "--state-dir", str(state), name="master1")
    n1 = n2 = None
    try:
        n1 = FakeNode(proc.info["grpc"], "n1", {"s1": 1024 * KB})
        n2 = FakeNode(proc.info["grpc"], "n2", {"s2": 1024 * KB})
        ch, stub = stub_for(proc)
        keys = [f"chunk{i}" for i in range(30)]
        put(stub, keys[:10], replicas=2)
        put(stub, keys[10:])
        (pending,) = put_start_only(stub, "unfinished")
        before = replica_map(stub, keys)
        ch.close()
        proc.kill()  # SIGKILL: no clean shutdown
        proc = start_master(tmp_path, "--state-dir", str(state), name="master2")
        n1.connect(proc.info["grpc"])
        n2.connect(proc.info["grpc"])
        ch, stub = stub_for(proc)
        t0 = time.monotonic()
        while n1.remounts == 0 or n2.remounts == 0:
            assert time.monotonic() - t0 < 10, "nodes did not remount"
            time.sleep(0.05)
        assert list(stub.BatchExists(pb.BatchKeysRequest(keys=keys)).exists) == [True] * 30
        assert stub.LongestPrefix(pb.LongestPrefixRequest(keys=keys)).length == 30
        assert replica_map(stub, keys) == before
        # The unfinished put was never committed, so it is not resurrected.
        assert list(stub.BatchExists(pb.BatchKeysRequest(keys=["unfinished"])).exists) == [False]
        assert pending.code == pb.KV_OK
        # New puts do not overlap restored replicas.
        fresh = put(stub, [f"fresh{i}" for i in range(10)])
        used = {(s, o) for reps in before.values() for s, o in reps}
        assert not {(r.replicas[0].segment_id, r.replicas[0].offset) for r in fresh} & used
        ch.close()
    finally:
        for n in (n1, n2):
            if n is not None:
                n.stop()
        proc.stop()


def put_start_only(stub, key: str) -> list[pb.PutStartResult]:
    r = stub.BatchPutStart(pb.BatchPutStartRequest(items=[pb.PutStartItem(key=key, size=KB)]))
    return list(r.results)


def replica_map(stub, keys: list[str]) -> dict[str, list[tuple[str, int]]]:
    resp = stub.BatchGetReplicaList(pb.BatchGetReplicaListRequest(client_id="t", keys=keys))
    out = {}
    for r in resp.results:
        assert r.code == pb.KV_OK, r
        out[r.key] = sorted((rep.segment_id, rep.offset) for rep in r.replicas)
    return out


@pytest.mark.slow
def test_namespace_rpcs_answer_bad_input_with_invalid_argument(master) -> None:
    ch, stub = stub_for(master)
    try:
        expect_status(
            lambda: stub.DropNamespaces(pb.DropNamespacesRequest(fingerprints=["xyz"]), timeout=5),
            grpc.StatusCode.INVALID_ARGUMENT,
            "fingerprints[0] must be 64 lowercase hex",
        )
        expect_status(
            lambda: stub.DropNamespaces(pb.DropNamespacesRequest(), timeout=5),
            grpc.StatusCode.INVALID_ARGUMENT,
            "at least one fingerprint or root",
        )
        expect_status(
            lambda: stub.SetQuarantine(
                pb.SetQuarantineRequest(fingerprint="a" * 64, quarantined=True), timeout=5
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "needs a reason",
        )
        bad = pb.BatchPutStartRequest(
            client_id="t",
            items=[pb.PutStartItem(key="k", size=KB, namespace=1)],
            namespaces=[pb.KVNamespace(root="nothex", fingerprint="a" * 64)],
        )
        expect_status(
            lambda: stub.BatchPutStart(bad, timeout=5),
            grpc.StatusCode.INVALID_ARGUMENT,
            "namespaces[0].root",
        )
        assert not stub.ListNamespaces(pb.ListNamespacesRequest(), timeout=5).fingerprints
    finally:
        ch.close()
