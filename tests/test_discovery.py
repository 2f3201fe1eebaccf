"""pdserve/discovery.py against an in-process meta service (memory backend): the keepalive
heartbeats at once when the load provider signals a change, and only then (or every ttl/3);
Discovery's watched cache follows joins and leaves. The meta service as a real process, per
backend (lease expiry, restarts), is tested in tests/meta."""

from __future__ import annotations

import asyncio
import contextlib
import time

from pdserve import grpcutil
from pdserve.discovery import Discovery, MetaClient
from pdserve.services.meta.backends.memory import MemoryBackend
from pdserve.services.meta.registry import Registry
from pdserve.services.meta.servicer import MetaServicer
from pdserve.v1 import common_pb2, meta_pb2, meta_pb2_grpc


def inst(iid: str) -> meta_pb2.Instance:
    return meta_pb2.Instance(
        instance_id=iid, role=common_pb2.ROLE_DECODE, address="127.0.0.1:9000", model="m"
    )


@contextlib.asynccontextmanager
async def in_process_meta():
    registry = Registry(MemoryBackend())
    await registry.start()
    server = await grpcutil.start_server(
        [(meta_pb2_grpc.add_MetaServiceServicer_to_server, MetaServicer(registry), "meta")],
        "127.0.0.1:0",
    )
    try:
        yield server.address, registry
    finally:
        await registry.close()
        await server.stop(0)


def test_heartbeat_follows_the_load_signal_not_a_timer() -> None:
    async def main() -> None:
        async with in_process_meta() as (address, registry):
            load = common_pb2.Load()
            changed = asyncio.Event()
            client = MetaClient(address)
            await client.register(
                inst("d0"), ttl_ms=30_000, load_fn=lambda: load, load_changed=changed
            )
            await asyncio.sleep(0.1)
            beats = registry.heartbeats  # no signal, ttl/3 = 10 s away: nothing sent
            await asyncio.sleep(0.3)
            assert registry.heartbeats == beats
            disc = Discovery(address)
            await disc.start()
            await disc.wait_for(lambda xs: len(xs) == 1, 5)
            t0 = time.monotonic()
            load.running_requests = 1
            changed.set()
            await disc.wait_for(lambda xs: xs[0].load.running_requests == 1, 2)
            assert time.monotonic() - t0 < 1.0
            assert registry.heartbeats == beats + 1 and not changed.is_set()
            changed.set()  # a signal without a new load sends nothing
            await asyncio.sleep(0.2)
            assert registry.heartbeats == beats + 1
            await client.deregister()
            await disc.wait_for(lambda xs: xs == [], 5)
            await client.close()
            await disc.close()

    asyncio.run(main())


def test_a_restarted_meta_does_not_empty_the_view_before_instances_reregister() -> None:
    """Meta restarts empty (memory backend): Discovery keeps the instances it knew while they
    re-register (their keepalive finds the lease gone), and drops one that never comes back
    once the grace is over."""

    async def main() -> None:
        async with in_process_meta() as (address, _registry):
            alive = MetaClient(address)
            await alive.register(inst("d0"), ttl_ms=3_000)
            gone = MetaClient(address)
            await gone.register(inst("d1"), ttl_ms=3_000)
            disc = Discovery(address, poll_interval_s=0.2, vanish_grace_s=4.0)
            await disc.start()
            await disc.wait_for(lambda xs: len(xs) == 2, 5)
        await gone._stop_keepalive()  # d1 dies with the old meta: it never re-registers
        seen: list[set[str]] = []
        registry = Registry(MemoryBackend())
        await registry.start()
        server = await grpcutil.start_server(
            [(meta_pb2_grpc.add_MetaServiceServicer_to_server, MetaServicer(registry), "meta")],
            address,
        )
        try:
            deadline = time.monotonic() + 3.5
            while time.monotonic() < deadline:  # inside the grace: both stay in view
                seen.append({i.instance_id for i in disc.instances()})
                await asyncio.sleep(0.1)
            assert all(s == {"d0", "d1"} for s in seen), seen
            assert [i.instance_id for i in await alive.list()] == ["d0"]  # re-registered
            await disc.wait_for(lambda xs: [i.instance_id for i in xs] == ["d0"], 5)
        finally:
            await alive.close()
            await gone.close()
            await disc.close()
            await registry.close()
            await server.stop(0)

    asyncio.run(main())
