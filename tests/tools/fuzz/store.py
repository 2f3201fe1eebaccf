"""The KV store's gRPC surface: valid master requests, the store a run targets
(:class:`StoreTarget`, with real tcp grants), and KVMasterService / KVNodeService
(:class:`Master`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from pdserve import grpcutil
from pdserve.store.transports import tcp
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc

from .cases import Case
from .grpc_surface import Bases, GrpcSurface, grpc_call, service_methods
from .invariants import (
    TIMEOUT_S,
    check_kv_results,
)

pb = kvstore_pb2


def _keys(k: int) -> pb.BatchKeysRequest:
    return pb.BatchKeysRequest(client_id="fz", keys=[f"fz-k{k}", f"fz-k{k + 1}"])


#: Valid KV master requests; the ``fz-`` ids never touch a real node's segments.
MASTER_BASES: Bases = {
    "KVMasterService.MountSegment": lambda k: pb.MountSegmentRequest(
        segment=pb.Segment(
            segment_id=f"fz-s{k}",
            node_id=f"fz-n{k}",
            size=1 << 20,
            endpoints=[pb.Endpoint(transport=pb.TRANSPORT_TCP, address="127.0.0.1:1")],
        ),
        held=[pb.HeldObject(key=f"fz-held{k}", offset=0, size=64)],
        keeps_bytes=k % 2 == 0,
    ),
    "KVMasterService.UnmountSegment": lambda k: pb.UnmountSegmentRequest(segment_id=f"fz-s{k}"),
    "KVMasterService.Heartbeat": lambda k: pb.NodeHeartbeatRequest(
        node_id=f"fz-n{k}", segment_ids=[f"fz-s{k}"]
    ),
    "KVMasterService.BatchPutStart": lambda k: pb.BatchPutStartRequest(
        client_id="fz",
        items=[pb.PutStartItem(key=f"fz-k{k}", size=100, checksum=bytes(16))],
        options=pb.PutOptions(replicas=1, ttl_ms=60_000),
    ),
    "KVMasterService.BatchPutEnd": _keys,
    "KVMasterService.BatchPutRevoke": _keys,
    "KVMasterService.BatchGetReplicaList": lambda k: pb.BatchGetReplicaListRequest(
        client_id="fz", keys=[f"fz-k{k}"], lease_ms=100
    ),
    "KVMasterService.BatchReleaseLease": _keys,
    "KVMasterService.BatchExists": _keys,
    "KVMasterService.LongestPrefix": lambda k: pb.LongestPrefixRequest(keys=_keys(k).keys),
    "KVMasterService.BatchRemove": _keys,
    "KVMasterService.Stats": lambda k: pb.StatsRequest(),
    "KVMasterService.WatchEvents": lambda k: pb.WatchEventsRequest(),
    "KVMasterService.GetControlWire": lambda k: pb.ControlWireRequest(),
    "KVMasterService.ListNamespaces": lambda k: pb.ListNamespacesRequest(),
    "KVMasterService.DropNamespaces": lambda k: pb.DropNamespacesRequest(
        fingerprints=[f"{k:064x}"], dry_run=k % 2 == 0
    ),
    "KVMasterService.SetQuarantine": lambda k: pb.SetQuarantineRequest(
        fingerprint=f"{k:064x}", quarantined=k % 2 == 0, reason="fz"
    ),
    "Health.Check": lambda k: health_pb2.HealthCheckRequest(),
}


#: Master flags of the store a fuzz run targets (:func:`pdserve.procs.local_store`): the tcp
#: surface's grants (:meth:`StoreTarget.of`) then last a day, the whole run.
STORE_MASTER_FLAGS: dict[str, object] = {"put_timeout_s": 86_400, "max_lease_ms": 86_400_000}

#: A tcp request range: segment key, offset, length, then its grant (as ``tcp.RANGE``).
TcpRange = tuple[int, int, int, int, int, int, int, bytes]


@dataclass
class StoreTarget:
    """A running master and storage node: the master's gRPC address and wire port, the node's
    gRPC address, its tcp data port and its segments (wire key -> size), and per grant op
    (read, write) a whole object's range with the grant the master gave for it (empty when
    the master runs with data tokens off)."""

    master: str
    wire_port: int
    node: str
    tcp: tuple[str, int]
    segments: dict[int, int]
    grants: dict[int, TcpRange] = field(default_factory=dict)

    @classmethod
    def of(cls, master_info: dict, node_info: dict) -> StoreTarget:
        """From the READY lines of a master (run with :data:`STORE_MASTER_FLAGS`) and a node
        (:func:`pdserve.procs.local_store`). Stores two objects for the tcp surface: one
        committed, its read grant leased for a day, and one whose put stays open, its write
        grant good until the put times out."""
        node = f"127.0.0.1:{node_info['port']}"
        with grpcutil.sync_channel(node) as ch:
            stats = grpc_call(
                ch, service_methods(_NODE)["KVNodeService.Stats"], b"", timeout=TIMEOUT_S
            )
        found = pb.NodeStatsResponse.FromString(stats[2][0])
        segments = {tcp.segment_key(s.segment_id): s.size for s in found.segments}
        return cls(
            master_info["grpc"],
            master_info["wire"],
            node,
            ("127.0.0.1", node_info["tcp_port"]),
            segments,
            tcp_grants(master_info["grpc"], min(segments.values()) // 4),
        )


def tcp_grants(master: str, size: int) -> dict[int, TcpRange]:
    """The read and the write grant of two ``size``-byte objects (see StoreTarget.of)."""
    from pdserve.store import grants

    def whole(rep: pb.Replica) -> TcpRange:
        seg = tcp.segment_key(rep.segment_id)
        return (seg, rep.offset, rep.size, rep.offset, rep.size, rep.token_expires_ms,
                rep.alloc_id, rep.token)  # fmt: skip

    with grpcutil.sync_channel(master) as ch:
        stub = kvstore_pb2_grpc.KVMasterServiceStub(ch)
        keys = ["fz-tcp-read", "fz-tcp-write"]
        start = stub.BatchPutStart(
            pb.BatchPutStartRequest(
                client_id="fz-tcp", items=[pb.PutStartItem(key=k, size=size) for k in keys]
            ),
            timeout=TIMEOUT_S,
        )
        stub.BatchPutEnd(pb.BatchKeysRequest(client_id="fz-tcp", keys=keys[:1]), timeout=TIMEOUT_S)
        got = stub.BatchGetReplicaList(
            pb.BatchGetReplicaListRequest(
                client_id="fz-tcp", keys=keys[:1], lease_ms=STORE_MASTER_FLAGS["max_lease_ms"]
            ),
            timeout=TIMEOUT_S,
        )
    read, write = got.results[0].replicas[0], start.results[1].replicas[0]
    if not read.token:
        return {}
    return {grants.OP_READ: whole(read), grants.OP_WRITE: whole(write)}


_MASTER = pb.DESCRIPTOR.services_by_name["KVMasterService"]
_NODE = pb.DESCRIPTOR.services_by_name["KVNodeService"]


class Master(GrpcSurface):
    """KVMasterService and the node's KVNodeService."""

    name = "master"
    endless = frozenset({"KVMasterService.WatchEvents"})

    def __init__(self, store: StoreTarget) -> None:
        routes = {**self.route(store.node, [_NODE]), **self.route(store.master, [_MASTER])}
        bases = {**MASTER_BASES, "KVNodeService.Stats": lambda k: pb.NodeStatsRequest()}
        super().__init__(routes, bases, "KVMasterService.Stats")

    def check_reply(self, case: Case, resp: Message) -> None:
        check_kv_results(resp, case.path, case.op)
