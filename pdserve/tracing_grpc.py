"""W3C trace context on gRPC: client interceptors that put the current trace's ``traceparent``
in every call's metadata, and a server interceptor that runs a traced call inside a server
span continuing the caller's trace. :mod:`pdserve.grpcutil` attaches them to every channel
and server it makes, only while :mod:`pdserve.tracing` is on (none otherwise)."""

from __future__ import annotations

import collections
import inspect
from typing import Any

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from pdserve import tracing


def _with_trace(metadata: Any) -> Any:
    """``metadata`` plus the current trace's headers (unchanged outside a trace)."""
    extra = tracing.headers()
    if not extra:
        return metadata
    kept = [(k, v) for k, v in (metadata or ()) if k not in tracing.TRACE_HEADERS]
    return grpc.aio.Metadata(*kept, *extra.items())


def _traced_details(details: Any) -> Any:
    return details._replace(metadata=_with_trace(details.metadata))


# NOTE: two classes: grpc.aio files an interceptor under the first kind it is an instance of,
# so one object of both kinds would never see a server-streaming call (Decode).
class _AioUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_traced_details(client_call_details), request)


class _AioStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_traced_details(client_call_details), request)


class _Details(
    collections.namedtuple(
        "_Details",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _SyncClient(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    @staticmethod
    def _details(d: Any) -> _Details:
        extra = tracing.headers()
        metadata = [(k, v) for k, v in (d.metadata or ()) if k not in tracing.TRACE_HEADERS]
        metadata.extend(extra.items())
        return _Details(
            d.method,
            d.timeout,
            metadata,
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """The interceptors of a new asyncio channel: none while tracing is off."""
    return [_AioUnary(), _AioStream()] if tracing.enabled() else []


def intercept_sync(channel: grpc.Channel) -> grpc.Channel:
    """``channel``, putting the trace in each call's metadata while tracing is on."""
    return grpc.intercept_channel(channel, _SyncClient()) if tracing.enabled() else channel


class _Server(grpc.aio.ServerInterceptor):
    """Runs each call that carries a ``traceparent`` inside a SERVER span named after its
    method (``pdserve.v1.PrefillService/Prefill``), ended when the answer (or the stream) is
    done, with the error status when it fails; untraced calls run as they are."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        parent = tracing.extract(tuple(handler_call_details.invocation_metadata or ()))
        if parent is None:
            return handler
        name = handler_call_details.method.lstrip("/")
        attrs = {"rpc.system": "grpc", "rpc.method": name}

        def opened() -> Any:
            return tracing.span(name, attrs, kind=SpanKind.SERVER, parent=parent)

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with opened() as span:
                    result = inner(request, context)
                    result = await result if inspect.isawaitable(result) else result
                    _set_status(span, context)
                    return result

            return handler._replace(unary_unary=unary)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with opened() as span:
                    result = inner_stream(request, context)
                    if hasattr(result, "__aiter__"):
                        async for item in result:
                            yield item
                    else:  # a servicer that writes with context.write
                        await result
                    _set_status(span, context)

            return handler._replace(unary_stream=stream)
        return handler


def _set_status(span: Any, context: grpc.aio.ServicerContext) -> None:
    """A call that ended with an error status (aborted) marks its span an error."""
    code = context.code()
    if code not in (None, grpc.StatusCode.OK):
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {context.details() or ''}"))


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The interceptors of a new server: none while tracing is off."""
    return [_Server()] if tracing.enabled() else []
