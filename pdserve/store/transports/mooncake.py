"""Mooncake Transfer Engine transport (TCP here, RDMA where the hardware has it).

The node registers each segment's mapping with its own ``TransferEngine`` started in
``P2PHANDSHAKE`` metadata mode (no metadata server: the session id is ``host:rpc_port``) and
advertises ``(session id, base address)``. The client has its own engine and a registered
staging buffer; it moves bytes with ``transfer_sync_read`` / ``transfer_sync_write`` and
copies between the staging buffer and the caller's memory. Only importable where the
``mooncake`` package is installed; :func:`available` says whether it is.

Trust: none per request. Mooncake's transfer engine reads and writes registered memory
directly (RDMA, or its own TCP handshake and data path): no pdserve code runs on the node
for a transfer, so the node cannot check the data-plane grants the tcp transport checks
(:mod:`pdserve.store.grants`). Anyone who can reach the engine's port and knows a segment's
advertised base address (it travels in every Replica) can read or write the whole
registered segment. What holds: only what the node registered (its segments) is exposed, and
the master still hands out locations only to callers it authorizes. Serve mooncake only on
a network where every peer is trusted (a private RDMA fabric), and tcp with tokens elsewhere.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import numpy as np

from pdserve.store.segment import SegmentMemory
from pdserve.store.transports.base import (
    Transport,
    TransportError,
    TransportServer,
    check_range,
    check_write,
)
from pdserve.v1 import kvstore_pb2


def available() -> bool:
    """True when ``mooncake.engine`` imports on this machine."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


def _engine(host: str):
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransportError(f"mooncake transport unavailable: {exc}") from exc
    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise TransportError(f"Mooncake TransferEngine.initialize failed with code {rc}")
    return engine


class MooncakeServer(TransportServer):
    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.engine = None
        self.session = ""
        self._addresses: dict[str, int] = {}

    def start(self, segments: Sequence[SegmentMemory]) -> None:
        self.engine = _engine(self.host)
        self.session = f"{self.host}:{self.engine.get_rpc_port()}"
        for seg in segments:
            addr = seg.address
            rc = self.engine.register_memory(addr, seg.size)
            if rc != 0:
                raise TransportError(f"register_memory of segment {seg.segment_id} failed: {rc}")
            self._addresses[seg.segment_id] = addr

    def endpoint(self, segment: SegmentMemory, host_id: str) -> kvstore_pb2.Endpoint:
        return kvstore_pb2.Endpoint(
            transport=kvstore_pb2.TRANSPORT_MOONCAKE,
            address=self.session,
            host_id=host_id,
            remote_base=self._addresses[segment.segment_id],
        )

    def stop(self) -> None:
        if self.engine is not None:
            for addr in self._addresses.values():
                self.engine.unregister_memory(addr)
            self._addresses.clear()
            self.engine = None


class MooncakeTransport(Transport):
    name = "mooncake"
    kind = kvstore_pb2.TRANSPORT_MOONCAKE

    def __init__(self, host: str = "127.0.0.1", staging_bytes: int = 16 * 1024 * 1024) -> None:
        self.host = host
        self._engine = None
        self._staging: np.ndarray | None = None
        self._staging_bytes = staging_bytes
        self._lock = threading.Lock()

    def _ready(self, need: int) -> np.ndarray:
        """Engine and a registered staging buffer of at least ``need`` bytes (lock held)."""
        if self._engine is None:
            self._engine = _engine(self.host)
        if self._staging is None or len(self._staging) < need:
            if self._staging is not None:
                self._engine.unregister_memory(self._staging.ctypes.data)
            size = max(need, self._staging_bytes)
            staging = np.empty(size, dtype=np.uint8)
            rc = self._engine.register_memory(staging.ctypes.data, size)
            if rc != 0:
                raise TransportError(f"register_memory of the staging buffer failed: {rc}")
            self._staging = staging
        return self._staging

    def _target(self, replica: kvstore_pb2.Replica) -> tuple[str, int]:
        ep = self.endpoint(replica)
        if ep is None or not ep.address:
            raise TransportError("replica has no mooncake endpoint")
        return ep.address, ep.remote_base + replica.offset

    def write(self, replica: kvstore_pb2.Replica, data: memoryview) -> None:
        check_write(replica, len(data))
        session, remote = self._target(replica)
        with self._lock:
            staging = self._ready(replica.size)
            staging[: replica.size] = np.frombuffer(data, dtype=np.uint8)
            rc = self._engine.transfer_sync_write(
                session, staging.ctypes.data, remote, replica.size
            )
        if rc != 0:
            raise TransportError(f"mooncake write to {session} failed with code {rc}")

    def read_into(self, replica: kvstore_pb2.Replica, buf: memoryview) -> None:
        check_range(replica, len(buf), "mooncake read")
        session, remote = self._target(replica)
        with self._lock:
            staging = self._ready(replica.size)
            rc = self._engine.transfer_sync_read(session, staging.ctypes.data, remote, replica.size)
            if rc != 0:
                raise TransportError(f"mooncake read from {session} failed with code {rc}")
            np.frombuffer(buf, dtype=np.uint8, count=replica.size)[:] = staging[: replica.size]

    def close(self) -> None:
        with self._lock:
            if self._engine is not None and self._staging is not None:
                self._engine.unregister_memory(self._staging.ctypes.data)
            self._staging = None
            self._engine = None
