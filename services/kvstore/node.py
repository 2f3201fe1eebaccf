"""The KV store storage node: owns memory segments, mounts them at the master, heartbeats,
and serves the data plane (shm / tcp / mooncake) from the same memory.

The node's memory outlives master restarts: when the master answers a heartbeat with
``remount_required`` (it restarted, or declared the node dead after a pause), the node mounts
the same segment ids again; their bytes are untouched. Each mount answer carries the
segment's data key (:mod:`pdserve.store.grants`), with which the tcp server checks every
request range's grant; until the first answer it refuses them all. On SIGTERM it unmounts its segments,
stops its servers and unlinks its shared memory.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve import grpcutil
from pdserve.discovery import leave, register_service
from pdserve.identity import advertised
from pdserve.lifecycle import announce_ready
from pdserve.services.kvstore.node_config import NodeConfig
from pdserve.store.segment import SegmentMemory, host_id, shm_name
from pdserve.store.transports.base import TransportServer
from pdserve.telemetry import serve_metrics
from pdserve.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc, meta_pb2

__all__ = ["KVNode", "NodeConfig", "serve"]

log = logging.getLogger(__name__)
RPC_TIMEOUT_S = 2.0


def _make_server(name: str, cfg: NodeConfig) -> TransportServer:
    if name == "shm":
        from pdserve.store.transports.shm import ShmServer

        return ShmServer()
    if name == "tcp":
        from pdserve.store.transports.tcp import TcpServer

        # the endpoint holds the address other hosts dial: the advertised one
        host = advertised(cfg, 0).rsplit(":", 1)[0]
        return TcpServer(cfg.host, cfg.tcp_port, cfg.grant_clock_skew_ms, cfg.idle_timeout_s, host)
    from pdserve.store.transports.mooncake import MooncakeServer

    return MooncakeServer(cfg.host)


class KVNode:
    """Segments plus the data servers that expose them (no gRPC; see :func:`serve`)."""

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.host_id = cfg.host_id or host_id()
        self.segments: list[SegmentMemory] = []
        self.servers: list[TransportServer] = []
        # Segments whose memory holds what the master may remember (mounted before, or a
        # file a killed previous run left intact).
        self.kept: set[str] = set()

    def start(self) -> None:
        for i, size in enumerate(self.cfg.segment_bytes()):
            seg_id = f"{self.cfg.node_id}-seg{i}"
            seg = SegmentMemory.create(seg_id, shm_name(seg_id), size, prefault=self.cfg.prefault)
            if seg.reused:
                log.warning("segment %s: kept the bytes a killed previous run left", seg_id)
                self.kept.add(seg_id)
            self.segments.append(seg)
        for name in self.cfg.transports:
            server = _make_server(name, self.cfg)
            server.start(self.segments)
            self.servers.append(server)

    def segment_proto(self, seg: SegmentMemory) -> kvstore_pb2.Segment:
        return kvstore_pb2.Segment(
            segment_id=seg.segment_id,
            node_id=self.cfg.node_id,
            size=seg.size,
            endpoints=[s.endpoint(seg, self.host_id) for s in self.servers],
        )

    def stats(self) -> kvstore_pb2.NodeStatsResponse:
        return kvstore_pb2.NodeStatsResponse(
            node_id=self.cfg.node_id,
            segments=[self.segment_proto(s) for s in self.segments],
            bytes_read=sum(s.bytes_read for s in self.servers),
            bytes_written=sum(s.bytes_written for s in self.servers),
        )

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        for seg in self.segments:
            seg.unlink()


class NodeServicer(kvstore_pb2_grpc.KVNodeServiceServicer):
    def __init__(self, node: KVNode) -> None:
        self.node = node

    @grpcutil.rpc
    async def Stats(self, request, context):
        return self.node.stats()


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
            "pdserve_kvnode_capacity_bytes",
            "bytes of memory segments this node contributes",
            lambda: sum(s.size for s in node.segments),
        ),
    ):
        Gauge(name, doc, registry=REGISTRY).set_function(fn)


async def _mount_all(node: KVNode, stub: kvstore_pb2_grpc.KVMasterServiceStub) -> int:
    """Mounts every segment; returns the heartbeat interval (ms) the master asked for."""
    interval = 1000
    for seg in node.segments:
        resp = await stub.MountSegment(
            kvstore_pb2.MountSegmentRequest(
                segment=node.segment_proto(seg), keeps_bytes=seg.segment_id in node.kept
            ),
            timeout=RPC_TIMEOUT_S,
        )
        node.kept.add(seg.segment_id)
        for server in node.servers:  # a restarted master has a new key
            server.set_data_key(seg.segment_id, resp.data_key)
        interval = resp.heartbeat_interval_ms or interval
    log.info("mounted %d segment(s) at %s", len(node.segments), node.cfg.master_address)
    return interval


async def _heartbeat_loop(
    node: KVNode, stub: kvstore_pb2_grpc.KVMasterServiceStub, interval_ms: int, stop: asyncio.Event
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
                interval_ms = await _mount_all(node, stub)
        except grpc.aio.AioRpcError as exc:
            log.warning("heartbeat to %s failed: %s", node.cfg.master_address, exc.code().name)


async def serve(cfg: NodeConfig, stop: asyncio.Event) -> None:
    """Runs a node until ``stop`` is set: segments, data servers, mount, heartbeats."""
    node = KVNode(cfg)
    server = None
    channel = grpcutil.channel(cfg.master_address)
    try:
        node.start()
        stub = kvstore_pb2_grpc.KVMasterServiceStub(channel)
        server = await grpcutil.start_server(
            [
                (
                    kvstore_pb2_grpc.add_KVNodeServiceServicer_to_server,
                    NodeServicer(node),
                    "pdserve.v1.KVNodeService",
                )
            ],
            f"{cfg.host}:{cfg.port}",
        )
        _export_metrics(node)
        metrics_port = serve_metrics(cfg.metrics_port, cfg.host)
        while True:
            try:
                interval = await _mount_all(node, stub)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                log.warning("master %s unavailable; retrying mount", cfg.master_address)
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
                address=advertised(cfg, server.port),
                kv_capacity_bytes=sum(s.size for s in node.segments),
                labels={"tcp": advertised(cfg, tcp_port), "transports": ",".join(cfg.transports)},
            ),
        )
        try:
            await _heartbeat_loop(node, stub, interval, stop)
        finally:
            await leave(meta_client)
        for seg in node.segments:
            try:
                await stub.UnmountSegment(
                    kvstore_pb2.UnmountSegmentRequest(segment_id=seg.segment_id),
                    timeout=RPC_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as exc:
                log.warning("unmount of %s failed: %s", seg.segment_id, exc.code().name)
    finally:
        node.stop()
        if server is not None:
            await server.stop(1.0)
        await channel.close()
