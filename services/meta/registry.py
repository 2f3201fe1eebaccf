"""The meta registry's logic: input validation, TTL limits, filtering, and fan-out of the
backend's single change stream to any number of watchers. No network here; unit tests drive
it directly with the memory backend.

Semantics: one lease per instance. A heartbeat renews the lease; one that carries a load also
rewrites the record (``updated_ms``) and is broadcast as UPDATED. Registering an
``instance_id`` that is already live replaces the record (UPDATED) and revokes the old lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
from collections import Counter
from collections.abc import AsyncIterator

from pdserve.errors import InvalidArgument, ResourceExhausted, Unavailable
from pdserve.services.meta.backends.base import Backend
from pdserve.v1 import common_pb2, meta_pb2

log = logging.getLogger(__name__)

#: TTL bounds of the contract (meta.proto), in milliseconds.
TTL_MIN_MS = 500
TTL_MAX_MS = 600_000
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
_MAX_MODEL = 256
_MAX_LABELS = 64
_MAX_LABEL_CHARS = 256
ROLE_NAMES = {v.number: v.name for v in common_pb2.Role.DESCRIPTOR.values if v.number != 0}


def check_role(role: int, *, allow_any: bool) -> None:
    if role == common_pb2.ROLE_UNSPECIFIED and allow_any:
        return
    if role not in ROLE_NAMES:
        raise InvalidArgument(
            f"unknown role {role}; expected one of {', '.join(ROLE_NAMES.values())}"
            + (" (or ROLE_UNSPECIFIED for all)" if allow_any else "")
        )


def check_address(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not address:
        raise InvalidArgument("instance.address is required (host:port)")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"instance.address {address!r} is not host:port (port 1..65535)")


def check_load(load: common_pb2.Load) -> None:
    if not (math.isfinite(load.kv_usage) and 0.0 <= load.kv_usage <= 1.0):
        raise InvalidArgument(f"load.kv_usage must be within 0..1, got {load.kv_usage}")


def check_instance(inst: meta_pb2.Instance) -> None:
    if not _ID_RE.match(inst.instance_id):
        raise InvalidArgument(
            f"instance.instance_id {inst.instance_id!r} must be 1..128 characters of "
            "letters, digits and ._:@- (starting with a letter or digit)"
        )
    check_role(inst.role, allow_any=False)
    check_address(inst.address)
    if len(inst.model) > _MAX_MODEL:
        raise InvalidArgument(f"instance.model is longer than {_MAX_MODEL} characters")
    if len(inst.labels) > _MAX_LABELS:
        raise InvalidArgument(f"instance.labels has {len(inst.labels)} entries; max {_MAX_LABELS}")
    for k, v in inst.labels.items():
        if not k or len(k) > _MAX_LABEL_CHARS or len(v) > _MAX_LABEL_CHARS:
            raise InvalidArgument(
                f"label {k[:40]!r}: keys must be 1..{_MAX_LABEL_CHARS} and values "
                f"<= {_MAX_LABEL_CHARS} characters"
            )
    check_load(inst.load)


def matches(inst: meta_pb2.Instance, role: int, model: str) -> bool:
    return (role == common_pb2.ROLE_UNSPECIFIED or inst.role == role) and (
        not model or inst.model == model
    )


class _Subscriber:
    def __init__(self, role: int, model: str, limit: int) -> None:
        self.role, self.model, self.limit = role, model, limit
        self.queue: asyncio.Queue[meta_pb2.InstanceEvent | BaseException] = asyncio.Queue()
        self.failed = False

    def offer(self, event: meta_pb2.InstanceEvent) -> None:
        if self.failed or not matches(event.instance, self.role, self.model):
            return
        if self.queue.qsize() >= self.limit:
            self.fail(
                ResourceExhausted(
                    f"watcher fell behind by more than {self.limit} events; list and watch again"
                )
            )
            return
        self.queue.put_nowait(event)

    def fail(self, exc: BaseException) -> None:
        if not self.failed:
            self.failed = True
            self.queue.put_nowait(exc)


class Registry:
    """Validates requests and delegates storage to a :class:`Backend`."""

    def __init__(
        self,
        backend: Backend,
        *,
        min_ttl_ms: int = TTL_MIN_MS,
        max_ttl_ms: int = TTL_MAX_MS,
        watch_queue_limit: int = 10_000,
    ) -> None:
        if not TTL_MIN_MS <= min_ttl_ms <= max_ttl_ms <= TTL_MAX_MS:
            raise ValueError(
                f"TTL limits must satisfy {TTL_MIN_MS} <= min_ttl_ms <= max_ttl_ms <= {TTL_MAX_MS}"
            )
        self.backend = backend
        self.min_ttl_ms, self.max_ttl_ms = min_ttl_ms, max_ttl_ms
        self._limit = watch_queue_limit
        self._subs: set[_Subscriber] = set()
        self._roles: dict[str, int] = {}  # instance id -> role, kept by the pump
        self._pump: asyncio.Task[None] | None = None
        self.heartbeats = 0

    # lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.backend.start()
        events = await self.backend.watch()
        self._roles = {i.instance_id: i.role for i in await self.backend.list()}
        self._pump = asyncio.create_task(self._run_pump(events), name="meta-registry-pump")

    async def close(self) -> None:
        for sub in list(self._subs):
            sub.fail(Unavailable("meta is shutting down"))
        await self.backend.close()
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump

    async def _run_pump(self, events: AsyncIterator[meta_pb2.InstanceEvent]) -> None:
        while True:
            try:
                async for event in events:
                    self._apply(event)
                return  # backend closed
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("backend watch failed (%s); restarting it", exc)
                for sub in list(self._subs):
                    sub.fail(Unavailable(f"meta lost its backend watch: {exc}"))
            await asyncio.sleep(0.5)
            with contextlib.suppress(Exception):
                events = await self.backend.watch()
                self._roles = {i.instance_id: i.role for i in await self.backend.list()}

    def _apply(self, event: meta_pb2.InstanceEvent) -> None:
        if event.type == meta_pb2.INSTANCE_EVENT_LEFT:
            self._roles.pop(event.instance.instance_id, None)
        else:
            self._roles[event.instance.instance_id] = event.instance.role
        for sub in list(self._subs):
            sub.offer(event)

    # stats ---------------------------------------------------------------------------------
    def count_by_role(self) -> Counter[int]:
        return Counter(self._roles.values())

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    # operations ----------------------------------------------------------------------------
    def _check_ttl(self, ttl_ms: int) -> None:
        if ttl_ms == 0:
            raise InvalidArgument(f"ttl_ms is required ({self.min_ttl_ms}..{self.max_ttl_ms} ms)")
        if not self.min_ttl_ms <= ttl_ms <= self.max_ttl_ms:
            raise InvalidArgument(
                f"ttl_ms {ttl_ms} out of range {self.min_ttl_ms}..{self.max_ttl_ms} ms"
            )

    async def register(self, instance: meta_pb2.Instance, ttl_ms: int) -> tuple[str, int]:
        """Validates and stores ``instance``; returns ``(lease_id, granted_ttl_ms)``."""
        check_instance(instance)
        self._check_ttl(ttl_ms)
        return await self.backend.register(instance, ttl_ms)

    async def heartbeat(self, lease_id: str, load: common_pb2.Load | None) -> int:
        if not lease_id:
            raise InvalidArgument("lease_id is required")
        if load is not None:
            check_load(load)
        ttl = await self.backend.heartbeat(lease_id, load)
        self.heartbeats += 1
        return ttl

    async def deregister(self, lease_id: str) -> None:
        if not lease_id:
            raise InvalidArgument("lease_id is required")
        await self.backend.deregister(lease_id)

    async def list(self, role: int = 0, model: str = "") -> list[meta_pb2.Instance]:
        check_role(role, allow_any=True)
        found = [i for i in await self.backend.list() if matches(i, role, model)]
        return sorted(found, key=lambda i: i.instance_id)

    async def watch(
        self, role: int = 0, model: str = "", include_existing: bool = False
    ) -> AsyncIterator[meta_pb2.InstanceEvent]:
        """Subscribes now (validation errors raise here) and returns the event iterator; with
        ``include_existing`` the current instances come first as JOINED events."""
        check_role(role, allow_any=True)
        sub = _Subscriber(role, model, self._limit)
        self._subs.add(sub)
        try:
            existing = await self.list(role, model) if include_existing else []
        except BaseException:
            self._subs.discard(sub)
            raise
        return self._stream(sub, existing)

    async def _stream(
        self, sub: _Subscriber, existing: list[meta_pb2.Instance]
    ) -> AsyncIterator[meta_pb2.InstanceEvent]:
        try:
            for inst in existing:
                yield meta_pb2.InstanceEvent(type=meta_pb2.INSTANCE_EVENT_JOINED, instance=inst)
            # Events the backend emitted before the snapshot but the pump delivered after the
            # subscription describe records the snapshot already sent: skip those.
            sent = {(i.instance_id, i.lease_id, i.updated_ms) for i in existing}
            while True:
                item = await sub.queue.get()
                if isinstance(item, BaseException):
                    raise item
                key = (item.instance.instance_id, item.instance.lease_id, item.instance.updated_ms)
                if sent and item.type != meta_pb2.INSTANCE_EVENT_LEFT and key in sent:
                    sent.discard(key)
                    continue
                yield item
        finally:
            self._subs.discard(sub)
