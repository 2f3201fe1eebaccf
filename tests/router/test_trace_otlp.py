"""A request's trace across the whole system, collected by a real OTLP receiver: an
OpenTelemetry TraceService (opentelemetry-proto's generated servicer) served over gRPC in this
process, and a real cluster (meta, KV master and node, a vLLM prefill and a vLLM decode worker,
the router; mutual TLS inside) exporting to it through OTEL_EXPORTER_OTLP_TRACES_ENDPOINT.

A chat request comes in over HTTP with a gateway's ``traceparent``: every span the services
export for it is in that trace, the router's request span is the gateway span's child, and the
trace holds the workers' calls, vLLM's ``llm_request``, the prefill's store save and the
decode's store load with the bytes they moved (equal: decode reads what prefill wrote). A
second request sharing the prompt's prefix finds it cached and loads it from the store. The
same with the torch reference engine on plaintext links."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from cluster_harness import CS, Cluster
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from vllm_services.vllm_flags import CHUNK, VLLM

pytestmark = pytest.mark.slow

GATEWAY_SPAN = "00f067aa0ba902b7"


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    start_ns: int
    end_ns: int
    attrs: dict[str, Any] = field(default_factory=dict)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span exported to it."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.changed = threading.Condition()

    def Export(self, request, context):
        with self.changed:
            for rs in request.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for scope in rs.scope_spans:
                    for s in scope.spans:
                        self.spans.append(
                            Span(
                                str(resource.get("service.name", "")),
                                s.name,
                                s.trace_id.hex(),
                                s.span_id.hex(),
                                s.parent_span_id.hex(),
                                s.start_time_unix_nano,
                                s.end_time_unix_nano,
                                {a.key: _value(a.value) for a in s.attributes},
                            )
                        )
            self.changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str, complete, timeout_s: float = 90.0) -> list[Span]:
        """The spans of ``trace_id`` once ``complete(spans)`` holds (the services export in
        batches, each on its own schedule)."""

        def spans() -> list[Span]:
            return [s for s in self.spans if s.trace_id == trace_id]

        with self.changed:
            if not self.changed.wait_for(lambda: complete(spans()), timeout_s):
                got = sorted((s.service, s.name) for s in spans())
                raise AssertionError(f"trace {trace_id} incomplete after {timeout_s}s: {got}")
            return spans()


def named(spans: list[Span], service: str, name: str) -> list[Span]:
    return [s for s in spans if s.service == service and s.name == name]


def moved(spans: list[Span], service: str, name: str) -> int:
    """Bytes the ``name`` spans of ``service`` moved."""
    return sum(int(s.attrs.get("pdserve.kv.bytes", 0)) for s in named(spans, service, name))


def complete(vllm: bool):
    """Whether a trace holds every span the checks below read. Each service exports its spans
    in batches on its own schedule, and a span is exported only once it ends: a worker's store
    save can reach the collector a batch before the RPC span that encloses it, so the wait
    names each span, not only the last one a request leaves."""
    required = [
        ("pdserve-router", "pdserve.request"),
        ("pdserve-router", "pdserve.phase.queue"),
        ("pdserve-router", "pdserve.phase.prefill"),
        ("pdserve-router", "pdserve.phase.decode"),
        ("pdserve-kvstore-master", "pdserve.v1.KVMasterService/LongestPrefix"),
        ("pdserve-prefill", "pdserve.v1.PrefillService/Prefill"),
        ("pdserve-decode", "pdserve.v1.DecodeService/Decode"),
    ]
    if vllm:
        required += [("pdserve-prefill", "llm_request"), ("pdserve-decode", "llm_request")]

    def done(spans: list[Span]) -> bool:
        return (
            all(named(spans, service, name) for service, name in required)
            and moved(spans, "pdserve-prefill", "pdserve.kv.save") > 0
            and moved(spans, "pdserve-decode", "pdserve.kv.load") > 0
        )

    return done


@pytest.fixture
def collector() -> Any:
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.endpoint = f"http://127.0.0.1:{port}"
    try:
        yield servicer
    finally:
        server.stop(0)


def chat(cluster: Cluster, content: str, trace_id: str) -> dict:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
    }
    headers = {
        "Content-Type": "application/json",
        "traceparent": f"00-{trace_id}-{GATEWAY_SPAN}-01",
    }
    req = urllib.request.Request(
        cluster.http + "/v1/chat/completions", json.dumps(body).encode(), headers
    )
    with urllib.request.urlopen(req, timeout=180) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def check_traces(collector: Collector, cluster: Cluster, chunk: int, *, vllm: bool) -> None:
    """Two chat requests on one prefix, each with a gateway's traceparent: the first one's
    whole trace (see the module docstring), the second one's store load."""
    prefix = " ".join(f"word{i}" for i in range(120))
    first_id, second_id = os.urandom(16).hex(), os.urandom(16).hex()
    t0 = time.time_ns()
    out = chat(cluster, prefix + " first question", first_id)
    t1 = time.time_ns()
    assert out["usage"]["prompt_tokens"] > 2 * chunk  # full chunks to save and load
    spans = collector.trace(first_id, complete(vllm))

    # every span of the trace is within the request's time, and the gateway's child
    for s in spans:
        assert t0 <= s.start_ns <= s.end_ns <= t1 + 5 * 10**9, s
    (request,) = named(spans, "pdserve-router", "pdserve.request")
    assert request.parent == GATEWAY_SPAN
    assert request.attrs["pdserve.plan"] == "read"
    assert request.attrs["pdserve.prompt_tokens"] == out["usage"]["prompt_tokens"]
    assert request.attrs["pdserve.cached_tokens"] == 0
    assert request.attrs["pdserve.outcome"] == "ok"
    children = [s for s in spans if s.parent == request.span_id]
    for phase in ("queue", "prefill", "decode"):
        assert named(children, "pdserve-router", f"pdserve.phase.{phase}")
    # the router asked the master (gRPC) for the cached prefix
    assert named(children, "pdserve-kvstore-master", "pdserve.v1.KVMasterService/LongestPrefix")
    # the workers' calls are the request span's children; vLLM's span is theirs
    for service, rpc in (
        ("pdserve-prefill", "pdserve.v1.PrefillService/Prefill"),
        ("pdserve-decode", "pdserve.v1.DecodeService/Decode"),
    ):
        (call,) = named(children, service, rpc)
        if vllm:
            (engine,) = named(spans, service, "llm_request")
            assert engine.parent == call.span_id
    # the store: what prefill wrote (chunks and the tail) is what decode read, in bytes
    saved = moved(spans, "pdserve-prefill", "pdserve.kv.save")
    assert saved == moved(spans, "pdserve-decode", "pdserve.kv.load")
    assert moved(spans, "pdserve-prefill", "pdserve.kvstore.write") > 0  # to the node
    assert moved(spans, "pdserve-decode", "pdserve.kvstore.read") > 0  # from the node
    assert named(spans, "pdserve-prefill", "pdserve.kvstore.master/BatchPutStart")
    for save in named(spans, "pdserve-prefill", "pdserve.kv.save"):
        assert save.attrs["pdserve.kv.moved"] > 0

    # a second request on the same prefix: cached, and loaded from the store
    chat(cluster, prefix + " another question", second_id)
    spans2 = collector.trace(second_id, complete(vllm))
    (request2,) = named(spans2, "pdserve-router", "pdserve.request")
    assert request2.attrs["pdserve.cached_tokens"] >= 2 * chunk
    loads = [s for s in spans2 if s.name == "pdserve.kv.load"]
    assert any(s.attrs["pdserve.kv.bytes"] > 0 for s in loads)
    assert {s.trace_id for s in spans2} == {second_id}


@pytest.fixture
def traced_env(collector, monkeypatch) -> None:
    """Every service the test starts exports to ``collector``, within 0.2 s (not 5 s)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", collector.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")


@pytest.mark.vllm
def test_a_request_is_one_trace_across_router_vllm_workers_and_store(
    collector, traced_env, tmp_path, tiny_model_dir
) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed")
    cluster = Cluster(
        tmp_path,
        tiny_model_dir,
        prefills=1,
        worker_flags=lambda role, i: {**VLLM, "vllm_cpu_cores": "0" if role == "prefill" else "1"},
        router_flags={"chunk_size": CHUNK, "prefix_source": "master"},
        node_id=f"n0-otlp-{os.getpid()}",
        tls=True,
    )
    try:
        check_traces(collector, cluster, CHUNK, vllm=True)
    finally:
        cluster.close()


def test_a_request_is_one_trace_with_the_torch_engine_in_plaintext(
    collector, traced_env, tmp_path, tiny_model_dir
) -> None:
    """The reference engine's store I/O (its scheduler and loader threads) joins the trace
    too, and plaintext channels carry it as mutual TLS ones do."""
    cluster = Cluster(
        tmp_path,
        tiny_model_dir,
        prefills=1,
        router_flags={"prefix_source": "master"},
        node_id=f"n0-otlp-torch-{os.getpid()}",
    )
    try:
        check_traces(collector, cluster, CS, vllm=False)
    finally:
        cluster.close()
