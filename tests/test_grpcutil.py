from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve import grpcutil
from pdserve.errors import InvalidArgument, NotFound, ResourceExhausted
from pdserve.v1 import meta_pb2, meta_pb2_grpc

SERVICE = "pdserve.v1.MetaService"


class _Servicer(meta_pb2_grpc.MetaServiceServicer):
    @grpcutil.rpc
    async def Register(self, request, context):
        if not request.instance.address:
            raise InvalidArgument("instance.address must not be empty")
        raise ResourceExhausted("too many instances (limit max_instances=1)")

    @grpcutil.rpc
    async def ListInstances(self, request, context):
        if request.model:  # a ValueError is a bug like any other, not the caller's fault
            raise ValueError(f"bad internal state for {request.model}")
        raise RuntimeError("boom")

    @grpcutil.rpc
    async def Heartbeat(self, request, context):
        return meta_pb2.MetaHeartbeatResponse(ttl_ms=len(request.lease_id))

    @grpcutil.rpc
    async def WatchInstances(self, request, context):
        yield meta_pb2.InstanceEvent(type=meta_pb2.INSTANCE_EVENT_JOINED)
        raise NotFound("watch target vanished")


def _run(coro):
    return asyncio.run(coro)


async def _with_server(body, **kwargs):
    server = await grpcutil.start_server(
        [(meta_pb2_grpc.add_MetaServiceServicer_to_server, _Servicer(), SERVICE)],
        "127.0.0.1:0",
        **kwargs,
    )
    try:
        async with grpcutil.channel(server.address) as ch:
            return await body(ch, server)
    finally:
        await server.stop(0)


def test_errors_map_to_status_codes_with_messages():
    async def body(ch, _server):
        stub = meta_pb2_grpc.MetaServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Register(meta_pb2.RegisterRequest())
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "instance.address" in err.value.details()
        req = meta_pb2.RegisterRequest(instance=meta_pb2.Instance(address="h:1"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Register(req)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_instances" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListInstances(meta_pb2.ListInstancesRequest())
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "boom" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListInstances(meta_pb2.ListInstancesRequest(model="m"))
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert err.value.details() == (
            "internal error in _Servicer.ListInstances: ValueError: bad internal state for m"
        )
        events = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for ev in stub.WatchInstances(meta_pb2.WatchInstancesRequest()):
                events.append(ev)
        assert len(events) == 1 and err.value.code() == grpc.StatusCode.NOT_FOUND

    _run(_with_server(body))


def test_malformed_request_bytes_are_invalid_argument():
    """Bytes that do not parse as the method's message: INVALID_ARGUMENT saying so, for a
    unary and a server-streaming method; the server keeps serving."""

    async def body(ch, _server):
        for method in ("Heartbeat", "WatchInstances"):
            path = f"/{SERVICE}/{method}"
            call = ch.unary_unary(path) if method == "Heartbeat" else ch.unary_stream(path)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                result = call(b"\xff\xff\xff\xff")
                if method == "Heartbeat":
                    await result
                else:
                    async for _ in result:
                        pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid message" in err.value.details()
        ok = await meta_pb2_grpc.MetaServiceStub(ch).Heartbeat(
            meta_pb2.MetaHeartbeatRequest(lease_id="abc")
        )
        assert ok.ttl_ms == 3

    _run(_with_server(body))


def test_health_and_reflection_on_every_server():
    async def body(ch, server):
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        assert await grpcutil.check_health(server.address)
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        call = refl.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        resp = await call.read()
        await call.done_writing()
        names = {s.name for s in resp.list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health"} <= names
        server.set_serving(False)
        assert not await grpcutil.check_health(server.address)

    _run(_with_server(body))


def test_message_size_limit_is_enforced():
    async def body(ch, _server):
        stub = meta_pb2_grpc.MetaServiceStub(ch)
        ok = await stub.Heartbeat(meta_pb2.MetaHeartbeatRequest(lease_id="x" * 1000))
        assert ok.ttl_ms == 1000
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Heartbeat(meta_pb2.MetaHeartbeatRequest(lease_id="x" * 100_000))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    _run(_with_server(body, max_message_bytes=64 * 1024))


def test_unbindable_address_raises():
    async def body():
        with pytest.raises(RuntimeError):
            await grpcutil.start_server([], "256.0.0.1:1")

    _run(body())


def test_status_for_and_from_status_are_inverse():
    from pdserve import errors

    for cls in (InvalidArgument, NotFound, ResourceExhausted, errors.Unavailable):
        exc = errors.from_status(errors.status_for(cls("x")), "x")
        assert type(exc) is cls and str(exc) == "x"
    assert errors.status_for(ValueError("x")) == grpc.StatusCode.INTERNAL
    assert errors.status_for(TimeoutError()) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert type(errors.from_status(grpc.StatusCode.INTERNAL, "x")) is errors.Unavailable
    assert InvalidArgument("top_p must be in (0, 1]", param="top_p").param == "top_p"


def test_every_call_is_counted_by_method_with_its_time():
    """pdserve_grpc_server_calls_total / _seconds_total: a unary call, a stream read to its
    end, a call that fails and a malformed one each count once for their method."""
    from pdserve.telemetry import REGISTRY

    def value(name: str, method: str) -> float:
        return REGISTRY.get_sample_value(name, {"method": f"/{SERVICE}/{method}"}) or 0.0

    before = {
        m: value("pdserve_grpc_server_calls_total", m) for m in ("Heartbeat", "WatchInstances")
    }
    seconds = value("pdserve_grpc_server_seconds_total", "Heartbeat")

    async def body(ch, _server):
        stub = meta_pb2_grpc.MetaServiceStub(ch)
        await stub.Heartbeat(meta_pb2.MetaHeartbeatRequest(lease_id="abc"))
        with pytest.raises(grpc.aio.AioRpcError):
            await ch.unary_unary(f"/{SERVICE}/Heartbeat")(b"\xff\xff\xff\xff")
        with pytest.raises(grpc.aio.AioRpcError):  # one event, then NOT_FOUND
            async for _ in stub.WatchInstances(meta_pb2.WatchInstancesRequest()):
                pass

    _run(_with_server(body))
    assert value("pdserve_grpc_server_calls_total", "Heartbeat") == before["Heartbeat"] + 2
    assert (
        value("pdserve_grpc_server_calls_total", "WatchInstances") == before["WatchInstances"] + 1
    )
    assert value("pdserve_grpc_server_seconds_total", "Heartbeat") > seconds
