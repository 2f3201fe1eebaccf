"""KVNodeService: the node's gRPC face. ``Stats`` answers any identity of the cluster;
``CopyReplica`` (re-replication, :mod:`.copy`) only the master's, when mutual TLS is on."""

from __future__ import annotations

import asyncio

from pdserve import grpcutil
from pdserve.identity import grpc_caller, require
from pdserve.services.kvstore.node.copy import copy_replica
from pdserve.services.kvstore.node.node import KVNode
from pdserve.store.transports.base import Transport
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc


class NodeServicer(kvstore_pb2_grpc.KVNodeServiceServicer):
    def __init__(self, node: KVNode, tcp: Transport) -> None:
        self.node = node
        #: The data-plane client CopyReplica reads sources with.
        self.tcp = tcp

    @grpcutil.rpc
    async def Stats(self, request, context):
        return self.node.stats()

    @grpcutil.rpc
    async def CopyReplica(self, request, context):
        require(grpc_caller(context), ("master",), "ask a node to copy a replica")
        size = await asyncio.to_thread(copy_replica, self.node, request, self.tcp)
        return kvstore_pb2.CopyReplicaResponse(size=size)
