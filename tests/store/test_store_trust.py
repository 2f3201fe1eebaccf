"""Nobody reads, writes or routes what is not theirs: a KV master and node with mutual TLS
(certificates made here with ``pdserve certs``' code), called by several identities over
gRPC and the control wire. Each attack of issue 15 is refused with its status, and the same
operation succeeds for the identity it belongs to."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve import errors, identity, procs
from pdserve.commands import certs
from pdserve.store import open_store
from pdserve.store.segment import shm_name
from pdserve.store.wire import WireClient, WireUnreachable
from pdserve.v1 import kvstore_pb2 as pb
from pdserve.v1 import kvstore_pb2_grpc

IDENTITIES = [
    "master:kvstore-master",
    "node:node-a",
    "node:node-b",
    "worker:w1",
    "worker:w2",
    "router:r1",
    "admin:ops",
]


def _files(d: Path, name: str) -> identity.TlsFiles:
    return identity.TlsFiles.load(str(d / "ca.crt"), str(d / f"{name}.crt"), str(d / f"{name}.key"))


def _tls_flags(d: Path, name: str) -> dict[str, object]:
    return {"tls_ca": d / "ca.crt", "tls_cert": d / f"{name}.crt", "tls_key": d / f"{name}.key"}


class Peers:
    def __init__(self, d: Path, master: procs.ServiceProcess, node: procs.ServiceProcess):
        self.dir, self.master, self.node = d, master, node
        self.address = master.info["grpc"]
        self._channels: list[grpc.Channel] = []

    def stub(self, name: str | None) -> kvstore_pb2_grpc.KVMasterServiceStub:
        """The master's stub as ``name`` (None = no certificate: plain TLS client)."""
        if name is None:
            creds = grpc.ssl_channel_credentials(
                root_certificates=(self.dir / "ca.crt").read_bytes()
            )
        else:
            f = _files(self.dir, name)
            creds = grpc.ssl_channel_credentials(f.ca, f.key, f.cert)
        ch = grpc.secure_channel(self.address, creds)
        self._channels.append(ch)
        return kvstore_pb2_grpc.KVMasterServiceStub(ch)

    def wire(self, name: str) -> WireClient:
        port = self.stub(name).GetControlWire(pb.ControlWireRequest(), timeout=5).port
        return WireClient("127.0.0.1", port, 5.0, tls=_files(self.dir, name))

    def close(self) -> None:
        for ch in self._channels:
            ch.close()


@pytest.fixture(scope="module")
def peers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Peers]:
    d = tmp_path_factory.mktemp("trust")
    certs.make(d / "certs", IDENTITIES)
    cd = d / "certs"
    master = procs.start_master(d, **_tls_flags(cd, "kvstore-master"))
    node = None
    try:
        node = procs.start_node(
            master.info["grpc"], d, node_id="node-a", transports="tcp", **_tls_flags(cd, "node-a")
        )
        p = Peers(cd, master, node)
        yield p
        p.close()
    finally:
        if node is not None:
            node.stop()
            procs.remove_shm(node)
        master.stop()


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


@pytest.mark.slow
def test_a_caller_without_a_certificate_is_refused(peers: Peers):
    stub = peers.stub(None)
    code = _code(lambda: stub.Stats(pb.StatsRequest(), timeout=5))
    assert code == grpc.StatusCode.UNAVAILABLE  # the TLS handshake fails: no certificate
    plain = kvstore_pb2_grpc.KVMasterServiceStub(grpc.insecure_channel(peers.address))
    assert _code(lambda: plain.Stats(pb.StatsRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE
    # the control wire: a plaintext hello is not a TLS handshake, and no certificate fails it
    port = peers.stub("w1").GetControlWire(pb.ControlWireRequest(), timeout=5).port
    with pytest.raises((errors.PdserveError, ConnectionError)):
        WireClient("127.0.0.1", port, 2.0, tls=None).call("Stats", pb.StatsRequest())


@pytest.mark.slow
def test_only_a_node_mounts_and_only_its_own_node_id(peers: Peers):
    seg = pb.Segment(
        segment_id="node-a-seg0",
        node_id="node-a",
        size=1 << 40,
        endpoints=[pb.Endpoint(transport=pb.TRANSPORT_TCP, address="127.0.0.1:1")],
    )
    mount = pb.MountSegmentRequest(segment=seg)
    # a worker mounting a fake 1 TiB segment that would capture new puts
    assert _code(lambda: peers.stub("w1").MountSegment(mount, timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    # another node remounting node-a's real segment with its own endpoint
    assert _code(lambda: peers.stub("node-b").MountSegment(mount, timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    # another node's forged heartbeat that would drop every object of node-a
    beat = pb.NodeHeartbeatRequest(node_id="node-a", segment_ids=[])
    assert _code(lambda: peers.stub("node-b").Heartbeat(beat, timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    unmount = pb.UnmountSegmentRequest(segment_id="node-a-seg0")
    assert _code(lambda: peers.stub("node-b").UnmountSegment(unmount, timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    # node-b may mount its own segment; the real node-a is still mounted and serving
    own = pb.Segment(
        segment_id="node-b-seg0",
        node_id="node-b",
        size=1 << 20,
        endpoints=[pb.Endpoint(transport=pb.TRANSPORT_TCP, address="127.0.0.1:1")],
    )
    peers.stub("node-b").MountSegment(pb.MountSegmentRequest(segment=own), timeout=5)
    peers.stub("node-b").UnmountSegment(
        pb.UnmountSegmentRequest(segment_id="node-b-seg0"), timeout=5
    )
    stats = peers.stub("ops").Stats(pb.StatsRequest(), timeout=5)
    assert [s.segment_id for s in stats.segments] == ["node-a-seg0"]


@pytest.mark.slow
def test_a_node_names_only_its_own_segments_and_their_own_files(peers: Peers):
    """Segment ids are bound to their node: another node's certificate cannot take a segment
    of node-a (one node-a has not mounted now, as while node-a is presumed dead, or a name
    that merely starts with node-a's), nor serve its own segment from node-a's shm file."""
    tcp = [pb.Endpoint(transport=pb.TRANSPORT_TCP, address="127.0.0.1:1")]
    for seg_id in ("node-a-seg7", "node-a-disk0", "node-b-x-seg0", "node-bb-seg0", "seg0"):
        seg = pb.Segment(segment_id=seg_id, node_id="node-b", size=1 << 20, endpoints=tcp)
        mount = pb.MountSegmentRequest(segment=seg)
        assert _code(lambda m=mount: peers.stub("node-b").MountSegment(m, timeout=5)) == (
            grpc.StatusCode.PERMISSION_DENIED
        ), seg_id
        unmount = pb.UnmountSegmentRequest(segment_id=seg_id)
        assert _code(lambda u=unmount: peers.stub("node-b").UnmountSegment(u, timeout=5)) == (
            grpc.StatusCode.PERMISSION_DENIED
        ), seg_id
    other_file = pb.Endpoint(
        transport=pb.TRANSPORT_SHM, shm_name=shm_name("node-a-seg0"), host_id="h"
    )
    seg = pb.Segment(
        segment_id="node-b-seg1", node_id="node-b", size=1 << 20, endpoints=[*tcp, other_file]
    )
    mount = pb.MountSegmentRequest(segment=seg)
    with pytest.raises(grpc.RpcError) as info:
        peers.stub("node-b").MountSegment(mount, timeout=5)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "pdserve-kv-node-b-seg1" in info.value.details()
    # its own file is fine; an admin may act on any segment
    own = pb.Endpoint(transport=pb.TRANSPORT_SHM, shm_name=shm_name("node-b-seg1"), host_id="h")
    del seg.endpoints[1:]
    seg.endpoints.append(own)
    peers.stub("node-b").MountSegment(pb.MountSegmentRequest(segment=seg), timeout=5)
    peers.stub("ops").UnmountSegment(pb.UnmountSegmentRequest(segment_id="node-b-seg1"), timeout=5)
    stats = peers.stub("ops").Stats(pb.StatsRequest(), timeout=5)
    assert [s.segment_id for s in stats.segments] == ["node-a-seg0"]


def _start(stub, key: str, client_id: str = "c") -> None:
    resp = stub.BatchPutStart(
        pb.BatchPutStartRequest(client_id=client_id, items=[pb.PutStartItem(key=key, size=4096)]),
        timeout=5,
    )
    assert resp.results[0].code == pb.KV_OK, resp


@pytest.mark.slow
def test_a_client_ends_only_its_own_puts_and_removes_only_its_own_objects(peers: Peers):
    w1, w2, ops = peers.stub("w1"), peers.stub("w2"), peers.stub("ops")
    _start(w1, "t-owned")
    # w2 sends w1's client id: the ids are scoped by identity, so it is still not the owner
    for method in ("BatchPutEnd", "BatchPutRevoke"):
        resp = getattr(w2, method)(pb.BatchKeysRequest(client_id="c", keys=["t-owned"]), timeout=5)
        assert resp.results[0].code == pb.KV_NOT_OWNER, method
    resp = w1.BatchPutEnd(pb.BatchKeysRequest(client_id="c", keys=["t-owned"]), timeout=5)
    assert resp.results[0].code == pb.KV_OK
    gone = w2.BatchRemove(pb.BatchKeysRequest(client_id="c", keys=["t-owned"]), timeout=5)
    assert gone.results[0].code == pb.KV_NOT_OWNER
    # w2 may read it, and its lease is its own: w1 sending w2's client id releases nothing
    got = w2.BatchGetReplicaList(pb.BatchGetReplicaListRequest(client_id="c", keys=["t-owned"]))
    assert got.results[0].code == pb.KV_OK
    keys = pb.BatchKeysRequest(client_id="c", keys=["t-owned"])
    w1.BatchReleaseLease(keys, timeout=5)
    assert w1.BatchRemove(keys, timeout=5).results[0].code == pb.KV_LEASED
    w2.BatchReleaseLease(keys, timeout=5)
    assert w1.BatchRemove(keys, timeout=5).results[0].code == pb.KV_OK
    # an admin may remove anyone's object
    _start(w1, "t-admin")
    w1.BatchPutEnd(pb.BatchKeysRequest(client_id="c", keys=["t-admin"]), timeout=5)
    assert ops.BatchRemove(pb.BatchKeysRequest(keys=["t-admin"])).results[0].code == pb.KV_OK


@pytest.mark.slow
def test_nodes_may_not_act_as_clients_nor_clients_as_nodes(peers: Peers):
    node = peers.stub("node-b")
    put = pb.BatchPutStartRequest(client_id="n", items=[pb.PutStartItem(key="t-n", size=1)])
    assert _code(lambda: node.BatchPutStart(put, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
    beat = pb.NodeHeartbeatRequest(node_id="w1", segment_ids=[])
    assert _code(lambda: peers.stub("w1").Heartbeat(beat, timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    # reading public state is open to every identity of the cluster
    assert node.LongestPrefix(pb.LongestPrefixRequest(keys=["a"]), timeout=5).length == 0


@pytest.mark.slow
def test_the_event_streams_go_to_routers_and_the_token_ids_to_admins(peers: Peers):
    """Probe: any identity of the cluster (a storage node's) read every tenant's prompt token
    ids from SubscribeKVEvents. Only a router (and an admin) follows the events; the token ids
    go to an admin only (pdserve's router follows the chunk keys)."""
    import struct

    w1 = peers.stub("w1")
    key = "ab" * 32
    block = pb.KVBlockMeta(token_ids=struct.pack("<4I", 11, 12, 13, 14), block_size=4)
    item = pb.PutStartItem(key=key, size=4096, block=block)
    assert w1.BatchPutStart(pb.BatchPutStartRequest(client_id="e", items=[item])).results[
        0
    ].code == (pb.KV_OK)
    w1.BatchPutEnd(pb.BatchKeysRequest(client_id="e", keys=[key]), timeout=5)
    snapshot = pb.SubscribeKVEventsRequest(snapshot=True)
    for name in ("node-b", "w1"):
        subscribe = peers.stub(name).SubscribeKVEvents(snapshot, timeout=5)
        code = _code(lambda s=subscribe: next(s))
        assert code == grpc.StatusCode.PERMISSION_DENIED, name
        watch = peers.stub(name).WatchEvents(pb.WatchEventsRequest(), timeout=5)
        assert _code(lambda w=watch: next(w)) == grpc.StatusCode.PERMISSION_DENIED, name

    def stored(name: str) -> pb.KVBlockStored:
        """The stored event of ``key`` as ``name`` receives it (replayed from the ring)."""
        replay = pb.SubscribeKVEventsRequest(from_seq=0)
        for batch in peers.stub(name).SubscribeKVEvents(replay, timeout=10):
            for e in batch.events:
                if e.HasField("stored") and bytes.fromhex(key) in e.stored.block_hashes:
                    return e.stored
        raise AssertionError("no stored event")

    for_router, for_admin = stored("r1"), stored("ops")
    assert list(for_router.token_ids) == []
    assert list(for_admin.token_ids) == [11, 12, 13, 14]
    assert peers.stub("ops").BatchRemove(pb.BatchKeysRequest(keys=[key])).results[0].code == (
        pb.KV_OK
    )


@pytest.mark.slow
def test_the_control_wire_applies_the_same_rules(peers: Peers):
    w1, w2 = peers.wire("w1"), peers.wire("w2")
    try:
        start = pb.BatchPutStartRequest(
            client_id="c", items=[pb.PutStartItem(key="t-wire", size=4096)]
        )
        assert w1.call("BatchPutStart", start).results[0].code == pb.KV_OK
        end = pb.BatchKeysRequest(client_id="c", keys=["t-wire"])
        assert w2.call("BatchPutEnd", end).results[0].code == pb.KV_NOT_OWNER
        assert w1.call("BatchPutEnd", end).results[0].code == pb.KV_OK
        with pytest.raises(errors.PermissionDenied):
            peers.wire("node-b").call("BatchRemove", pb.BatchKeysRequest(keys=["t-wire"]))
    finally:
        w1.close()
        w2.close()


@pytest.mark.slow
def test_the_right_identity_round_trips_bytes(peers: Peers):
    """The store client as worker w1: gRPC, the control wire and the tcp data port."""
    identity.configure_files(_files(peers.dir, "w1"))
    try:
        with open_store(peers.address, transport="tcp") as client:
            assert client.control_path == "wire"
            data = bytes(range(256)) * 4096  # 1 MiB
            assert client.put("t-bytes", data)
            assert client.get("t-bytes") == data
            assert client.remove(["t-bytes"]) == 1
    finally:
        identity.configure_files(None)


@pytest.mark.slow
def test_a_certificate_from_another_ca_is_refused(peers: Peers, tmp_path: Path):
    certs.make(tmp_path, ["admin:ops"])  # same name and role, another CA
    f = _files(tmp_path, "ops")
    ca = (peers.dir / "ca.crt").read_bytes()
    creds = grpc.ssl_channel_credentials(ca, f.key, f.cert)
    with grpc.secure_channel(peers.address, creds) as ch:
        stub = kvstore_pb2_grpc.KVMasterServiceStub(ch)
        assert _code(lambda: stub.Stats(pb.StatsRequest(), timeout=5)) == (
            grpc.StatusCode.UNAVAILABLE
        )
    assert isinstance(identity.client_context(_files(peers.dir, "w1")), ssl.SSLContext)


def test_the_control_wire_client_talks_only_to_a_master(tmp_path: Path):
    """Every cluster certificate is valid for localhost: a wire client checks that the server
    it reached presents a master's identity, not just any certificate of the CA."""
    import socket
    import threading

    certs.make(tmp_path, ["node:node-x", "worker:w9"])
    server_ctx = identity.server_context(_files(tmp_path, "node-x"))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve_one() -> None:
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.recv(16)
        except OSError:
            pass

    thread = threading.Thread(target=serve_one, daemon=True)
    thread.start()
    client = WireClient("127.0.0.1", port, 5.0, tls=_files(tmp_path, "w9"))
    try:
        with pytest.raises(WireUnreachable, match="the server is node:node-x, not a KV master"):
            client.call("Stats", pb.StatsRequest())
    finally:
        client.close()
        listener.close()
        thread.join(5)


@pytest.mark.slow
def test_only_admin_lists_and_drops_namespaces_and_clears_quarantines(peers: Peers):
    """A worker could drop another model's chunks, or lift the quarantine the router's check
    set: listing and dropping take admin, a quarantine the router (or admin), clearing it
    admin only."""
    fp = "9" * 64
    drop = pb.DropNamespacesRequest(fingerprints=[fp])
    for name in ("w1", "r1", "node-a"):
        stub = peers.stub(name)
        denied = grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda s=stub: s.ListNamespaces(pb.ListNamespacesRequest(), timeout=5)) == (
            denied
        ), name
        assert _code(lambda s=stub: s.DropNamespaces(drop, timeout=5)) == denied, name
    quarantine = pb.SetQuarantineRequest(fingerprint=fp, quarantined=True, reason="diverged")
    w1 = peers.stub("w1")
    assert (
        _code(lambda: w1.SetQuarantine(quarantine, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
    )
    r1 = peers.stub("r1")
    assert not r1.SetQuarantine(quarantine, timeout=5).was_quarantined
    clear = pb.SetQuarantineRequest(fingerprint=fp, quarantined=False)
    assert _code(lambda: r1.SetQuarantine(clear, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
    admin = peers.stub("ops")
    everything = admin.ListNamespaces(pb.ListNamespacesRequest(), timeout=5).fingerprints
    (listed,) = [f for f in everything if f.fingerprint]  # the module's other objects: ""
    assert listed.fingerprint == fp and listed.quarantined_by == "router:r1"
    assert admin.SetQuarantine(clear, timeout=5).was_quarantined
    assert admin.DropNamespaces(drop, timeout=5).dropped == []
