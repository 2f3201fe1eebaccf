"""The etcd backend: state lives in a real etcd cluster, so a meta restart loses nothing.

Layout (values are JSON or plain text, never pickle):

- ``/pdserve/instances/<instance_id>``: the Instance as JSON, attached to its lease;
- ``/pdserve/leases/<lease hex>``: the instance id, attached to the same lease;
- ``/pdserve/metadata/<key>``: Mooncake HTTP metadata values (no lease).

pdserve leases are etcd leases (TTL rounded up to whole seconds, and etcd raises TTLs below
its own minimum, about 2 s with default settings); heartbeats are etcd lease keep-alives;
watch is an etcd watch on the instances prefix with ``prev_kv`` (LEFT carries the last record).

Records keep their ``owner`` in the JSON; a record stored before owners existed has none
(anyone may take it), and fields this version does not know are ignored, so old and new meta
processes read each other's records.

Connection: TLS to etcd with ``ca`` (and ``cert``/``key`` when etcd asks for client
certificates, ``--client-cert-auth``); with ``user`` the backend authenticates at start and
renews its token (etcd's simple tokens live 5 minutes): :mod:`pdserve.etcdaccess`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import grpc
from etcd3aio import EtcdError, prefix_range_end
from google.protobuf import json_format

from pdserve.errors import NotFound, Unavailable
from pdserve.etcdaccess import EtcdAccess
from pdserve.services.meta.backends.base import Backend
from pdserve.v1 import common_pb2, meta_pb2

INSTANCES = "/pdserve/instances/"
LEASES = "/pdserve/leases/"
METADATA = "/pdserve/metadata/"
#: Deadline for one etcd call (seconds).
CALL_TIMEOUT_S = 5.0
_DELETE = 1  # mvccpb.Event.EventType.DELETE

T = TypeVar("T")


def _now_ms() -> int:
    return int(time.time() * 1000)


def _decode(value: bytes) -> meta_pb2.Instance:
    return json_format.Parse(value, meta_pb2.Instance(), ignore_unknown_fields=True)


def _encode(instance: meta_pb2.Instance) -> str:
    return json_format.MessageToJson(instance, indent=None)


def _lease_not_found(lease_id: str) -> NotFound:
    return NotFound(
        f"lease {lease_id!r} not found (expired, deregistered, or never granted): register again"
    )


class EtcdBackend(Backend):
    def __init__(self, access: EtcdAccess) -> None:
        """``access``: etcd's endpoints, TLS and user (:mod:`pdserve.etcdaccess`)."""
        self._access = access
        self._endpoints = list(access.endpoints)
        self._client = access.client()
        self._token = contextlib.AsyncExitStack()  # the token refresher, with a user
        self._lease_owner: dict[int, str] = {}  # lease -> instance id (immutable once granted)
        self._closed = False

    async def _call(self, what: str, coro: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(coro, CALL_TIMEOUT_S)
        except (EtcdError, TimeoutError) as exc:
            raise Unavailable(f"etcd at {','.join(self._endpoints)} failed {what}: {exc}") from exc
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"etcd {what}: {exc.details()}") from exc
            raise Unavailable(f"etcd {what} failed: {exc.code().name} {exc.details()}") from exc

    async def start(self) -> None:
        await self._client.connect()
        try:
            await self._access.authenticate(self._client, self._token, CALL_TIMEOUT_S)
            await self._client.ping(write_check=False, timeout=CALL_TIMEOUT_S)
        except (EtcdError, TimeoutError, grpc.aio.AioRpcError) as exc:
            await self.close()
            raise Unavailable(f"cannot use etcd at {self._access.describe()}: {exc}") from exc

    async def close(self) -> None:
        self._closed = True
        await self._token.aclose()
        await self._client.close()

    @property
    def _kv(self):
        assert self._client.kv is not None, "backend not started"
        return self._client.kv

    async def register(self, instance: meta_pb2.Instance, ttl_ms: int) -> tuple[str, int]:
        assert self._client.lease is not None
        grant = await self._call(
            "lease grant", self._client.lease.grant(max(1, math.ceil(ttl_ms / 1000)))
        )
        lease_id = format(grant.ID, "x")
        record = meta_pb2.Instance()
        record.CopyFrom(instance)
        record.lease_id = lease_id
        record.updated_ms = _now_ms()
        key = INSTANCES + record.instance_id
        resp = await self._call(
            "register",
            self._kv.txn(
                [],
                [
                    self._kv.txn_op_get(key),
                    self._kv.txn_op_put(key, _encode(record), lease=grant.ID),
                    self._kv.txn_op_put(LEASES + lease_id, record.instance_id, lease=grant.ID),
                ],
            ),
        )
        self._lease_owner[grant.ID] = record.instance_id
        old = resp.responses[0].response_range.kvs
        if old:
            old_lease = int(_decode(old[0].value).lease_id or "0", 16)
            if old_lease and old_lease != grant.ID:
                self._lease_owner.pop(old_lease, None)
                with contextlib.suppress(NotFound):
                    await self._call("revoke replaced lease", self._client.lease.revoke(old_lease))
        return lease_id, grant.TTL * 1000

    @staticmethod
    def _parse(lease_id: str) -> int:
        try:
            value = int(lease_id, 16)
        except ValueError:
            raise _lease_not_found(lease_id) from None
        if not 0 < value < 2**63:
            raise _lease_not_found(lease_id)
        return value

    async def _keepalive(self, lease: int) -> int:
        assert self._client.lease is not None
        stream = self._client.lease.keep_alive(lease)
        try:
            async for response in stream:
                return response.TTL
            return 0
        finally:
            stream.cancel()

    async def _record(self, lease_id: str, lease: int) -> meta_pb2.Instance:
        """The record ``lease`` keeps (NotFound when it keeps none)."""
        instance_id = self._lease_owner.get(lease)
        if instance_id is None:
            got = await self._call("get lease owner", self._kv.get(LEASES + lease_id))
            if not got.kvs:
                raise _lease_not_found(lease_id)
            instance_id = got.kvs[0].value.decode()
            self._lease_owner[lease] = instance_id
        got = await self._call("get instance", self._kv.get(INSTANCES + instance_id))
        if not got.kvs:
            raise _lease_not_found(lease_id)
        record = _decode(got.kvs[0].value)
        if record.lease_id != lease_id:
            raise _lease_not_found(lease_id)
        return record

    async def lookup(self, lease_id: str) -> meta_pb2.Instance:
        return await self._record(lease_id, self._parse(lease_id))

    async def heartbeat(self, lease_id: str, load: common_pb2.Load | None) -> int:
        lease = self._parse(lease_id)
        ttl_s = await self._call("lease keep-alive", self._keepalive(lease))
        if ttl_s <= 0:
            raise _lease_not_found(lease_id)
        if load is not None:
            record = await self._record(lease_id, lease)
            record.load.CopyFrom(load)
            record.updated_ms = _now_ms()
            await self._call(
                "put instance",
                self._kv.put(INSTANCES + record.instance_id, _encode(record), lease=lease),
            )
        return ttl_s * 1000

    async def deregister(self, lease_id: str) -> None:
        assert self._client.lease is not None
        lease = self._parse(lease_id)
        try:
            await self._call("lease revoke", self._client.lease.revoke(lease))
        except NotFound:
            raise _lease_not_found(lease_id) from None
        self._lease_owner.pop(lease, None)

    async def list(self) -> list[meta_pb2.Instance]:
        resp = await self._call(
            "list instances", self._kv.get(INSTANCES, range_end=prefix_range_end(INSTANCES))
        )
        return [_decode(kv.value) for kv in resp.kvs]

    async def watch(self) -> AsyncIterator[meta_pb2.InstanceEvent]:
        head = await self._call(
            "read revision",
            self._kv.get(INSTANCES, range_end=prefix_range_end(INSTANCES), count_only=True),
        )
        return self._events(head.header.revision + 1)

    async def _events(self, start_revision: int) -> AsyncIterator[meta_pb2.InstanceEvent]:
        assert self._client.watch is not None
        stream = self._client.watch.watch(
            INSTANCES,
            range_end=prefix_range_end(INSTANCES),
            start_revision=start_revision,
            prev_kv=True,
        )
        try:
            async for response in stream:
                for ev in response.events:
                    if ev.type == _DELETE:
                        if not ev.prev_kv.value:
                            continue
                        kind, record = meta_pb2.INSTANCE_EVENT_LEFT, _decode(ev.prev_kv.value)
                    else:
                        kind = (
                            meta_pb2.INSTANCE_EVENT_JOINED
                            if ev.kv.version == 1
                            else meta_pb2.INSTANCE_EVENT_UPDATED
                        )
                        record = _decode(ev.kv.value)
                    yield meta_pb2.InstanceEvent(type=kind, instance=record)
        except (grpc.aio.AioRpcError, EtcdError, asyncio.CancelledError):
            if not self._closed:
                raise

    async def kv_get(self, key: str) -> bytes | None:
        resp = await self._call("metadata get", self._kv.get(METADATA + key))
        return resp.kvs[0].value if resp.kvs else None

    async def kv_put(self, key: str, value: bytes) -> None:
        await self._call("metadata put", self._kv.put(METADATA + key, value))

    async def kv_delete(self, key: str) -> bool:
        resp = await self._call("metadata delete", self._kv.delete(METADATA + key))
        return resp.deleted > 0

    async def kv_count(self) -> int:
        resp = await self._call(
            "metadata count",
            self._kv.get(METADATA, range_end=prefix_range_end(METADATA), count_only=True),
        )
        return resp.count

    async def kv_bytes(self) -> int:
        resp = await self._call(
            "metadata size", self._kv.get(METADATA, range_end=prefix_range_end(METADATA))
        )
        return sum(len(kv.value) for kv in resp.kvs)
