"""The meta client every service uses.

- :class:`MetaClient`: register under a TTL lease and keep it alive in the background
  (heartbeat every ttl/3 carrying the load a callback reports, and at once when the load
  provider signals a change through an ``asyncio.Event``). When meta answers NOT_FOUND for
  the lease (meta restarted with the memory backend, or the lease expired while meta was
  unreachable) the client registers again by itself.
- :class:`Discovery`: a local cache of instances (optionally one role/model) kept current by a
  reconnecting WatchInstances stream; while the stream is down it falls back to periodic lists.

Lists follow ListInstances' pages to the end (:func:`list_all`). With TLS configured
(:func:`pdserve.identity.configure`) the channels present this process's certificate, and meta
lets only that identity renew or remove what it registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc

from pdserve import grpcutil
from pdserve.v1 import common_pb2, meta_pb2, meta_pb2_grpc

log = logging.getLogger(__name__)

#: Default lease TTL a service asks for (ms).
DEFAULT_TTL_MS = 6_000
_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

LoadFn = Callable[[], common_pb2.Load]


async def list_all(
    stub: meta_pb2_grpc.MetaServiceStub, role: int = 0, model: str = "", *, timeout: float
) -> list[meta_pb2.Instance]:
    """Every instance matching the filter, page after page (``timeout`` per page)."""
    found: list[meta_pb2.Instance] = []
    request = meta_pb2.ListInstancesRequest(role=role, model=model)
    while True:
        resp = await stub.ListInstances(request, timeout=timeout)
        found.extend(resp.instances)
        if not resp.next_page_token:
            return found
        request.page_token = resp.next_page_token


class MetaClient:
    """One instance's registration with meta, plus plain list calls."""

    def __init__(self, address: str, *, call_timeout_s: float = 3.0) -> None:
        self.address = address
        self._channel = grpcutil.channel(address, role="meta")
        self._stub = meta_pb2_grpc.MetaServiceStub(self._channel)
        self._timeout = call_timeout_s
        self._instance: meta_pb2.Instance | None = None
        self._ttl_ms = DEFAULT_TTL_MS
        self._load_fn: LoadFn | None = None
        self._load_changed: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.lease_id = ""
        #: Times the client registered (1 after :meth:`register`; more after meta restarts).
        self.registrations = 0

    async def register(
        self,
        instance: meta_pb2.Instance,
        ttl_ms: int = DEFAULT_TTL_MS,
        load_fn: LoadFn | None = None,
        load_changed: asyncio.Event | None = None,
    ) -> str:
        """Registers (errors such as INVALID_ARGUMENT raise here as ``grpc.aio.AioRpcError``) and
        starts the background keepalive; returns the lease id. The load provider sets
        ``load_changed`` whenever ``load_fn``'s answer may have changed (the client clears it)."""
        if self._task is not None:
            raise RuntimeError("this MetaClient already registered an instance")
        self._instance, self._ttl_ms, self._load_fn = instance, ttl_ms, load_fn
        self._load_changed = load_changed
        await self._register()
        self._task = asyncio.create_task(
            self._keepalive(), name=f"meta-keepalive-{instance.instance_id}"
        )
        return self.lease_id

    async def _register(self) -> None:
        assert self._instance is not None
        inst = meta_pb2.Instance()
        inst.CopyFrom(self._instance)
        if self._load_fn is not None:
            inst.load.CopyFrom(self._load_fn())
        resp = await self._stub.Register(
            meta_pb2.RegisterRequest(instance=inst, ttl_ms=self._ttl_ms), timeout=self._timeout
        )
        self.lease_id, self._ttl_ms = resp.lease_id, resp.ttl_ms
        self.registrations += 1

    async def _wait(self, until: float, wake_on_load: bool) -> None:
        """Sleeps until monotonic time ``until``, or (``wake_on_load``) until the load
        provider signals a change, whichever comes first."""
        timeout = max(0.0, until - time.monotonic())
        event = self._load_changed
        if event is None or not wake_on_load:
            await asyncio.sleep(timeout)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await event.wait()
        event.clear()  # before reading the load: a later change sets it again

    async def _keepalive(self) -> None:
        """Heartbeats every ttl/3, and also as soon as the load provider signals a change and
        the load differs from the last one sent, so routers see a worker go busy or idle
        within milliseconds instead of acting on a load up to ttl/3 old. While meta fails,
        retries back off instead."""
        interval = self._ttl_ms / 3000
        delay, backoff = interval, 0.1
        last_load: common_pb2.Load | None = None
        healthy = True
        next_beat = time.monotonic() + delay
        while True:
            await self._wait(next_beat, wake_on_load=healthy)
            load = self._load_fn() if self._load_fn is not None else None
            changed = healthy and load is not None and load != last_load
            if not changed and time.monotonic() < next_beat:
                continue
            interval = self._ttl_ms / 3000
            try:
                req = meta_pb2.MetaHeartbeatRequest(lease_id=self.lease_id)
                if load is not None:
                    req.load.CopyFrom(load)
                await self._stub.Heartbeat(req, timeout=min(self._timeout, interval))
                last_load, healthy = load, True
                delay, backoff = interval, 0.1
            except grpc.aio.AioRpcError as exc:
                healthy = False
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning(
                        "meta lost lease %s (%s); registering again", self.lease_id, exc.details()
                    )
                    try:
                        await self._register()
                        last_load, healthy = None, True
                        delay, backoff = interval, 0.1
                        next_beat = time.monotonic() + delay
                        continue
                    except grpc.aio.AioRpcError as exc2:
                        exc = exc2
                if exc.code() not in (*_RETRY_CODES, grpc.StatusCode.NOT_FOUND):
                    log.error("heartbeat to meta failed: %s %s", exc.code().name, exc.details())
                delay, backoff = min(backoff, interval), backoff * 2
            next_beat = time.monotonic() + delay

    async def _stop_keepalive(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def deregister(self) -> None:
        """Stops the keepalive and removes the registration (best effort if meta is down)."""
        await self._stop_keepalive()
        if self.lease_id:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._stub.Deregister(
                    meta_pb2.DeregisterRequest(lease_id=self.lease_id), timeout=self._timeout
                )
            self.lease_id = ""

    async def list(self, role: int = 0, model: str = "") -> list[meta_pb2.Instance]:
        """Every registered instance matching the filter (all pages)."""
        return await list_all(self._stub, role, model, timeout=self._timeout)

    async def close(self) -> None:
        """Stops the keepalive without deregistering (the lease then expires) and closes."""
        await self._stop_keepalive()
        await self._channel.close()


async def register_service(
    meta: str,
    instance: meta_pb2.Instance,
    *,
    ttl_ms: int = DEFAULT_TTL_MS,
    load_fn: LoadFn | None = None,
    load_changed: asyncio.Event | None = None,
) -> MetaClient | None:
    """Registers ``instance`` with the meta service at ``meta`` and keeps it alive (see
    :meth:`MetaClient.register`); returns None (and does nothing) when ``meta`` is empty.
    Pair with :func:`leave`."""
    if not meta:
        return None
    client = MetaClient(meta)
    try:
        await client.register(instance, ttl_ms, load_fn, load_changed)
    except BaseException:
        await client.close()
        raise
    return client


async def leave(client: MetaClient | None) -> None:
    """Deregisters and closes a client from :func:`register_service` (None is a no-op)."""
    if client is not None:
        await client.deregister()
        await client.close()


class Discovery:
    """A local, watch-updated view of the instances matching ``role`` / ``model``."""

    def __init__(
        self,
        address: str,
        role: int = 0,
        model: str = "",
        *,
        poll_interval_s: float = 2.0,
        vanish_grace_s: float = 10.0,
    ) -> None:
        self.address, self.role, self.model = address, role, model
        #: An instance missing from a list (not removed by a LEFT event) stays this long: a
        #: restarted meta lists nobody until the instances re-register (within a heartbeat or
        #: two), and they must not drop out of everyone's view meanwhile.
        self._vanish_grace_s = vanish_grace_s
        self._vanished: dict[str, float] = {}  # instance id -> when it is dropped
        self._channel = grpcutil.channel(address, role="meta")
        self._stub = meta_pb2_grpc.MetaServiceStub(self._channel)
        self._poll = poll_interval_s
        self._cache: dict[str, meta_pb2.Instance] = {}
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        #: True while the watch stream is connected.
        self.watching = False

    def instances(self) -> list[meta_pb2.Instance]:
        """The cached instances, sorted by id (no network)."""
        now = time.monotonic()
        for iid, until in list(self._vanished.items()):
            if now >= until:
                del self._vanished[iid]
                self._cache.pop(iid, None)
        return sorted(self._cache.values(), key=lambda i: i.instance_id)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="meta-discovery")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._channel.close()

    async def wait_for(
        self, predicate: Callable[[list[meta_pb2.Instance]], bool], timeout: float
    ) -> list[meta_pb2.Instance]:
        """Waits until ``predicate(instances())`` holds; raises TimeoutError. Checked at every
        change and every 0.2 s (an instance past its vanish grace drops out without one)."""
        async with asyncio.timeout(timeout):
            while not predicate(self.instances()):
                await self.next_change(0.2)
        return self.instances()

    async def next_change(self, timeout: float) -> None:
        """Returns at the cache's next change (a watch event or a relist), or after
        ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _relist(self) -> None:
        found = await list_all(self._stub, self.role, self.model, timeout=self._poll)
        fresh = {i.instance_id: i for i in found}
        now = time.monotonic()
        for iid, inst in self._cache.items():
            if iid not in fresh:  # gone from the list: kept for the grace, then dropped
                until = self._vanished.setdefault(iid, now + self._vanish_grace_s)
                if now < until:
                    fresh[iid] = inst
        for iid in found:
            self._vanished.pop(iid.instance_id, None)
        self._cache = fresh
        await self._notify()

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            call = self._stub.WatchInstances(
                meta_pb2.WatchInstancesRequest(role=self.role, model=self.model)
            )
            try:
                await call.initial_metadata()  # subscribed server-side: list, then apply events
                await self._relist()
                self.watching, backoff = True, 0.1
                async for event in call:
                    iid = event.instance.instance_id
                    self._vanished.pop(iid, None)
                    if event.type == meta_pb2.INSTANCE_EVENT_LEFT:
                        self._cache.pop(iid, None)
                    else:
                        self._cache[iid] = event.instance
                    await self._notify()
            except grpc.aio.AioRpcError as exc:
                log.info("meta watch interrupted (%s); reconnecting", exc.code().name)
            finally:
                self.watching = False
                call.cancel()
            # Fallback while the stream is down: poll the list.
            deadline = time.monotonic() + backoff
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._relist()
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            backoff = min(backoff * 2, self._poll)
