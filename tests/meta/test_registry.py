"""Registry logic on the memory backend, no network."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from registry_runner import run_with

from pdserve.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from pdserve.identity import Identity
from pdserve.services.meta import registry as registry_mod
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


# --- identities, ownership, caps, pages --------------------------------------------------

# a pool certificate (registers prefill-<anything>) and one worker's own (prefill-2[-...])
W1, W2 = Identity("worker", "prefill"), Identity("worker", "prefill-2")
DW = Identity("worker", "decode")
NODE, ROUTER, MASTER, ADMIN = (
    Identity("node", "n1"),
    Identity("router", "r1"),
    Identity("master", "kvstore-master"),
    Identity("admin", "ops"),
)


#: Limits without the per-role bound (one prefill or decode instance per worker certificate).
NO_ROLE_BOUND = {"max_instances_per_identity_by_role": {}}


@pytest.mark.parametrize(
    ("role", "allowed"),
    [
        (common_pb2.ROLE_PREFILL, {W1, ADMIN}),
        (common_pb2.ROLE_DECODE, {DW, ADMIN}),
        (common_pb2.ROLE_ROUTER, {ROUTER, ADMIN}),
        (common_pb2.ROLE_KVSTORE_NODE, {NODE, ADMIN}),
        (common_pb2.ROLE_KVSTORE_MASTER, {MASTER, ADMIN}),
    ],
)
def test_only_the_matching_identity_role_registers(role: int, allowed) -> None:
    async def body(reg: Registry) -> None:
        everyone = [W1, DW, NODE, ROUTER, MASTER, ADMIN, Identity("meta", "m")]
        for k, caller in enumerate(everyone):
            # a node registers under its own name (its node id), a worker under its pool's
            iid = caller.name if caller == NODE else f"{caller.name}-i{k}"
            call = reg.register(inst(iid, role), 1000, caller)
            if caller in allowed:
                await call
            else:
                with pytest.raises(PermissionDenied, match=f"{caller} may not register"):
                    await call
        assert {i.owner for i in await reg.list()} == {str(c) for c in allowed}

    run_with(body)


def test_only_the_owner_renews_removes_or_replaces_an_instance() -> None:
    async def body(reg: Registry) -> None:
        lid, _ = await reg.register(inst("prefill-2"), 1000, W1)
        (d0,) = await reg.list()
        assert d0.owner == "worker:prefill"
        takeover = inst("prefill-2", address="10.0.0.66:1")
        with pytest.raises(
            PermissionDenied, match=r"worker:prefill-2 may not re-register .* worker:prefill\b"
        ):
            await reg.register(takeover, 1000, W2)
        with pytest.raises(PermissionDenied, match="may not heartbeat instance 'prefill-2'"):
            await reg.heartbeat(lid, common_pb2.Load(queue_length=99), W2)
        with pytest.raises(PermissionDenied, match="may not deregister instance 'prefill-2'"):
            await reg.deregister(lid, W2)
        (d0,) = await reg.list()
        assert (d0.address, d0.lease_id, d0.load.queue_length) == ("127.0.0.1:9000", lid, 0)
        # the owner does all of it; an unknown lease is NOT_FOUND for anybody
        await reg.heartbeat(lid, common_pb2.Load(queue_length=1), W1)
        with pytest.raises(NotFound):
            await reg.heartbeat("feed", None, W2)
        lid2, _ = await reg.register(inst("prefill-2"), 1000, W1)
        # an admin may take over; the record is then the admin's
        lid3, _ = await reg.register(takeover, 1000, ADMIN)
        with pytest.raises(PermissionDenied):
            await reg.heartbeat(lid3, None, W1)
        await reg.deregister(lid3, ADMIN)
        assert await reg.list() == []
        # once it left, the id is free for anybody with the right role
        await reg.register(takeover, 1000, W2)
        assert [i.owner for i in await reg.list()] == ["worker:prefill-2"]
        assert lid2 != lid3

    run_with(body)


def test_a_record_without_an_owner_may_be_taken() -> None:
    async def body(reg: Registry) -> None:
        lid, _ = await reg.register(inst("prefill-2-p0"), 1000)  # no TLS: no owner
        assert [i.owner for i in await reg.list()] == [""]
        await reg.heartbeat(lid, None, W2)
        await reg.register(inst("prefill-2-p0"), 1000, W2)
        assert [i.owner for i in await reg.list()] == ["worker:prefill-2"]

    run_with(body)


class SlowMemory(MemoryBackend):
    """Registrations take a while, so concurrent ones overlap in the registry."""

    async def register(self, instance, ttl_ms):
        await asyncio.sleep(0.01)
        return await super().register(instance, ttl_ms)


def test_concurrent_registrations_cannot_pass_ownership_or_caps() -> None:
    async def body(reg: Registry) -> None:
        same_id = [reg.register(inst("prefill-2-p0"), 1000, c) for c in (W1, W2, W1, W2)]
        got = await asyncio.gather(*same_id, return_exceptions=True)
        assert [type(g) for g in got] == [tuple, PermissionDenied, tuple, PermissionDenied]
        # a pool's certificate: not bounded per role (test_identity_bound.py), only in all
        many = [reg.register(inst(f"prefill-q{k}"), 1000, W1) for k in range(20)]
        got = await asyncio.gather(*many, return_exceptions=True)
        assert sum(isinstance(g, tuple) for g in got) == 4  # 5 in all, p0 included
        assert all(isinstance(g, (tuple, ResourceExhausted)) for g in got)
        assert len(await reg.list()) == 5

    run_with(body, SlowMemory(), max_instances=5)


def test_caps_on_instances_per_identity_and_in_all() -> None:
    async def body(reg: Registry) -> None:
        leases = [(await reg.register(inst(f"prefill-a{k}"), 1000, W1))[0] for k in range(2)]
        with pytest.raises(
            ResourceExhausted, match=r"worker:prefill holds its max_instances_per_iden"
        ):
            await reg.register(inst("prefill-a2"), 1000, W1)
        await reg.register(
            inst("prefill-a0", address="127.0.0.1:9001"), 1000, W1
        )  # a re-registration
        await reg.register(inst("prefill-2-b0"), 1000, W2)
        with pytest.raises(ResourceExhausted, match=r"max_instances \(3\) live instances"):
            await reg.register(inst("prefill-2-b1"), 1000, W2)
        await reg.deregister(leases[1], W1)  # room comes back at once
        await reg.register(inst("prefill-2-b1"), 1000, W2)
        assert [i.instance_id for i in await reg.list()] == [
            "prefill-2-b0",
            "prefill-2-b1",
            "prefill-a0",
        ]

    run_with(body, max_instances=3, max_instances_per_identity=2, **NO_ROLE_BOUND)


@pytest.mark.parametrize(
    ("instance", "message"),
    [
        (inst("x", labels={f"k{i}": "v" for i in range(5)}), "labels has 5 entries; max_labels"),
        (inst("x", labels={"k": "é" * 9}), "values <= 16 bytes"),
        (inst("x", labels={"k" * 17: "v"}), "keys must be 1..16 bytes"),
        (inst("x", labels={"a": "v" * 16, "b": "v" * 16, "c": "v" * 16}), "max_record_bytes"),
    ],
)
def test_record_caps(instance, message) -> None:
    async def body(reg: Registry) -> None:
        with pytest.raises(ResourceExhausted, match=message):
            await reg.register(instance, 1000)
        assert await reg.list() == []

    run_with(body, max_labels=4, max_label_bytes=16, max_record_bytes=80)


def test_list_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(reg: Registry) -> None:
        for k in range(25):
            role = common_pb2.ROLE_DECODE if k % 5 == 0 else common_pb2.ROLE_PREFILL
            await reg.register(inst(f"i{k:02d}", role, labels={"pad": "x" * 100}), 5000)
        seen, token, pages = [], "", 0
        while True:
            page, token = await reg.list_page(common_pb2.ROLE_PREFILL, "m", 7, token)
            seen += [i.instance_id for i in page]
            pages += 1
            assert len(page) <= 7
            if not token:
                break
        assert pages == 3 and seen == [f"i{k:02d}" for k in range(25) if k % 5]
        assert (await reg.list_page())[1] == ""  # default page size: all 25 at once
        # a byte budget ends a page early, whatever the page size
        monkeypatch.setattr(registry_mod, "PAGE_BYTES", 3 * 150)
        page, token = await reg.list_page(page_size=1000)
        assert len(page) == 2 and token
        with pytest.raises(InvalidArgument, match="page_token 'garbage' is not one meta issued"):
            await reg.list_page(token="garbage")
        with pytest.raises(InvalidArgument, match="another role or model"):
            await reg.list_page(common_pb2.ROLE_DECODE, token=token)
        with pytest.raises(InvalidArgument, match="not one meta issued"):
            await reg.list_page(token="WzEsMiwzXQ")  # base64 of [1,2,3]

    run_with(body)


def test_a_worker_registers_only_its_pools_role_under_its_own_name() -> None:
    """Probe: a prefill worker's certificate announced a DECODE instance at its own address and
    the router sent it user requests. A worker's certificate names its pool and itself."""

    async def body(reg: Registry) -> None:
        p0 = Identity("worker", "prefill-0")
        decode = common_pb2.ROLE_DECODE
        refused = [
            (inst("prefill-0", decode), p0, "may not register a ROLE_DECODE: it is a prefill"),
            (inst("decode-0", decode), p0, "may not register a ROLE_DECODE"),
            (inst("prefill-1"), p0, "may register only 'prefill-0'"),
            (inst("prefill-00"), p0, "may register only 'prefill-0'"),
            (inst("w1"), Identity("worker", "w1"), "named after its pool"),
            (inst("decode-9", decode), W1, "may not register a ROLE_DECODE"),
        ]
        for record, caller, message in refused:
            with pytest.raises(PermissionDenied, match=re.escape(message)):
                await reg.register(record, 1000, caller)
        await reg.register(inst("prefill-0"), 1000, p0)
        await reg.register(inst("prefill-0-replica"), 1000, p0)
        await reg.register(inst("decode-9", decode), 1000, DW)  # a pool certificate
        assert sorted(i.instance_id for i in await reg.list()) == [
            "decode-9",
            "prefill-0",
            "prefill-0-replica",
        ]

    run_with(body, **NO_ROLE_BOUND)  # the names alone; the bound is test_identity_bound.py's
