"""KVMasterService: :class:`MasterHandlers` turns requests into :class:`MasterState` calls and
results into responses (plain, synchronous, no gRPC); :class:`KVMasterServicer` is the thin
gRPC layer over it, and the control wire (:mod:`.wire`) serves the same handlers.

Whole-call problems (empty batch, too many keys, bad options, unknown segment, duplicate
mount) are raised as :mod:`pdserve.errors` and become statuses; per-item outcomes are
KVErrorCode values in the results.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from pdserve.grpcutil import rpc
from pdserve.identity import Identity, grpc_caller, require
from pdserve.services.kvstore.master.auth import authorize, owner_prefix
from pdserve.services.kvstore.master.events import EventHub
from pdserve.services.kvstore.master.invalidation import FingerprintReport
from pdserve.services.kvstore.master.kv_events import KVEventLog
from pdserve.services.kvstore.master.namespaces import NamespaceTable
from pdserve.services.kvstore.master.pins import PinReport
from pdserve.services.kvstore.master.state import MasterState
from pdserve.services.kvstore.master.types import BlockMeta, GetOutcome, ReplicaLoc
from pdserve.store.grants import OP_READ, OP_WRITE, GrantKey, new_master_key, segment_key_for
from pdserve.store.transports.tcp import segment_key
from pdserve.store.wire import VERSION as WIRE_VERSION
from pdserve.v1 import kvstore_pb2 as pb
from pdserve.v1 import kvstore_pb2_grpc


def _keys(outcomes) -> pb.BatchKeysResponse:
    return pb.BatchKeysResponse(
        results=[pb.KeyResult(key=r.key, code=r.code, message=r.message) for r in outcomes]
    )


def _block(item: pb.PutStartItem) -> BlockMeta | None:
    if not item.HasField("block"):
        return None
    b = item.block
    return BlockMeta(
        b.parent_key,
        b.token_ids,
        b.block_size,
        b.medium,
        tuple(b.engine_block_hashes),
        b.engine_parent_block_hash,
        b.engine_block_size,
    )


def _usage(r: FingerprintReport, tenants: NamespaceTable) -> pb.FingerprintUsage:
    q = r.quarantine
    return pb.FingerprintUsage(
        fingerprint=r.digest,
        labels=r.labels,
        roots=[
            pb.RootUsage(root=k, objects=n, bytes=b, tenant=ns.tenant if ns else "")
            for k, (n, b) in sorted(r.roots.items())
            for ns in (tenants.get(k),)
        ],
        objects=r.objects,
        bytes=r.bytes,
        quarantined=q is not None,
        quarantine_reason=q.reason if q else "",
        quarantined_by=q.by if q else "",
        quarantined_ms=q.since_ms if q else 0,
        idle_ms=int(r.idle_s * 1000),
    )


def _pin(p: PinReport) -> pb.PinInfo:
    return pb.PinInfo(**dataclasses.asdict(p))


#: Handlers that take the caller's identity too.
CALLER_AWARE = frozenset({"BatchRemove", "SetQuarantine"})


class MasterHandlers:
    """One synchronous method per unary RPC, named as in the proto. Callers go through
    :meth:`call`: gRPC runs on the event loop and the control wire on its own threads, and
    :attr:`lock` lets one of them at a time touch the state (housekeeping takes it too)."""

    def __init__(self, state: MasterState) -> None:
        self.state = state
        self.lock = threading.Lock()
        #: The control wire's port once it listens (0 = off).
        self.wire_port = 0
        #: The host clients dial the wire at ("" = the one they reached the master at).
        self.wire_host = ""
        # segment id -> (the endpoint list it was made from, Replica template, the segment's
        # tcp key, its GrantKey or None)
        self._templates: dict[str, tuple[list, pb.Replica, int, GrantKey | None]] = {}
        #: The key every segment's data key derives from (pdserve/store/grants.py), new at
        #: each start; b"" when data_tokens is off.
        self.data_key = new_master_key() if state.cfg.data_tokens else b""

    def call(self, method: str, request: Any, caller: Identity | None = None) -> Any:
        """Runs the handler ``method`` for ``caller`` (None = a plaintext master: anyone)
        once :func:`.auth.authorize` lets it."""
        with self.lock:
            authorize(self.state, method, request, caller)
            if method in CALLER_AWARE:
                return getattr(self, method)(request, caller)
            return getattr(self, method)(request)

    def fill(self, out, locs: Sequence[ReplicaLoc], size: int, op: int, expires_ms: int) -> None:
        """Appends a Replica per location to the repeated field ``out``: a copy of the
        segment's cached template (node, segment, endpoints) plus offset and size, about
        three times cheaper than building each one with its endpoints; with data tokens on,
        plus its grant for ``op`` (grants.OP_READ / OP_WRITE) until ``expires_ms`` (unix ms):
        one MAC, the segment's keyed state cached with its template."""
        segs = self.state.segments
        for r in locs:
            seg = segs[r.segment_id]
            cached = self._templates.get(r.segment_id)
            # A remount replaces the endpoint list: the template is rebuilt from the new one.
            if cached is None or cached[0] is not seg.endpoints:
                tmpl = pb.Replica(
                    node_id=r.node_id,
                    segment_id=r.segment_id,
                    endpoints=seg.endpoints,
                    tier=seg.tier,
                )
                key = self._segment_data_key(r.segment_id)
                cached = self._templates[r.segment_id] = (
                    seg.endpoints,
                    tmpl,
                    segment_key(r.segment_id),
                    GrantKey(key) if key else None,
                )
            rep = out.add()
            rep.CopyFrom(cached[1])
            rep.offset = r.offset
            rep.size = size
            grants = cached[3]
            if grants is not None:
                rep.token = grants.mint(cached[2], r.offset, size, op, expires_ms, r.alloc_id)
                rep.token_expires_ms = expires_ms
                rep.alloc_id = r.alloc_id

    def _segment_data_key(self, segment_id: str) -> bytes:
        """The key a node checks ``segment_id``'s grants with (b"" = data tokens off)."""
        return segment_key_for(self.data_key, segment_id) if self.data_key else b""

    def MountSegment(self, request: pb.MountSegmentRequest) -> pb.MountSegmentResponse:
        seg = request.segment
        restored = self.state.mount(
            seg.segment_id,
            seg.node_id,
            seg.size,
            list(seg.endpoints),
            [(h.key, h.offset, h.size) for h in request.held],
            keeps_bytes=request.keeps_bytes,
            address=request.node_address,
            tier=seg.tier,
        )
        return pb.MountSegmentResponse(
            heartbeat_interval_ms=self.state.cfg.heartbeat_interval_ms,
            restored_objects=restored,
            data_key=self._segment_data_key(seg.segment_id),
        )

    def UnmountSegment(self, request: pb.UnmountSegmentRequest) -> pb.UnmountSegmentResponse:
        return pb.UnmountSegmentResponse(removed_objects=self.state.unmount(request.segment_id))

    def Heartbeat(self, request: pb.NodeHeartbeatRequest) -> pb.NodeHeartbeatResponse:
        return pb.NodeHeartbeatResponse(
            remount_required=self.state.heartbeat(request.node_id, list(request.segment_ids))
        )

    def BatchPutStart(self, request: pb.BatchPutStartRequest) -> pb.BatchPutStartResponse:
        o = request.options
        outcomes = self.state.put_start(
            request.client_id,
            [(i.key, i.size) for i in request.items],
            replicas=o.replicas,
            soft_pin=o.soft_pin,
            ttl_ms=o.ttl_ms,
            placement=o.placement,
            inline=[i.inline_data for i in request.items],
            checksums=[i.checksum for i in request.items],
            blocks=[_block(i) for i in request.items],
            spaces=[(n.root, n.fingerprint, n.labels, n.tenant) for n in request.namespaces],
            space_of=[i.namespace for i in request.items],
        )
        # Write grants last as long as the put may (its space is reclaimed after that).
        expires = int(self.state.clock.wall_ms() + self.state.cfg.put_timeout_s * 1000)
        resp = pb.BatchPutStartResponse()
        for item, r in zip(request.items, outcomes, strict=True):
            res = resp.results.add(
                key=r.key, code=r.code, message=r.message, already_exists=r.already_exists
            )
            self.fill(res.replicas, r.replicas, item.size, OP_WRITE, expires)
        return resp

    def BatchPutEnd(self, request: pb.BatchKeysRequest) -> pb.BatchKeysResponse:
        return _keys(self.state.put_end(request.client_id, list(request.keys)))

    def BatchPutRevoke(self, request: pb.BatchKeysRequest) -> pb.BatchKeysResponse:
        return _keys(self.state.put_revoke(request.client_id, list(request.keys)))

    def BatchGetReplicaList(
        self, request: pb.BatchGetReplicaListRequest
    ) -> pb.BatchGetReplicaListResponse:
        outcomes = self.state.get_replicas(request.client_id, list(request.keys), request.lease_ms)
        resp = pb.BatchGetReplicaListResponse()
        self.replica_lists(resp.results, outcomes)
        return resp

    def replica_lists(self, out, outcomes: Sequence[GetOutcome]) -> None:
        """Appends a ReplicaListResult per get outcome to the repeated field ``out``: its
        lease, inline bytes and checksum, and each replica with its read grant until the
        lease ends (BatchGetReplicaList, and LongestPrefix with its replicas)."""
        for r in outcomes:
            res = out.add(
                key=r.key, code=r.code, lease_expires_ms=r.lease_expires_ms, lease_ms=r.lease_ms
            )
            # set only when there are any: a lookup answers these for every key it found
            if r.inline:
                res.inline_data = r.inline
            if r.checksum:
                res.checksum = r.checksum
            if r.replicas:
                self.fill(res.replicas, r.replicas, r.size, OP_READ, r.lease_expires_ms)

    def BatchReleaseLease(self, request: pb.BatchKeysRequest) -> pb.BatchKeysResponse:
        return _keys(self.state.release(request.client_id, list(request.keys)))

    def BatchExists(self, request: pb.BatchKeysRequest) -> pb.BatchExistsResponse:
        return pb.BatchExistsResponse(exists=self.state.exists(request.keys))

    def LongestPrefix(self, request: pb.LongestPrefixRequest) -> pb.LongestPrefixResponse:
        if not request.with_replicas:
            return pb.LongestPrefixResponse(length=self.state.longest_prefix(request.keys))
        # The found keys' replica lists too, leased and granted as BatchGetReplicaList's.
        outcomes = self.state.prefix_replicas(
            request.client_id, list(request.keys), request.lease_ms
        )
        resp = pb.LongestPrefixResponse(length=len(outcomes))
        self.replica_lists(resp.results, outcomes)
        return resp

    def BatchRemove(
        self, request: pb.BatchKeysRequest, caller: Identity | None = None
    ) -> pb.BatchKeysResponse:
        owner = owner_prefix(caller) if caller is not None and caller.role != "admin" else ""
        return _keys(self.state.remove(list(request.keys), owner))

    def ListNamespaces(self, request: pb.ListNamespacesRequest) -> pb.ListNamespacesResponse:
        usage = self.state.invalidation.usage()
        spaces = self.state.namespaces
        return pb.ListNamespacesResponse(fingerprints=[_usage(r, spaces) for r in usage])

    def DropNamespaces(self, request: pb.DropNamespacesRequest) -> pb.DropNamespacesResponse:
        report = self.state.drop_namespaces(
            list(request.fingerprints), list(request.roots), request.dry_run
        )
        spaces = self.state.namespaces
        return pb.DropNamespacesResponse(
            dropped=[_usage(r, spaces) for r in report.fingerprints], deferred=report.deferred
        )

    def SetQuarantine(
        self, request: pb.SetQuarantineRequest, caller: Identity | None = None
    ) -> pb.SetQuarantineResponse:
        by = str(caller) if caller is not None else ""
        was, n = self.state.set_quarantine(
            request.fingerprint, request.quarantined, request.reason, by
        )
        return pb.SetQuarantineResponse(was_quarantined=was, objects=n)

    def PinKeys(self, request: pb.PinKeysRequest) -> pb.PinKeysResponse:
        pin, total, share = self.state.quotas.pin(
            request.tenant, request.name, list(request.keys), int(self.state.clock.wall_ms())
        )
        self.state.flush()  # the pin is journaled before the call answers
        return pb.PinKeysResponse(
            pin=_pin(pin), tenant_pinned_bytes=total, memory_share_bytes=share
        )

    def UnpinKeys(self, request: pb.UnpinKeysRequest) -> pb.UnpinKeysResponse:
        removed = self.state.pins.unpin(request.tenant, request.name)
        self.state.flush()
        return pb.UnpinKeysResponse(removed=removed)

    def ListPins(self, request: pb.ListPinsRequest) -> pb.ListPinsResponse:
        tenant = request.tenant or None
        quotas = self.state.quotas
        return pb.ListPinsResponse(
            pins=[_pin(p) for p in quotas.pins.report(tenant)],
            tenants=[pb.TenantUsage(**dataclasses.asdict(t)) for t in quotas.report(tenant)],
        )

    def Stats(self, request: pb.StatsRequest) -> pb.StatsResponse:
        # StoreStats has StatsResponse's fields, one for one (segments as SegmentStats).
        return pb.StatsResponse(**dataclasses.asdict(self.state.stats()))

    def GetControlWire(self, request: pb.ControlWireRequest) -> pb.ControlWireResponse:
        return pb.ControlWireResponse(
            port=self.wire_port,
            version=WIRE_VERSION if self.wire_port else 0,
            inline_max_bytes=self.state.cfg.inline_max_bytes,
            host=self.wire_host,
        )


class KVMasterServicer(kvstore_pb2_grpc.KVMasterServiceServicer):
    """Each call runs on a worker thread, so the event loop never waits for the state lock
    or a SQLite commit (a slow disk stalls callers, not heartbeats or the event stream)."""

    def __init__(
        self, handlers: MasterHandlers, hub: EventHub, kv_events: KVEventLog | None = None
    ) -> None:
        self.h = handlers
        self.hub = hub
        self.kv_events = kv_events or KVEventLog()

    async def _call(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        caller = grpc_caller(context)
        return await asyncio.to_thread(self.h.call, method, request, caller)

    @rpc
    async def MountSegment(self, request, context):
        return await self._call("MountSegment", request, context)

    @rpc
    async def UnmountSegment(self, request, context):
        return await self._call("UnmountSegment", request, context)

    @rpc
    async def Heartbeat(self, request, context):
        return await self._call("Heartbeat", request, context)

    @rpc
    async def BatchPutStart(self, request, context):
        return await self._call("BatchPutStart", request, context)

    @rpc
    async def BatchPutEnd(self, request, context):
        return await self._call("BatchPutEnd", request, context)

    @rpc
    async def BatchPutRevoke(self, request, context):
        return await self._call("BatchPutRevoke", request, context)

    @rpc
    async def BatchGetReplicaList(self, request, context):
        return await self._call("BatchGetReplicaList", request, context)

    @rpc
    async def BatchReleaseLease(self, request, context):
        return await self._call("BatchReleaseLease", request, context)

    @rpc
    async def BatchExists(self, request, context):
        return await self._call("BatchExists", request, context)

    @rpc
    async def LongestPrefix(self, request, context):
        return await self._call("LongestPrefix", request, context)

    @rpc
    async def BatchRemove(self, request, context):
        return await self._call("BatchRemove", request, context)

    @rpc
    async def Stats(self, request, context):
        return await self._call("Stats", request, context)

    @rpc
    async def GetControlWire(self, request, context):
        return await self._call("GetControlWire", request, context)

    @rpc
    async def ListNamespaces(self, request, context):
        return await self._call("ListNamespaces", request, context)

    @rpc
    async def DropNamespaces(self, request, context):
        return await self._call("DropNamespaces", request, context)

    @rpc
    async def SetQuarantine(self, request, context):
        return await self._call("SetQuarantine", request, context)

    @rpc
    async def PinKeys(self, request, context):
        return await self._call("PinKeys", request, context)

    @rpc
    async def UnpinKeys(self, request, context):
        return await self._call("UnpinKeys", request, context)

    @rpc
    async def ListPins(self, request, context):
        return await self._call("ListPins", request, context)

    @rpc
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVEvent]:
        require(grpc_caller(context), EVENT_READERS, "watch the store's events")
        sub = self.hub.subscribe()
        try:
            while True:
                event = await sub.next()
                if event is None:
                    return
                yield event
        finally:
            self.hub.unsubscribe(sub)

    @rpc
    async def SubscribeKVEvents(
        self, request: pb.SubscribeKVEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVEventBatch]:
        caller = grpc_caller(context)
        require(caller, EVENT_READERS, "subscribe to the KV events")
        # the prompts' token ids only to an admin (an indexer outside pdserve may need them);
        # pdserve's router follows the chunk keys
        private = caller is None or caller.role == "admin"
        events = self.kv_events

        def subscribe():
            if not request.snapshot:
                from_seq = request.from_seq if request.HasField("from_seq") else None
                return events.subscribe(from_seq=from_seq)
            with self.h.lock:  # the keys and the subscription at one point of the history
                state = self.h.state
                return events.subscribe(snapshot=state.visible_keys(), block_of=state.block_of)

        sub, first = await asyncio.to_thread(subscribe)
        try:
            for batch in first:
                yield batch if private else without_token_ids(batch)
            while True:
                batch = await sub.next()
                if batch is None:
                    return
                yield batch if private else without_token_ids(batch)
        finally:
            events.unsubscribe(sub)


#: Who may follow the store's event streams: they name every chunk stored (and SubscribeKVEvents
#: the prompts' token ids), which only a router placing requests by cache needs (and admins).
EVENT_READERS = ("router",)


def without_token_ids(batch: pb.KVEventBatch) -> pb.KVEventBatch:
    """``batch`` without the token ids of its stored blocks (itself when it carries none)."""
    if not any(e.stored.token_ids for e in batch.events if e.HasField("stored")):
        return batch
    out = pb.KVEventBatch()
    out.CopyFrom(batch)
    for e in out.events:
        if e.HasField("stored"):
            del e.stored.token_ids[:]
    return out
