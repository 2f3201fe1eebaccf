"""The real ``pdserve meta`` process, once per backend (memory, etcd)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

from pdserve import grpcutil
from pdserve.discovery import Discovery, MetaClient
from pdserve.v1 import common_pb2, meta_pb2, meta_pb2_grpc

PREFILL, DECODE = common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE


def inst(iid: str, role: int = PREFILL, **kw) -> meta_pb2.Instance:
    return meta_pb2.Instance(
        instance_id=iid, role=role, address=kw.pop("address", "127.0.0.1:9000"), model="m", **kw
    )


async def expect_error(call, code: grpc.StatusCode, message: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, err.value.details()
    assert message in err.value.details(), err.value.details()


@pytest.mark.slow
def test_register_list_watch_and_bad_input(start_meta) -> None:
    meta = start_meta()

    async def main() -> None:
        async with grpcutil.channel(meta.info["grpc"]) as ch:
            stub = meta_pb2_grpc.MetaServiceStub(ch)
            watch = stub.WatchInstances(meta_pb2.WatchInstancesRequest(role=DECODE))
            await watch.initial_metadata()
            r = await stub.Register(
                meta_pb2.RegisterRequest(instance=inst("d0", DECODE), ttl_ms=5000)
            )
            assert r.lease_id and r.ttl_ms >= 5000
            await stub.Register(meta_pb2.RegisterRequest(instance=inst("p0"), ttl_ms=5000))
            ev = await asyncio.wait_for(watch.read(), 5)
            assert (ev.type, ev.instance.instance_id) == (meta_pb2.INSTANCE_EVENT_JOINED, "d0")
            load = common_pb2.Load(queue_length=4, running_requests=1, kv_usage=0.25)
            hb = await stub.Heartbeat(meta_pb2.MetaHeartbeatRequest(lease_id=r.lease_id, load=load))
            assert hb.ttl_ms > 0
            ev = await asyncio.wait_for(watch.read(), 5)
            assert ev.type == meta_pb2.INSTANCE_EVENT_UPDATED and ev.instance.load.queue_length == 4
            listed = await stub.ListInstances(meta_pb2.ListInstancesRequest(role=DECODE))
            assert [(i.instance_id, i.load.running_requests) for i in listed.instances] == [
                ("d0", 1)
            ]

            bad = [
                (meta_pb2.RegisterRequest(ttl_ms=1000), "instance is required"),
                (
                    meta_pb2.RegisterRequest(instance=inst("x", role=17), ttl_ms=1000),
                    "unknown role 17",
                ),
                (
                    meta_pb2.RegisterRequest(instance=inst("x", address=""), ttl_ms=1000),
                    "instance.address is required",
                ),
                (meta_pb2.RegisterRequest(instance=inst("x"), ttl_ms=0), "ttl_ms is required"),
                (
                    meta_pb2.RegisterRequest(instance=inst("x"), ttl_ms=86_400_000),
                    "ttl_ms 86400000 out of range 500..600000",
                ),
            ]
            for req, msg in bad:
                await expect_error(stub.Register(req), grpc.StatusCode.INVALID_ARGUMENT, msg)
            await expect_error(
                stub.Heartbeat(meta_pb2.MetaHeartbeatRequest(lease_id="7fffdeadbeef")),
                grpc.StatusCode.NOT_FOUND,
                "lease '7fffdeadbeef' not found",
            )
            await expect_error(
                stub.Heartbeat(meta_pb2.MetaHeartbeatRequest()),
                grpc.StatusCode.INVALID_ARGUMENT,
                "lease_id is required",
            )
            await expect_error(
                stub.Deregister(meta_pb2.DeregisterRequest(lease_id="zz")),
                grpc.StatusCode.NOT_FOUND,
                "not found",
            )
            await expect_error(
                stub.ListInstances(meta_pb2.ListInstancesRequest(role=99)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "unknown role 99",
            )
            # Nothing else disturbed.
            listed = await stub.ListInstances(meta_pb2.ListInstancesRequest())
            assert sorted(i.instance_id for i in listed.instances) == ["d0", "p0"]
            await stub.Deregister(meta_pb2.DeregisterRequest(lease_id=r.lease_id))
            ev = await asyncio.wait_for(watch.read(), 5)
            assert (ev.type, ev.instance.instance_id) == (meta_pb2.INSTANCE_EVENT_LEFT, "d0")
            watch.cancel()

    asyncio.run(main())


def http(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.mark.slow
def test_http_metadata_protocol(start_meta) -> None:
    url = start_meta().info["http"]
    seg = {"name": "seg-a", "buffers": [{"addr": 1234, "length": 4096}]}
    assert http("GET", f"{url}?key=mooncake/ram/seg-a") == (404, b"metadata not found")
    assert http("PUT", f"{url}?key=mooncake/ram/seg-a", json.dumps(seg).encode())[0] == 200
    code, body = http("GET", f"{url}?key=mooncake/ram/seg-a")
    assert code == 200 and json.loads(body) == seg
    code, body = http("PUT", f"{url}?key=k2", b"{not json")
    assert code == 400 and b"metadata body is not valid JSON" in body
    code, body = http("GET", url)
    assert code == 400 and b"metadata key is required" in body
    assert http("GET", f"{url}?key=k2") == (404, b"metadata not found")
    assert http("DELETE", f"{url}?key=mooncake/ram/seg-a") == (200, b"metadata deleted")
    assert http("DELETE", f"{url}?key=mooncake/ram/seg-a") == (404, b"metadata not found")
    assert http("POST", f"{url}?key=x", b"{}")[0] == 405


@pytest.mark.slow
def test_silent_instance_expires_and_watchers_see_it_leave(start_meta) -> None:
    meta = start_meta()
    addr = meta.info["grpc"]

    async def main() -> None:
        disc = Discovery(addr, role=PREFILL)
        await disc.start()
        await disc.wait_for(lambda _: disc.watching, 10)
        keeper, quitter = MetaClient(addr), MetaClient(addr)
        await keeper.register(inst("p-keep"), ttl_ms=1000)
        await quitter.register(inst("p-quit", address="127.0.0.1:9001"), ttl_ms=1000)
        granted = quitter._ttl_ms  # etcd rounds up (whole seconds, >= its minimum)
        await disc.wait_for(lambda xs: len(xs) == 2, 5)
        await asyncio.sleep(granted / 1000)  # both survive a full TTL thanks to heartbeats
        assert [i.instance_id for i in await keeper.list()] == ["p-keep", "p-quit"]
        await quitter.close()  # stops heartbeating, no deregister
        t0 = time.monotonic()
        await disc.wait_for(lambda xs: [i.instance_id for i in xs] == ["p-keep"], 10)
        gone_after = time.monotonic() - t0
        # Gone within its TTL of the last heartbeat (plus the store's expiry tick).
        assert gone_after <= granted / 1000 + 0.6, (gone_after, granted)
        await keeper.deregister()
        await disc.wait_for(lambda xs: xs == [], 5)
        await keeper.close()
        await disc.close()

    asyncio.run(main())


@pytest.mark.slow
def test_meta_restart(start_meta, backend: str) -> None:
    meta = start_meta()
    grpc_port = int(meta.info["grpc"].rsplit(":", 1)[1])
    url = meta.info["http"]
    http_port = int(url.split(":")[2].split("/")[0])
    assert http("PUT", f"{url}?key=persist", b'{"v": 1}')[0] == 200

    async def main() -> None:
        clients = [MetaClient(meta.info["grpc"]) for _ in range(3)]
        loads = [common_pb2.Load(queue_length=i) for i in range(3)]
        leases = []
        for i, c in enumerate(clients):
            # a TTL the restart fits in on 2 loaded cores (a process start can take seconds
            # while vLLM tests run beside; with 3 s the etcd leases once expired meanwhile)
            leases.append(
                await c.register(inst(f"d{i}", DECODE), ttl_ms=10_000, load_fn=lambda i=i: loads[i])
            )
        interval = clients[0]._ttl_ms / 3000
        meta.stop()
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        new = await asyncio.to_thread(start_meta, grpc_port, http_port)
        ready = time.monotonic()
        async with grpcutil.channel(new.info["grpc"]) as ch:
            stub = meta_pb2_grpc.MetaServiceStub(ch)
            if backend == "etcd":
                listed = await stub.ListInstances(
                    meta_pb2.ListInstancesRequest(), wait_for_ready=True
                )
                assert [i.lease_id for i in listed.instances] == leases  # nothing lost
            while True:
                # wait_for_ready: this observer channel shares the clients' subchannel, which
                # may still be in reconnect backoff from the restart.
                listed = await stub.ListInstances(
                    meta_pb2.ListInstancesRequest(), wait_for_ready=True
                )
                if len(listed.instances) == 3:
                    break
                assert time.monotonic() - ready <= interval, (  # one heartbeat interval
                    f"only {len(listed.instances)} back after {time.monotonic() - ready:.2f}s"
                )
                await asyncio.sleep(0.05)
            back = time.monotonic() - ready
            assert sorted(i.load.queue_length for i in listed.instances) == [0, 1, 2]
        print(f"{backend}: all back {back:.2f}s after meta ready (restart took {ready - t0:.2f}s)")
        for c in clients:
            assert c.registrations == (1 if backend == "etcd" else 2)
            await c.deregister()
            await c.close()

    asyncio.run(main())
    code, body = http("GET", f"{url}?key=persist")
    if backend == "etcd":
        assert (code, json.loads(body)) == (200, {"v": 1})
    else:
        assert (code, body) == (404, b"metadata not found")
