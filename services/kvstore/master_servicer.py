"""KVMasterService: a thin gRPC layer over :class:`MasterState`.

Whole-call problems (empty batch, too many keys, bad options, unknown segment, duplicate
mount) are gRPC statuses raised as :mod:`pdserve.errors`; per-item outcomes are KVErrorCode
values in the results.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdserve.grpcutil import rpc
from pdserve.services.kvstore.events import EventHub
from pdserve.services.kvstore.master_state import MasterState, ReplicaLoc
from pdserve.v1 import kvstore_pb2 as pb
from pdserve.v1 import kvstore_pb2_grpc


class KVMasterServicer(kvstore_pb2_grpc.KVMasterServiceServicer):
    def __init__(self, state: MasterState, hub: EventHub) -> None:
        self.state = state
        self.hub = hub

    def _replicas(self, locs: tuple[ReplicaLoc, ...] | list[ReplicaLoc], size: int) -> list:
        segs = self.state.segments
        return [
            pb.Replica(
                node_id=r.node_id,
                segment_id=r.segment_id,
                offset=r.offset,
                size=size,
                endpoints=segs[r.segment_id].endpoints,
            )
            for r in locs
        ]

    @rpc
    async def MountSegment(
        self, request: pb.MountSegmentRequest, context
    ) -> pb.MountSegmentResponse:
        seg = request.segment
        restored = self.state.mount(
            seg.segment_id,
            seg.node_id,
            seg.size,
            list(seg.endpoints),
            [(h.key, h.offset, h.size) for h in request.held],
        )
        return pb.MountSegmentResponse(
            heartbeat_interval_ms=self.state.cfg.heartbeat_interval_ms, restored_objects=restored
        )

    @rpc
    async def UnmountSegment(
        self, request: pb.UnmountSegmentRequest, context
    ) -> pb.UnmountSegmentResponse:
        return pb.UnmountSegmentResponse(removed_objects=self.state.unmount(request.segment_id))

    @rpc
    async def Heartbeat(
        self, request: pb.NodeHeartbeatRequest, context
    ) -> pb.NodeHeartbeatResponse:
        return pb.NodeHeartbeatResponse(
            remount_required=self.state.heartbeat(request.node_id, list(request.segment_ids))
        )

    @rpc
    async def BatchPutStart(
        self, request: pb.BatchPutStartRequest, context
    ) -> pb.BatchPutStartResponse:
        o = request.options
        outcomes = self.state.put_start(
            request.client_id,
            [(i.key, i.size) for i in request.items],
            replicas=o.replicas,
            soft_pin=o.soft_pin,
            ttl_ms=o.ttl_ms,
            placement=o.placement,
        )
        return pb.BatchPutStartResponse(
            results=[
                pb.PutStartResult(
                    key=r.key,
                    code=r.code,
                    message=r.message,
                    already_exists=r.already_exists,
                    replicas=self._replicas(r.replicas, item.size),
                )
                for item, r in zip(request.items, outcomes, strict=True)
            ]
        )

    @staticmethod
    def _keys(outcomes) -> pb.BatchKeysResponse:
        return pb.BatchKeysResponse(
            results=[pb.KeyResult(key=r.key, code=r.code, message=r.message) for r in outcomes]
        )

    @rpc
    async def BatchPutEnd(self, request: pb.BatchKeysRequest, context) -> pb.BatchKeysResponse:
        return self._keys(self.state.put_end(request.client_id, list(request.keys)))

    @rpc
    async def BatchPutRevoke(self, request: pb.BatchKeysRequest, context) -> pb.BatchKeysResponse:
        return self._keys(self.state.put_revoke(request.client_id, list(request.keys)))

    @rpc
    async def BatchGetReplicaList(
        self, request: pb.BatchGetReplicaListRequest, context
    ) -> pb.BatchGetReplicaListResponse:
        outcomes = self.state.get_replicas(request.client_id, list(request.keys), request.lease_ms)
        objs = self.state.objects
        return pb.BatchGetReplicaListResponse(
            results=[
                pb.ReplicaListResult(
                    key=r.key,
                    code=r.code,
                    lease_expires_ms=r.lease_expires_ms,
                    replicas=self._replicas(r.replicas, objs[r.key].size) if r.replicas else [],
                )
                for r in outcomes
            ]
        )

    @rpc
    async def BatchReleaseLease(
        self, request: pb.BatchKeysRequest, context
    ) -> pb.BatchKeysResponse:
        return self._keys(self.state.release(request.client_id, list(request.keys)))

    @rpc
    async def BatchExists(self, request: pb.BatchKeysRequest, context) -> pb.BatchExistsResponse:
        return pb.BatchExistsResponse(exists=self.state.exists(request.keys))

    @rpc
    async def LongestPrefix(
        self, request: pb.LongestPrefixRequest, context
    ) -> pb.LongestPrefixResponse:
        return pb.LongestPrefixResponse(length=self.state.longest_prefix(request.keys))

    @rpc
    async def BatchRemove(self, request: pb.BatchKeysRequest, context) -> pb.BatchKeysResponse:
        return self._keys(self.state.remove(list(request.keys)))

    @rpc
    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        return self.state.stats()

    @rpc
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVEvent]:
        sub = self.hub.subscribe()
        try:
            while True:
                event = await sub.next()
                if event is None:
                    return
                yield event
        finally:
            self.hub.unsubscribe(sub)
