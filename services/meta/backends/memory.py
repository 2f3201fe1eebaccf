"""The embedded in-memory backend (the default): everything lives in this process and is lost
on restart; clients re-register by themselves (see :mod:`pdserve.discovery`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.errors import NotFound
from pdserve.services.meta.backends.base import Backend
from pdserve.v1 import common_pb2, meta_pb2

JOINED = meta_pb2.INSTANCE_EVENT_JOINED
UPDATED = meta_pb2.INSTANCE_EVENT_UPDATED
LEFT = meta_pb2.INSTANCE_EVENT_LEFT

#: How often expired leases are swept (seconds): an instance disappears at most this long
#: after its TTL ran out.
SWEEP_INTERVAL_S = 0.05


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class _Lease:
    instance_id: str
    ttl_ms: int
    deadline: float  # time.monotonic() seconds


class MemoryBackend(Backend):
    def __init__(self) -> None:
        self._instances: dict[str, meta_pb2.Instance] = {}
        self._leases: dict[str, _Lease] = {}
        self._kv: dict[str, bytes] = {}
        self._watchers: set[asyncio.Queue[meta_pb2.InstanceEvent | None]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="meta-memory-sweep")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for q in self._watchers:
            q.put_nowait(None)

    def _emit(self, kind: int, instance: meta_pb2.Instance) -> None:
        event = meta_pb2.InstanceEvent(type=kind, instance=instance)
        for q in self._watchers:
            q.put_nowait(event)

    async def register(self, instance: meta_pb2.Instance, ttl_ms: int) -> tuple[str, int]:
        lease_id = uuid.uuid4().hex
        record = meta_pb2.Instance()
        record.CopyFrom(instance)
        record.lease_id = lease_id
        record.updated_ms = _now_ms()
        old = self._instances.get(record.instance_id)
        if old is not None:
            self._leases.pop(old.lease_id, None)
        self._leases[lease_id] = _Lease(
            record.instance_id, ttl_ms, time.monotonic() + ttl_ms / 1000
        )
        self._instances[record.instance_id] = record
        self._emit(UPDATED if old is not None else JOINED, record)
        return lease_id, ttl_ms

    def _lease(self, lease_id: str) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None or lease.deadline <= time.monotonic():
            raise NotFound(
                f"lease {lease_id!r} not found (expired, deregistered, or meta restarted): "
                "register again"
            )
        return lease

    async def heartbeat(self, lease_id: str, load: common_pb2.Load | None) -> int:
        lease = self._lease(lease_id)
        lease.deadline = time.monotonic() + lease.ttl_ms / 1000
        if load is not None:
            record = self._instances[lease.instance_id]
            record.load.CopyFrom(load)
            record.updated_ms = _now_ms()
            self._emit(UPDATED, record)
        return lease.ttl_ms

    async def deregister(self, lease_id: str) -> None:
        lease = self._lease(lease_id)
        self._drop(lease_id, lease)

    def _drop(self, lease_id: str, lease: _Lease) -> None:
        del self._leases[lease_id]
        record = self._instances.pop(lease.instance_id)
        self._emit(LEFT, record)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            now = time.monotonic()
            for lease_id, lease in [(k, v) for k, v in self._leases.items() if v.deadline <= now]:
                self._drop(lease_id, lease)

    async def lookup(self, lease_id: str) -> meta_pb2.Instance:
        return self._instances[self._lease(lease_id).instance_id]

    async def list(self) -> list[meta_pb2.Instance]:
        return list(self._instances.values())

    async def watch(self) -> AsyncIterator[meta_pb2.InstanceEvent]:
        q: asyncio.Queue[meta_pb2.InstanceEvent | None] = asyncio.Queue()
        self._watchers.add(q)
        return self._drain(q)

    async def _drain(
        self, q: asyncio.Queue[meta_pb2.InstanceEvent | None]
    ) -> AsyncIterator[meta_pb2.InstanceEvent]:
        try:
            while (event := await q.get()) is not None:
                yield event
        finally:
            self._watchers.discard(q)

    async def kv_get(self, key: str) -> bytes | None:
        return self._kv.get(key)

    async def kv_put(self, key: str, value: bytes) -> None:
        self._kv[key] = value

    async def kv_delete(self, key: str) -> bool:
        return self._kv.pop(key, None) is not None

    async def kv_count(self) -> int:
        return len(self._kv)

    async def kv_bytes(self) -> int:
        return sum(map(len, self._kv.values()))
