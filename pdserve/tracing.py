"""OpenTelemetry traces, one per request, across router, workers, engine and store.

Off by default. A service turns it on with its config field ``otlp_traces_endpoint``
(:class:`TracingConfig`, as vLLM's ``--otlp-traces-endpoint``) or the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``: :func:`configure` then sets up one tracer provider
for the process (``service.name`` ``pdserve-<service>``, a BatchSpanProcessor, the OTLP
exporter: gRPC, or HTTP with ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``), and
:func:`shutdown` flushes it when the service stops. While off no SDK object exists and
:func:`span` hands back one shared no-op: a call site costs a global read.

Context travels as W3C ``traceparent``/``tracestate``: in HTTP headers into the router (a
gateway's trace continues), in gRPC metadata on every internal call
(:mod:`pdserve.tracing_grpc`, attached by :mod:`pdserve.grpcutil`), and in vLLM's
``trace_headers`` into the engine's processes, where the KV connector's store spans join the
request's trace (:func:`configure_from_env`: the worker passes its endpoint and service name
down in the environment, as vLLM does).

Spans are opened with :func:`span` (current for the ``with`` block) or :func:`record` (past
intervals with their own times); a service creates server spans only for calls that carry a
trace (heartbeats and other untraced calls make none), and the router starts each request's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdserve.config_fields import help_field

log = logging.getLogger(__name__)

#: The standard variables pdserve honours (and sets for vLLM's processes).
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
SERVICE_ENV = "OTEL_SERVICE_NAME"
#: W3C trace-context header / metadata keys (lowercase, as gRPC metadata needs).
TRACE_HEADERS = ("traceparent", "tracestate")
#: The instrumentation scope of every pdserve span.
SCOPE = "pdserve"

_propagator = TraceContextTextMapPropagator()
#: This process's provider (None = tracing off), its tracer and its endpoint.
_provider: Any = None
_tracer: trace.Tracer | None = None
_endpoint = ""


@dataclass
class TracingConfig:
    """The tracing field of every service config (a base class of each)."""

    otlp_traces_endpoint: str = help_field(
        "",
        "OTLP endpoint the service exports its request traces to (gRPC, e.g. "
        "http://127.0.0.1:4317; http/protobuf with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL); "
        "empty = OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else tracing off",
    )


def service_name(label: str) -> str:
    """The ``service.name`` of the service logged as ``label`` (``router``, ``prefill``,
    ``decode``, ``kvstore-master``, ``kvstore-node``, ``meta``): ``pdserve-<label>``."""
    return f"pdserve-{label}"


def resolve_endpoint(configured: str = "") -> str:
    """The endpoint to export to: ``configured``, else the standard environment variable
    ("" = tracing off)."""
    return configured.strip() or os.environ.get(ENDPOINT_ENV, "").strip()


def enabled() -> bool:
    """Whether this process exports traces."""
    return _tracer is not None


def endpoint() -> str:
    """Where this process exports its traces ("" = off)."""
    return _endpoint if _tracer is not None else ""


def configure(endpoint: str, service: str, *, for_children: bool = True) -> bool:
    """Turns tracing on for this process, exporting to ``endpoint`` as ``service``
    (``service.name``); False, changing nothing, when ``endpoint`` is empty. Once per process
    (a second call keeps the first set-up). ``for_children``: set the endpoint and service in
    the environment, so that processes started from here (vLLM's engine core, which runs the
    KV connector) trace under the same name (:func:`configure_from_env`). The provider also
    becomes OpenTelemetry's global one when none is set yet, so libraries that trace through
    it (vLLM's ``llm_request`` span) export with pdserve's."""
    global _provider, _tracer, _endpoint
    if not endpoint or _tracer is not None:
        return _tracer is not None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
    _provider, _tracer, _endpoint = provider, provider.get_tracer(SCOPE), endpoint
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        trace.set_tracer_provider(provider)
    if for_children:
        os.environ[ENDPOINT_ENV] = endpoint
        os.environ[SERVICE_ENV] = service
    log.info("tracing on: %s exports to %s", service, endpoint)
    return True


def configure_from_env(default_service: str) -> bool:
    """:func:`configure` from the environment (a process vLLM started: the worker's endpoint
    and service name, or those of a ``vllm serve --otlp-traces-endpoint``)."""
    service = os.environ.get(SERVICE_ENV, "").strip() or default_service
    return configure(resolve_endpoint(), service, for_children=False)


def _exporter(endpoint: str) -> Any:
    protocol = os.environ.get(PROTOCOL_ENV, "grpc").strip() or "grpc"
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    if protocol != "grpc":
        from pdserve.config_fields import ConfigError

        raise ConfigError(f"{PROTOCOL_ENV}={protocol!r}: pdserve exports grpc or http/protobuf")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

    return Grpc(endpoint=endpoint, insecure=not endpoint.startswith("https://"))


def shutdown() -> None:
    """Exports what is buffered and stops the exporter (the service's stop; idempotent)."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


# --- propagation ---------------------------------------------------------------------------


def headers() -> dict[str, str]:
    """The current trace's W3C headers (empty when off or outside a trace)."""
    if _tracer is None:
        return {}
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier


def extract(carrier: Mapping[str, str] | Sequence[tuple[str, Any]]) -> Any:
    """The OpenTelemetry context of a caller's ``traceparent``: from a mapping (HTTP headers,
    vLLM's trace headers) or gRPC metadata pairs; None when it carries none (or tracing is
    off)."""
    if _tracer is None:
        return None
    if not isinstance(carrier, Mapping):
        carrier = {k: v for k, v in carrier if k in TRACE_HEADERS and isinstance(v, str)}
    if not carrier.get("traceparent"):
        return None
    ctx = _propagator.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


@contextlib.contextmanager
def continued(carrier: Mapping[str, str] | None) -> Iterator[None]:
    """Makes the trace ``carrier`` names current for the block (nothing when it names none)."""
    ctx = extract(carrier) if carrier else None
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


# --- spans ---------------------------------------------------------------------------------


class _NoSpan:
    """What :func:`span` yields while tracing is off (or where there is no trace)."""

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def is_recording(self) -> bool:
        return False


NO_SPAN = _NoSpan()
_NO_BLOCK = contextlib.nullcontext(NO_SPAN)


#: A span's attributes, or what makes them (called only when a span is made).
Attributes = Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None


def span(
    name: str,
    attributes: Attributes = None,
    *,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    parent: Any = None,
    root: bool = True,
) -> contextlib.AbstractContextManager[Any]:
    """A span current for the ``with`` block, ended (with the error, if one is raised) at its
    end; yields the span for attributes set later. ``attributes`` may be a function, called
    only when a span is made (nothing is computed while tracing is off). ``parent``: a context from
    :func:`extract` (default: the current one); ``root``: may start a trace of its own where there is
    no current one (False: no span outside a trace, as for calls that are not requests'). A
    shared no-op while tracing is off."""
    tracer = _tracer
    if tracer is None:
        return _NO_BLOCK
    if not root and parent is None and not trace.get_current_span().get_span_context().is_valid:
        return _NO_BLOCK
    if callable(attributes):
        attributes = attributes()
    return tracer.start_as_current_span(
        name,
        context=parent,
        kind=kind,
        attributes=dict(attributes or {}),
    )


def record(
    name: str, start: float, end: float, attributes: Mapping[str, Any] | None = None
) -> None:
    """A child of the current span covering ``[start, end]`` (``time.monotonic()`` seconds,
    past): a phase the caller timed itself. Nothing when off, outside a trace or ``end`` is
    before ``start``."""
    tracer = _tracer
    if tracer is None or end < start or not trace.get_current_span().get_span_context().is_valid:
        return
    offset = time.time_ns() - time.monotonic_ns()
    s = tracer.start_span(name, attributes=dict(attributes or {}), start_time=_ns(start, offset))
    s.end(end_time=_ns(end, offset))


def _ns(monotonic_s: float, offset_ns: int) -> int:
    return int(monotonic_s * 1e9) + offset_ns


def annotate(attributes: Mapping[str, Any]) -> None:
    """Sets ``attributes`` on the current span (nothing when off or outside a trace)."""
    if _tracer is not None:
        current = trace.get_current_span()
        if current.is_recording():
            current.set_attributes(dict(attributes))


def http_middlewares() -> list[Any]:
    """The aiohttp middlewares of a server that continues its callers' traces (the router's
    HTTP API): a request's ``traceparent`` header is the current trace while it is handled
    (a gateway's trace continues into pdserve's). None while tracing is off."""
    if _tracer is None:
        return []
    from aiohttp import web

    @web.middleware
    async def continue_trace(request: web.Request, handler: Any) -> web.StreamResponse:
        with continued(request.headers):
            return await handler(request)

    return [continue_trace]


def store_io(transport: str, replicas: Sequence[Any]) -> Callable[[], dict[str, Any]]:
    """The attributes of a store data-plane span: ``transport`` and the replicas it moves
    (``size`` bytes each, on ``node_id``), made only when the span is."""
    return lambda: {
        "pdserve.transport": transport,
        "pdserve.kv.objects": len(replicas),
        "pdserve.kv.bytes": sum(int(r.size) for r in replicas),
        "pdserve.kvstore.nodes": sorted({str(r.node_id) for r in replicas}),
    }
