"""A KV store storage node's memory and data servers: :class:`KVNode` owns the segments,
serves them on the data plane (shm / tcp / mooncake) and keeps each segment's data key
(:mod:`pdserve.store.grants`), with which the tcp server checks every request range's grant;
until the first mount answer it refuses them all. The process around it (gRPC, mount,
heartbeats) is :mod:`.serve`."""

from __future__ import annotations

import logging
from pathlib import Path

from pdserve.identity import advertised
from pdserve.services.kvstore.node.config import NodeConfig
from pdserve.store.segment import SegmentMemory, host_id, shm_name
from pdserve.store.transports.base import TransportServer
from pdserve.v1 import kvstore_pb2

log = logging.getLogger(__name__)


def _make_server(name: str, cfg: NodeConfig) -> TransportServer:
    if name == "shm":
        from pdserve.store.transports.shm import ShmServer

        return ShmServer()
    if name == "tcp":
        from pdserve.store.transports.tcp_server import TcpServer

        # the endpoint holds the address other hosts dial: the advertised one
        host = advertised(cfg, 0).rsplit(":", 1)[0]
        return TcpServer(
            cfg.host,
            cfg.tcp_port,
            cfg.grant_clock_skew_ms,
            cfg.idle_timeout_s,
            host,
            max_connections_per_peer=cfg.max_connections_per_peer,
            handshake_timeout_s=cfg.handshake_timeout_s,
            follow_cpu=cfg.tcp_follow_cpu,
        )
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
        # segment id -> its data key from the last mount answer (b"" = data tokens off);
        # a segment not mounted yet has none.
        self.data_keys: dict[str, bytes] = {}
        #: Bytes copied into this node's segments for re-replication (CopyReplica).
        self.bytes_copied = 0
        #: Bytes moved between this node's own tiers (CopyReplica, memory <-> disk).
        self.bytes_moved = 0

    def start(self) -> None:
        for i, size in enumerate(self.cfg.segment_bytes()):
            self._add(f"{self.cfg.node_id}-seg{i}", size, prefault=self.cfg.prefault)
        disk = self.cfg.disk_bytes()
        if disk:
            directory = Path(self.cfg.disk_path)
            directory.mkdir(parents=True, exist_ok=True)
            self._add(f"{self.cfg.node_id}-disk0", disk, directory=directory)
        memory = [s for s in self.segments if not s.on_disk]
        for name in self.cfg.transports:
            server = _make_server(name, self.cfg)
            # shm maps /dev/shm files and mooncake registers memory: a disk segment is tcp's
            server.start(self.segments if name == "tcp" else memory)
            self.servers.append(server)

    def _add(self, seg_id: str, size: int, **kw: object) -> None:
        seg = SegmentMemory.create(seg_id, shm_name(seg_id), size, **kw)  # type: ignore[arg-type]
        if seg.reused:
            log.warning("segment %s: kept the bytes a previous run left", seg_id)
            self.kept.add(seg_id)
        self.segments.append(seg)

    def segment(self, segment_id: str) -> SegmentMemory | None:
        return next((s for s in self.segments if s.segment_id == segment_id), None)

    def set_data_key(self, segment_id: str, key: bytes) -> None:
        """The master's answer to a mount: the key ``segment_id``'s grants are checked with."""
        self.data_keys[segment_id] = key
        for server in self.servers:
            server.set_data_key(segment_id, key)

    def segment_proto(self, seg: SegmentMemory) -> kvstore_pb2.Segment:
        tier = kvstore_pb2.STORAGE_TIER_DISK if seg.on_disk else kvstore_pb2.STORAGE_TIER_MEMORY
        return kvstore_pb2.Segment(
            segment_id=seg.segment_id,
            node_id=self.cfg.node_id,
            size=seg.size,
            endpoints=[
                s.endpoint(seg, self.host_id)
                for s in self.servers
                if not seg.on_disk or s.name == "tcp"
            ],
            tier=tier,
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
