"""The meta registry's logic: input validation, TTL limits, ownership, caps, filtering,
paging, and fan-out of the backend's single change stream to any number of watchers. No
network here; unit tests drive it directly with the memory backend.

Semantics: one lease per instance. A heartbeat renews the lease; one that carries a load also
rewrites the record (``updated_ms``) and is broadcast as UPDATED. Registering an
``instance_id`` that is already live replaces the record (UPDATED) and revokes the old lease.

With TLS every call carries the caller's identity; who may do what is
:mod:`pdserve.services.meta.access` (the registering identity owns the record). Caps
(:mod:`pdserve.services.meta.caps`) bound what one record, one identity (in all, and per
role: one prefill or decode instance per worker certificate by default) and everybody together
may hold, so junk registrations cannot grow meta or its list answers without bound, nor one
worker take a second share of the requests; lists come in pages.

The registry keeps an index of the live records (role, owner, lease) for these checks: its
own registrations enter it at once, and the backend's change stream keeps it current (also
with what other meta processes sharing an etcd do; their changes arrive with the watch's
delay, so caps are approximate there). Registrations of one ``instance_id`` through this meta
run one at a time, so two identities cannot both pass the ownership check for it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import bisect
import contextlib
import json
import logging
import math
import re
from collections import Counter
from collections.abc import AsyncIterator

from pdserve.enums import ROLE
from pdserve.errors import InvalidArgument, ResourceExhausted, Unavailable
from pdserve.identity import Identity
from pdserve.services.meta import access
from pdserve.services.meta.backends.base import Backend
from pdserve.services.meta.caps import PAGE_BYTES, Index, Limits, Room
from pdserve.v1 import common_pb2, meta_pb2

log = logging.getLogger(__name__)

#: TTL bounds of the contract (meta.proto), in milliseconds.
TTL_MIN_MS = 500
TTL_MAX_MS = 600_000
#: ListInstances page sizes (count): the default, and the most one page holds.
DEFAULT_PAGE_SIZE = 500
MAX_PAGE_SIZE = 1000
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
_MAX_MODEL = 256
_MAX_ADDRESS = 300


def check_role(role: int, *, allow_any: bool) -> None:
    if role == common_pb2.ROLE_UNSPECIFIED and allow_any:
        return
    if role not in ROLE.specified:
        raise InvalidArgument(
            f"unknown role {role}; expected one of "
            f"{', '.join(ROLE.proto_names[r] for r in ROLE.specified)}"
            + (" (or ROLE_UNSPECIFIED for all)" if allow_any else "")
        )


def check_address(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not address:
        raise InvalidArgument("instance.address is required (host:port)")
    if len(address) > _MAX_ADDRESS:
        raise InvalidArgument(f"instance.address is longer than {_MAX_ADDRESS} characters")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"instance.address {address!r} is not host:port (port 1..65535)")


def check_load(load: common_pb2.Load) -> None:
    if not (math.isfinite(load.kv_usage) and 0.0 <= load.kv_usage <= 1.0):
        raise InvalidArgument(f"load.kv_usage must be within 0..1, got {load.kv_usage}")


def check_instance(inst: meta_pb2.Instance, limits: Limits | None = None) -> None:
    limits = limits or Limits()
    if not _ID_RE.match(inst.instance_id):
        raise InvalidArgument(
            f"instance.instance_id {inst.instance_id!r} must be 1..128 characters of "
            "letters, digits and ._:@- (starting with a letter or digit)"
        )
    check_role(inst.role, allow_any=False)
    check_address(inst.address)
    if len(inst.model) > _MAX_MODEL:
        raise InvalidArgument(f"instance.model is longer than {_MAX_MODEL} characters")
    if len(inst.labels) > limits.max_labels:
        raise ResourceExhausted(
            f"instance.labels has {len(inst.labels)} entries; max_labels is {limits.max_labels}"
        )
    most = limits.max_label_bytes
    for k, v in inst.labels.items():
        if not k or len(k.encode()) > most or len(v.encode()) > most:
            raise ResourceExhausted(
                f"label {k[:40]!r}: keys must be 1..{most} bytes and values <= {most} bytes "
                "(max_label_bytes)"
            )
    check_load(inst.load)
    size = inst.ByteSize()
    if size > limits.max_record_bytes:
        raise ResourceExhausted(
            f"instance is {size} bytes serialized; max_record_bytes is {limits.max_record_bytes}"
        )


def matches(inst: meta_pb2.Instance, role: int, model: str) -> bool:
    return (role == common_pb2.ROLE_UNSPECIFIED or inst.role == role) and (
        not model or inst.model == model
    )


def page_token(after: str, role: int, model: str) -> str:
    """The opaque token of the page after instance id ``after`` for this filter."""
    raw = json.dumps([after, role, model], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def parse_page_token(token: str, role: int, model: str) -> str:
    """The instance id a page token continues after; INVALID_ARGUMENT for a token meta did
    not issue or one issued for another filter."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        after, t_role, t_model = json.loads(raw)
        if not (isinstance(after, str) and isinstance(t_role, int) and isinstance(t_model, str)):
            raise ValueError("wrong types")
    except (ValueError, TypeError, binascii.Error, RecursionError):
        raise InvalidArgument(
            f"page_token {token[:40]!r} is not one meta issued: pass next_page_token unchanged"
        ) from None
    if (t_role, t_model) != (role, model):
        raise InvalidArgument(
            "page_token belongs to a listing with another role or model: keep the filter, "
            "or start again without a page_token"
        )
    return after


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
    """Validates and authorizes requests, enforces the caps, and delegates storage to a
    :class:`Backend`. ``caller`` arguments are the peer's TLS identity (None without TLS)."""

    def __init__(
        self,
        backend: Backend,
        *,
        min_ttl_ms: int = TTL_MIN_MS,
        max_ttl_ms: int = TTL_MAX_MS,
        watch_queue_limit: int = 10_000,
        limits: Limits | None = None,
    ) -> None:
        limits = limits or Limits()
        if not TTL_MIN_MS <= min_ttl_ms <= max_ttl_ms <= TTL_MAX_MS:
            raise ValueError(
                f"TTL limits must satisfy {TTL_MIN_MS} <= min_ttl_ms <= max_ttl_ms <= {TTL_MAX_MS}"
            )
        limits.validate()
        self.backend = backend
        self.min_ttl_ms, self.max_ttl_ms = min_ttl_ms, max_ttl_ms
        self.limits = limits
        self._limit = watch_queue_limit
        self._subs: set[_Subscriber] = set()
        self._index = Index()
        self._room = Room(self._index, limits)
        self._id_locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self._pump: asyncio.Task[None] | None = None
        self.heartbeats = 0

    # lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.backend.start()
        events = await self.backend.watch()
        self._index.reset(await self.backend.list())
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
                self._index.reset(await self.backend.list())

    def _apply(self, event: meta_pb2.InstanceEvent) -> None:
        if event.type == meta_pb2.INSTANCE_EVENT_LEFT:
            self._index.drop(event.instance)
        else:
            self._index.put(event.instance)
        for sub in list(self._subs):
            sub.offer(event)

    # stats ---------------------------------------------------------------------------------
    def count_by_role(self) -> Counter[int]:
        return Counter(e.role for e in self._index.by_id.values())

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

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, instance_id: str) -> AsyncIterator[None]:
        lock, users = self._id_locks.setdefault(instance_id, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._id_locks[instance_id]

    async def register(
        self, instance: meta_pb2.Instance, ttl_ms: int, caller: Identity | None = None
    ) -> tuple[str, int]:
        """Validates, authorizes and stores ``instance`` (owned by ``caller``); returns
        ``(lease_id, granted_ttl_ms)``."""
        check_instance(instance, self.limits)
        self._check_ttl(ttl_ms)
        record = meta_pb2.Instance()
        record.CopyFrom(instance)
        record.owner = access.owner_of(caller)
        async with self._one_at_a_time(record.instance_id):
            current = self._index.by_id.get(record.instance_id)
            access.check_register(caller, record, current.owner if current else None)
            with self._room.hold(record, current, access.bounded(caller, record.role)):
                lease_id, ttl = await self.backend.register(record, ttl_ms)
            record.lease_id = lease_id
            self._index.put(record)
        return lease_id, ttl

    async def _check_lease(self, lease_id: str, caller: Identity | None, action: str) -> None:
        if not lease_id:
            raise InvalidArgument("lease_id is required")
        if caller is None:
            return
        instance_id = self._index.by_lease.get(lease_id)
        if instance_id is not None:
            owner = self._index.by_id[instance_id].owner
        else:  # not seen yet (another meta registered it): ask the store
            record = await self.backend.lookup(lease_id)
            instance_id, owner = record.instance_id, record.owner
        access.check_owner(caller, owner, f"{action} instance {instance_id!r}")

    async def heartbeat(
        self, lease_id: str, load: common_pb2.Load | None, caller: Identity | None = None
    ) -> int:
        if load is not None:
            check_load(load)
        await self._check_lease(lease_id, caller, "heartbeat")
        ttl = await self.backend.heartbeat(lease_id, load)
        self.heartbeats += 1
        return ttl

    async def deregister(self, lease_id: str, caller: Identity | None = None) -> None:
        await self._check_lease(lease_id, caller, "deregister")
        await self.backend.deregister(lease_id)
        instance_id = self._index.by_lease.get(lease_id)
        if instance_id is not None:  # gone now: its room is free at once
            self._index.drop(meta_pb2.Instance(instance_id=instance_id, lease_id=lease_id))

    async def list(self, role: int = 0, model: str = "") -> list[meta_pb2.Instance]:
        """Every live instance matching the filter, sorted by id."""
        check_role(role, allow_any=True)
        found = [i for i in await self.backend.list() if matches(i, role, model)]
        return sorted(found, key=lambda i: i.instance_id)

    async def list_page(
        self, role: int = 0, model: str = "", page_size: int = 0, token: str = ""
    ) -> tuple[list[meta_pb2.Instance], str]:
        """One page of :meth:`list`: at most ``page_size`` instances (0 = the default; capped
        at MAX_PAGE_SIZE) and at most PAGE_BYTES (at least one instance), after the one
        ``token`` names; returns them and the next page's token ("" = no more)."""
        check_role(role, allow_any=True)
        after = parse_page_token(token, role, model) if token else ""
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        found = await self.list(role, model)
        start = bisect.bisect_right([i.instance_id for i in found], after) if after else 0
        page: list[meta_pb2.Instance] = []
        used = 0
        for inst in found[start : start + size]:
            used += inst.ByteSize() + 8  # + field tag and length
            if page and used > PAGE_BYTES:
                break
            page.append(inst)
        more = start + len(page) < len(found)
        return page, page_token(page[-1].instance_id, role, model) if more else ""

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
