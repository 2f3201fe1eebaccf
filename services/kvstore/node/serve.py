"""The KV store storage node process: segments and data servers (:class:`~.node.KVNode`),
the KVNodeService gRPC server (:mod:`.servicer`), mount at the master, heartbeats.

The node's memory outlives master restarts: when the master answers a heartbeat with
``remount_required`` (it restarted, or declared the node dead after a pause), the node mounts
the same segment ids again; their bytes are untouched. Each mount tells the master the node's
gRPC address (for re-replication copies) and its answer carries the segment's data key. On
SIGTERM it unmounts its memory segments, stops its servers and unlinks its shared memory; its
disk segment (the tier below memory, when configured) keeps its file and stays known to the
master, dormant, so a node restarted in time serves what it held.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve import failover, grpcutil
from pdserve.discovery import leave, register_service
from pdserve.identity import advertised
from pdserve.lifecycle import announce_ready
from pdserve.services.kvstore.node.config import NodeConfig
from pdserve.services.kvstore.node.node import KVNode
from pdserve.services.kvstore.node.servicer import NodeServicer
from pdserve.store.transports.tcp_client import TcpTransport
from pdserve.telemetry import serve_metrics
from pdserve.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc, meta_pb2

__all__ = ["serve"]

log = logging.getLogger(__name__)
RPC_TIMEOUT_S = 2.0
#: How long a re-replication copy may wait on the source node's tcp server (seconds).
COPY_TIMEOUT_S = 10.0


def _export_metrics(node: KVNode) -> None:
    """Data-plane byte counters and segment capacity at /metrics (read when scraped)."""
    from prometheus_client import Gauge

    from pdserve.telemetry import REGISTRY

    for name, doc, fn in (
        (
            "pdserve_kvnode_bytes_read",
            "payload bytes served to readers since start",
            lambda: sum(s.bytes_read for s in node.servers),
        ),
        (
            "pdserve_kvnode_bytes_written",
            "payload bytes received from writers since start",
            lambda: sum(s.bytes_written for s in node.servers),
        ),
        (
            "pdserve_kvnode_bytes_copied",
            "payload bytes this node copied in from other nodes to re-replicate (CopyReplica)",
            lambda: node.bytes_copied,
        ),
        (
            "pdserve_kvnode_bytes_moved",
            "payload bytes this node copied between its own memory and disk tiers (CopyReplica)",
            lambda: node.bytes_moved,
        ),
        (
            "pdserve_kvnode_capacity_bytes",
            "bytes of memory segments this node contributes",
            lambda: sum(s.size for s in node.segments if not s.on_disk),
        ),
        (
            "pdserve_kvnode_disk_capacity_bytes",
            "bytes of the disk tier this node contributes (0 = none)",
            lambda: sum(s.size for s in node.segments if s.on_disk),
        ),
    ):
        Gauge(name, doc, registry=REGISTRY).set_function(fn)


async def _mount_all(node: KVNode, stub: kvstore_pb2_grpc.KVMasterServiceStub, address: str) -> int:
    """Mounts every segment, saying the node's gRPC ``address``; returns the heartbeat
    interval (ms) the master asked for."""
    interval = 1000
    for seg in node.segments:
        resp = await stub.MountSegment(
            kvstore_pb2.MountSegmentRequest(
                segment=node.segment_proto(seg),
                keeps_bytes=seg.segment_id in node.kept,
                node_address=address,
            ),
            timeout=RPC_TIMEOUT_S,
        )
        node.kept.add(seg.segment_id)
        node.set_data_key(seg.segment_id, resp.data_key)  # a restarted master has a new key
        interval = resp.heartbeat_interval_ms or interval
    log.info("mounted %d segment(s) at %s", len(node.segments), node.cfg.master_address)
    return interval


async def _heartbeat_loop(
    node: KVNode,
    stub: kvstore_pb2_grpc.KVMasterServiceStub,
    address: str,
    interval_ms: int,
    stop: asyncio.Event,
) -> None:
    req = kvstore_pb2.NodeHeartbeatRequest(
        node_id=node.cfg.node_id, segment_ids=[s.segment_id for s in node.segments]
    )
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), interval_ms / 1000)
            return
        except TimeoutError:
            pass
        try:
            resp = await stub.Heartbeat(req, timeout=RPC_TIMEOUT_S)
            if resp.remount_required:
                log.warning("master asked for a remount; mounting the same segments again")
                interval_ms = await _mount_all(node, stub, address)
        except grpc.aio.AioRpcError as exc:
            log.warning("heartbeat to %s failed: %s", node.cfg.master_address, exc.code().name)


async def serve(cfg: NodeConfig, stop: asyncio.Event) -> None:
    """Runs a node until ``stop`` is set: segments, data servers, mount, heartbeats."""
    node = KVNode(cfg)
    server = None
    channel = grpcutil.channel(cfg.master_address, role="master")
    tcp = TcpTransport(timeout_s=COPY_TIMEOUT_S)
    try:
        node.start()
        stub = kvstore_pb2_grpc.KVMasterServiceStub(channel)
        server = await grpcutil.start_server(
            [
                (
                    kvstore_pb2_grpc.add_KVNodeServiceServicer_to_server,
                    NodeServicer(node, tcp),
                    "pdserve.v1.KVNodeService",
                )
            ],
            f"{cfg.host}:{cfg.port}",
        )
        _export_metrics(node)
        metrics_port = serve_metrics(cfg.metrics_port, cfg.host)
        address = advertised(cfg, server.port)
        while True:
            try:
                interval = await _mount_all(node, stub, address)
                break
            except grpc.aio.AioRpcError as exc:
                # a standby binds nothing and a call with a deadline waits for a connection:
                # DEADLINE_EXCEEDED, and the failover channel moves on to the next master
                if exc.code() not in failover.FAILOVER_CODES:
                    raise
                log.warning(
                    "master %s answered %s; retrying mount",
                    cfg.master_address,
                    exc.code().name,
                )
                try:
                    await asyncio.wait_for(stop.wait(), 0.5)
                    return
                except TimeoutError:
                    pass
        tcp_port = next((s.port for s in node.servers if s.name == "tcp"), 0)  # type: ignore[attr-defined]
        announce_ready(
            "kvstore-node",
            node_id=cfg.node_id,
            port=server.port,
            tcp_port=tcp_port,
            metrics_port=metrics_port,
            segments=[s.segment_id for s in node.segments],
            shm_names=[s.name for s in node.segments],
            transports=cfg.transports,
        )
        meta_client = await register_service(
            cfg.meta,
            meta_pb2.Instance(
                instance_id=cfg.node_id,
                role=common_pb2.ROLE_KVSTORE_NODE,
                address=address,
                kv_capacity_bytes=sum(s.size for s in node.segments if not s.on_disk),
                labels={
                    "tcp": advertised(cfg, tcp_port),
                    "transports": ",".join(cfg.transports),
                    **({"metrics": advertised(cfg, metrics_port)} if metrics_port else {}),
                },
            ),
        )
        try:
            await _heartbeat_loop(node, stub, address, interval, stop)
        finally:
            await leave(meta_client)
        # A disk segment stays mounted in the master's view: it goes dormant when the
        # heartbeats stop and a node restarted within the master's dormant grace serves it again.
        for seg in (s for s in node.segments if not s.on_disk):
            try:
                await stub.UnmountSegment(
                    kvstore_pb2.UnmountSegmentRequest(segment_id=seg.segment_id),
                    timeout=RPC_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as exc:
                log.warning("unmount of %s failed: %s", seg.segment_id, exc.code().name)
    finally:
        node.stop()
        tcp.close()
        if server is not None:
            await server.stop(1.0)
        await channel.close()
