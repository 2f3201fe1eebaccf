"""pdserve.tracing and its gRPC interceptors without a process: off is a no-op (no SDK
object, no interceptor, nothing computed), W3C trace context goes out and comes back
(inject/extract, HTTP headers, gRPC metadata through real in-process servers, asyncio and
blocking channels), spans nest, and phases timed on the monotonic clock land at their times."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from pdserve import grpcutil, tracing, tracing_grpc
from pdserve.v1 import engine_pb2, engine_pb2_grpc

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, every span kept in memory as it ends."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "pdserve-test"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_provider", provider)
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer(tracing.SCOPE))
    monkeypatch.setattr(tracing, "_endpoint", "memory")
    yield exporter
    provider.shutdown()


def test_off_by_default_everything_is_a_no_op() -> None:
    assert not tracing.enabled() and tracing.endpoint() == ""
    assert tracing._provider is None  # no SDK object
    made = []
    with tracing.span("x", lambda: made.append(1) or {}) as span:
        assert span is tracing.NO_SPAN and not span.is_recording()
        assert tracing.headers() == {}
    assert made == []  # lazy attributes are not even computed
    assert tracing.extract({"traceparent": TRACEPARENT}) is None
    assert tracing_grpc.client_interceptors() == []
    assert tracing_grpc.server_interceptors() == []
    assert tracing.http_middlewares() == []
    tracing.record("phase", 1.0, 2.0)  # nothing to record into: no error
    tracing.annotate({"a": 1})


def test_configure_needs_an_endpoint_and_env_supplies_one(monkeypatch) -> None:
    monkeypatch.setenv(tracing.ENDPOINT_ENV, "")
    assert tracing.resolve_endpoint("") == ""
    assert not tracing.configure("", "pdserve-router")
    assert tracing._provider is None
    monkeypatch.setenv(tracing.ENDPOINT_ENV, "http://collector:4317")
    assert tracing.resolve_endpoint("") == "http://collector:4317"
    assert tracing.resolve_endpoint(" http://mine:4317 ") == "http://mine:4317"
    assert tracing.service_name("kvstore-master") == "pdserve-kvstore-master"


def test_configure_sets_the_service_and_the_childrens_environment(monkeypatch) -> None:
    """On: an SDK provider named after the service, the endpoint and name in the environment
    for vLLM's processes; shutdown turns it off again."""
    # set (to empty), not deleted: monkeypatch then restores what configure writes
    monkeypatch.setenv(tracing.ENDPOINT_ENV, "")
    monkeypatch.setenv(tracing.SERVICE_ENV, "")
    try:
        assert tracing.configure("http://127.0.0.1:1", "pdserve-decode")
        assert tracing.enabled() and tracing.endpoint() == "http://127.0.0.1:1"
        assert tracing._provider.resource.attributes["service.name"] == "pdserve-decode"
        assert os.environ[tracing.ENDPOINT_ENV] == "http://127.0.0.1:1"
        assert os.environ[tracing.SERVICE_ENV] == "pdserve-decode"
        assert tracing.configure("http://other:2", "x")  # once per process: kept
        assert tracing.endpoint() == "http://127.0.0.1:1"
    finally:
        tracing.shutdown()
    assert not tracing.enabled() and tracing._provider is None


def test_unknown_protocol_is_a_config_error(monkeypatch) -> None:
    from pdserve.config import ConfigError

    monkeypatch.setenv(tracing.PROTOCOL_ENV, "thrift")
    with pytest.raises(ConfigError, match="thrift"):
        tracing.configure("http://127.0.0.1:1", "pdserve-router")
    assert not tracing.enabled()


def test_inject_and_extract_round_trip(spans) -> None:
    """A caller's traceparent is continued: the span's trace id is the caller's, its parent
    the caller's span, and what it injects names itself in that trace."""
    with tracing.continued({"traceparent": TRACEPARENT}), tracing.span("work", {"k": 3}) as span:
        out = tracing.headers()
        own = span.get_span_context()
    (done,) = spans.get_finished_spans()
    assert f"{done.context.trace_id:032x}" == TRACE_ID
    assert f"{done.parent.span_id:016x}" == PARENT_ID
    assert done.attributes["k"] == 3
    version, trace_id, span_id, flags = out["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01")
    assert span_id == f"{own.span_id:016x}"


def test_extract_takes_grpc_metadata_and_refuses_garbage(spans) -> None:
    ctx = tracing.extract((("x-request-id", "r"), ("traceparent", TRACEPARENT)))
    assert ctx is not None
    assert tracing.extract({"traceparent": "not-a-traceparent"}) is None
    assert tracing.extract({}) is None
    assert tracing.extract((("x-request-id", "r"),)) is None


def test_a_span_outside_a_trace_only_where_allowed(spans) -> None:
    with tracing.span("call", root=False) as span:
        assert span is tracing.NO_SPAN
    with tracing.span("request"), tracing.span("call", root=False) as inner:
        assert inner.is_recording()
    names = [s.name for s in spans.get_finished_spans()]
    assert names == ["call", "request"]
    call, request = spans.get_finished_spans()
    assert call.parent.span_id == request.context.span_id


def test_a_phase_is_recorded_at_its_monotonic_times(spans) -> None:
    with tracing.span("request") as parent:
        now = time.monotonic()
        tracing.record("pdserve.phase.prefill", now - 0.5, now - 0.2, {"n": 1})
        tracing.record("backwards", now, now - 1)  # refused
        tracing.annotate({"pdserve.plan": "read"})
    phase, request = spans.get_finished_spans()
    assert phase.name == "pdserve.phase.prefill"
    assert phase.parent.span_id == parent.get_span_context().span_id
    assert abs((phase.end_time - phase.start_time) / 1e9 - 0.3) < 1e-3
    assert abs(phase.end_time / 1e9 - (time.time() - 0.2)) < 0.5
    assert request.attributes["pdserve.plan"] == "read"


def test_an_error_marks_the_span(spans) -> None:
    with pytest.raises(ValueError), tracing.span("boom"):
        raise ValueError("bad")
    (s,) = spans.get_finished_spans()
    assert not s.status.is_ok and s.events[0].name == "exception"


def test_store_io_attributes() -> None:
    class Rep:
        def __init__(self, size: int, node_id: str) -> None:
            self.size, self.node_id = size, node_id

    attrs = tracing.store_io("shm", [Rep(10, "b"), Rep(5, "a"), Rep(1, "b")])()
    assert attrs == {
        "pdserve.transport": "shm",
        "pdserve.kv.objects": 3,
        "pdserve.kv.bytes": 16,
        "pdserve.kvstore.nodes": ["a", "b"],
    }


class _Stream(engine_pb2_grpc.DecodeServiceServicer):
    """A server-streaming method (the workers' Decode is one) that says what trace it runs in."""

    async def Decode(self, request, context):
        for _ in range(2):
            yield engine_pb2.DecodeResponse(text=tracing.headers().get("traceparent", ""))


def test_a_server_stream_carries_the_trace_both_ways(spans) -> None:
    """grpc.aio files a client interceptor under one call kind only: the streaming call (the
    router's Decode) must carry the trace too, and its server span cover the whole stream."""

    async def main() -> list[str]:
        server = await grpcutil.start_server(
            [(engine_pb2_grpc.add_DecodeServiceServicer_to_server, _Stream(), "Decode")],
            "127.0.0.1:0",
        )
        try:
            async with grpcutil.channel(server.address) as ch:
                stub = engine_pb2_grpc.DecodeServiceStub(ch)
                with tracing.continued({"traceparent": TRACEPARENT}), tracing.span("client"):
                    return [m.text async for m in stub.Decode(engine_pb2.DecodeRequest())]
        finally:
            await server.stop(0)

    texts = asyncio.run(main())
    by_name = {s.name: s for s in spans.get_finished_spans()}
    server = by_name["pdserve.v1.DecodeService/Decode"]
    assert server.parent.span_id == by_name["client"].context.span_id
    # what the servicer saw as current: the server span, in the caller's trace
    assert texts == [f"00-{TRACE_ID}-{server.context.span_id:016x}-01"] * 2


def _health_check_traced(sync: bool) -> None:
    """One Health.Check from inside a span of the trace TRACEPARENT names to a real
    in-process server, over an asyncio (or a blocking) channel, and one outside any trace."""

    async def main() -> None:
        server = await grpcutil.start_server([], "127.0.0.1:0")
        try:
            request = health_pb2.HealthCheckRequest()
            if sync:
                with grpcutil.sync_channel(server.address) as ch:
                    stub = health_pb2_grpc.HealthStub(ch)
                    with (
                        tracing.continued({"traceparent": TRACEPARENT}),
                        tracing.span("client-side"),
                    ):
                        await asyncio.to_thread(stub.Check, request, timeout=5)
                    await asyncio.to_thread(stub.Check, request, timeout=5)
                return
            async with grpcutil.channel(server.address) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                with tracing.continued({"traceparent": TRACEPARENT}), tracing.span("client-side"):
                    await stub.Check(request, timeout=5)
                await stub.Check(request, timeout=5)  # untraced: no server span
        finally:
            await server.stop(0)

    asyncio.run(main())


@pytest.mark.parametrize("sync", [False, True])
def test_grpc_calls_carry_the_trace_to_the_server(spans, sync) -> None:
    _health_check_traced(sync)
    names = sorted(s.name for s in spans.get_finished_spans())
    assert names == ["client-side", "grpc.health.v1.Health/Check"]  # none for the untraced
    by_name = {s.name: s for s in spans.get_finished_spans()}
    client, server = by_name["client-side"], by_name["grpc.health.v1.Health/Check"]
    assert server.kind == SpanKind.SERVER
    assert server.context.trace_id == client.context.trace_id == int(TRACE_ID, 16)
    assert server.parent.span_id == client.context.span_id
    assert server.attributes["rpc.method"] == "grpc.health.v1.Health/Check"
    assert server.status.is_ok


def test_a_failed_grpc_call_marks_the_server_span(spans) -> None:
    async def main() -> None:
        server = await grpcutil.start_server([], "127.0.0.1:0")
        try:
            async with grpcutil.channel(server.address) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                with tracing.span("client-side"), pytest.raises(grpc.aio.AioRpcError):
                    await stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        finally:
            await server.stop(0)

    asyncio.run(main())
    server = next(s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER)
    assert not server.status.is_ok and "NOT_FOUND" in server.status.description


def test_http_middleware_continues_the_callers_trace(spans) -> None:
    """The router's HTTP API: a request's traceparent header is the current trace in the
    handler (a real aiohttp server in this process)."""
    from aiohttp import ClientSession, web

    seen: list[dict[str, str]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(tracing.headers())
        return web.Response(text="ok")

    async def main() -> None:
        app = web.Application(middlewares=tracing.http_middlewares())
        app.router.add_get("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with ClientSession() as s:
                for headers in ({"traceparent": TRACEPARENT}, {}):
                    async with s.get(f"http://127.0.0.1:{port}/", headers=headers) as r:
                        assert r.status == 200
        finally:
            await runner.cleanup()

    asyncio.run(main())
    assert seen == [{"traceparent": TRACEPARENT}, {}]
