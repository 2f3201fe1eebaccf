"""Thin gRPC servicer for MetaService: unpack, name the caller, call :class:`Registry`, pack."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdserve.errors import InvalidArgument
from pdserve.grpcutil import rpc
from pdserve.identity import grpc_caller
from pdserve.services.meta.registry import Registry
from pdserve.v1 import meta_pb2, meta_pb2_grpc


class MetaServicer(meta_pb2_grpc.MetaServiceServicer):
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    @rpc
    async def Register(self, request, context):
        if not request.HasField("instance"):
            raise InvalidArgument("instance is required", param="instance")
        lease_id, ttl = await self.registry.register(
            request.instance, request.ttl_ms, grpc_caller(context)
        )
        return meta_pb2.RegisterResponse(lease_id=lease_id, ttl_ms=ttl)

    @rpc
    async def Heartbeat(self, request, context):
        load = request.load if request.HasField("load") else None
        ttl = await self.registry.heartbeat(request.lease_id, load, grpc_caller(context))
        return meta_pb2.MetaHeartbeatResponse(ttl_ms=ttl)

    @rpc
    async def Deregister(self, request, context):
        await self.registry.deregister(request.lease_id, grpc_caller(context))
        return meta_pb2.DeregisterResponse()

    @rpc
    async def ListInstances(self, request, context):
        grpc_caller(context)  # any identity of the cluster
        found, token = await self.registry.list_page(
            request.role, request.model, request.page_size, request.page_token
        )
        return meta_pb2.ListInstancesResponse(instances=found, next_page_token=token)

    @rpc
    async def WatchInstances(
        self, request, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[meta_pb2.InstanceEvent]:
        grpc_caller(context)  # any identity of the cluster
        events = await self.registry.watch(request.role, request.model, request.include_existing)
        # Headers out = subscribed: a client may list after reading them and miss nothing.
        await context.send_initial_metadata(())
        async for event in events:
            yield event
