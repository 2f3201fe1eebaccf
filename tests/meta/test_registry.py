"""Registry logic on the memory backend, no network."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.errors import InvalidArgument, NotFound, ResourceExhausted
from pdserve.services.meta.backends.memory import MemoryBackend
from pdserve.services.meta.registry import Registry
from pdserve.v1 import common_pb2, meta_pb2

JOINED, UPDATED, LEFT = (
    meta_pb2.INSTANCE_EVENT_JOINED,
    meta_pb2.INSTANCE_EVENT_UPDATED,
    meta_pb2.INSTANCE_EVENT_LEFT,
)


def inst(
    iid: str, role: int = common_pb2.ROLE_PREFILL, model: str = "m", **kw
) -> meta_pb2.Instance:
    return meta_pb2.Instance(
        instance_id=iid, role=role, address=kw.pop("address", "127.0.0.1:9000"), model=model, **kw
    )


def run(coro_fn):
    async def main():
        reg = Registry(MemoryBackend(), watch_queue_limit=kw_limit.get("limit", 10_000))
        await reg.start()
        try:
            await coro_fn(reg)
        finally:
            await reg.close()

    kw_limit: dict = getattr(coro_fn, "_kw", {})
    asyncio.run(main())


async def next_event(it, timeout: float = 2.0) -> meta_pb2.InstanceEvent:
    return await asyncio.wait_for(anext(it), timeout)


def test_register_list_filters_and_capacity() -> None:
    async def body(reg: Registry) -> None:
        lid, ttl = await reg.register(inst("p0", max_running=8, kv_capacity_bytes=1 << 30), 2000)
        assert lid and ttl == 2000
        await reg.register(inst("d0", common_pb2.ROLE_DECODE), 2000)
        await reg.register(inst("d1", common_pb2.ROLE_DECODE, model="other"), 2000)
        await reg.register(inst("r0", common_pb2.ROLE_ROUTER, model=""), 2000)
        assert [i.instance_id for i in await reg.list()] == ["d0", "d1", "p0", "r0"]
        assert [i.instance_id for i in await reg.list(common_pb2.ROLE_DECODE)] == ["d0", "d1"]
        assert [i.instance_id for i in await reg.list(common_pb2.ROLE_DECODE, "m")] == ["d0"]
        (p0,) = await reg.list(common_pb2.ROLE_PREFILL)
        assert (p0.max_running, p0.kv_capacity_bytes, p0.lease_id) == (8, 1 << 30, lid)
        assert abs(p0.updated_ms - time.time() * 1000) < 5000
        await asyncio.sleep(0.05)  # counts follow the event pump
        assert reg.count_by_role()[common_pb2.ROLE_DECODE] == 2

    run(body)


@pytest.mark.parametrize(
    ("instance", "ttl", "message"),
    [
        (inst("x", role=0), 1000, "unknown role 0"),
        (inst("x", role=42), 1000, "unknown role 42"),
        (inst("x", address=""), 1000, "instance.address is required"),
        (inst("x", address="nohostport"), 1000, "is not host:port"),
        (inst("x", address="h:70000"), 1000, "is not host:port"),
        (inst(""), 1000, "instance_id '' must be 1..128"),
        (inst("a/b"), 1000, "must be 1..128"),
        (inst("x"), 0, "ttl_ms is required"),
        (inst("x"), 499, "ttl_ms 499 out of range 500..600000"),
        (inst("x"), 4_000_000_000, "ttl_ms 4000000000 out of range"),
        (inst("x", load=common_pb2.Load(kv_usage=1.5)), 1000, "kv_usage must be within 0..1"),
    ],
)
def test_register_rejects_bad_input(instance, ttl, message) -> None:
    async def body(reg: Registry) -> None:
        with pytest.raises(InvalidArgument, match=message):
            await reg.register(instance, ttl)
        # Nothing else disturbed: a good registration still works and nothing leaked in.
        await reg.register(inst("ok"), 1000)
        assert [i.instance_id for i in await reg.list()] == ["ok"]

    run(body)


def test_heartbeat_and_deregister_errors() -> None:
    async def body(reg: Registry) -> None:
        with pytest.raises(InvalidArgument, match="lease_id is required"):
            await reg.heartbeat("", None)
        with pytest.raises(NotFound, match="lease 'nope' not found"):
            await reg.heartbeat("nope", None)
        with pytest.raises(NotFound, match="not found"):
            await reg.deregister("nope")
        with pytest.raises(InvalidArgument, match="unknown role 9"):
            await reg.list(9)
        lid, _ = await reg.register(inst("p0"), 1000)
        with pytest.raises(InvalidArgument, match="kv_usage"):
            await reg.heartbeat(lid, common_pb2.Load(kv_usage=float("nan")))
        await reg.deregister(lid)
        with pytest.raises(NotFound):
            await reg.heartbeat(lid, None)
        assert await reg.list() == []

    run(body)


def test_watch_sees_join_update_leave_and_expiry() -> None:
    async def body(reg: Registry) -> None:
        events = await reg.watch()
        lid, _ = await reg.register(inst("p0"), 600)
        ev = await next_event(events)
        assert (ev.type, ev.instance.instance_id) == (JOINED, "p0")
        await reg.heartbeat(lid, common_pb2.Load(queue_length=3, running_requests=2, kv_usage=0.5))
        ev = await next_event(events)
        assert ev.type == UPDATED
        assert (ev.instance.load.queue_length, ev.instance.load.running_requests) == (3, 2)
        assert ev.instance.load.kv_usage == pytest.approx(0.5)
        t0 = time.monotonic()  # last renewal: no more heartbeats from here
        ev = await next_event(events, timeout=3.0)
        waited = time.monotonic() - t0
        assert (ev.type, ev.instance.instance_id) == (LEFT, "p0")
        assert 0.5 <= waited <= 0.6 + 0.3, waited
        assert await reg.list() == []
        with pytest.raises(NotFound):
            await reg.heartbeat(lid, None)

    run(body)


def test_heartbeat_keeps_instance_alive() -> None:
    async def body(reg: Registry) -> None:
        lid, _ = await reg.register(inst("p0"), 500)
        for _ in range(8):  # 1.6 s, more than three TTLs
            await asyncio.sleep(0.2)
            assert await reg.heartbeat(lid, None) == 500
        assert [i.instance_id for i in await reg.list()] == ["p0"]

    run(body)


def test_reregister_replaces_and_revokes_old_lease() -> None:
    async def body(reg: Registry) -> None:
        events = await reg.watch(role=common_pb2.ROLE_PREFILL)
        old, _ = await reg.register(inst("p0"), 1000)
        new, _ = await reg.register(inst("p0", address="127.0.0.1:9001"), 1000)
        assert old != new
        assert [e.type for e in [await next_event(events), await next_event(events)]] == [
            JOINED,
            UPDATED,
        ]
        with pytest.raises(NotFound):
            await reg.heartbeat(old, None)
        (p0,) = await reg.list()
        assert (p0.address, p0.lease_id) == ("127.0.0.1:9001", new)

    run(body)


def test_watch_filters_and_include_existing() -> None:
    async def body(reg: Registry) -> None:
        await reg.register(inst("d0", common_pb2.ROLE_DECODE), 1000)
        await reg.register(inst("p0"), 1000)
        events = await reg.watch(common_pb2.ROLE_DECODE, "m", include_existing=True)
        ev = await next_event(events)
        assert (ev.type, ev.instance.instance_id) == (JOINED, "d0")
        await reg.register(inst("p1"), 1000)  # other role: filtered out
        await reg.register(inst("d1", common_pb2.ROLE_DECODE, model="x"), 1000)  # other model
        await reg.register(inst("d2", common_pb2.ROLE_DECODE), 1000)
        ev = await next_event(events)
        assert ev.instance.instance_id == "d2"
        with pytest.raises(InvalidArgument, match="unknown role 77"):
            await reg.watch(77)

    run(body)


def test_slow_watcher_is_cut_off_not_the_others() -> None:
    async def body(reg: Registry) -> None:
        slow = await reg.watch()
        for i in range(5):
            await reg.register(inst(f"p{i}"), 1000)
        await asyncio.sleep(0.05)
        seen = [(await next_event(slow)).instance.instance_id for _ in range(3)]
        assert seen == ["p0", "p1", "p2"]
        with pytest.raises(ResourceExhausted, match="fell behind by more than 3 events"):
            await next_event(slow)
        fresh = await reg.watch()
        await reg.register(inst("q"), 1000)
        assert (await next_event(fresh)).instance.instance_id == "q"
        assert len(await reg.list()) == 6

    body._kw = {"limit": 3}
    run(body)
