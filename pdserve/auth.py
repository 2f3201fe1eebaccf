"""API keys of the public API: one key, presented as ``Authorization: Bearer KEY`` on HTTP
and as ``authorization: Bearer KEY`` gRPC metadata, compared in constant time.

Open without a key: the health checks (HTTP ``/health``, ``grpc.health.v1``), gRPC
reflection, and ``/metrics`` unless the service says otherwise.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

from pdserve.config import ConfigError

#: gRPC methods answered without a key (prefixes of the full method name).
OPEN_GRPC = ("/grpc.health.v1.Health/", "/grpc.reflection.")
HEADER = "authorization"
SCHEME = "Bearer "


def load_key(key: str, key_file: str, *, name: str = "api_key") -> str:
    """The configured secret: ``key``, or the first line of ``key_file`` ("" = none); errors
    name the config fields ``name`` and ``name_file``."""
    if key and key_file:
        raise ConfigError(f"give {name} or {name}_file, not both")
    if not key_file:
        return key
    try:
        lines = Path(key_file).expanduser().read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"{name}_file {key_file!r}: {exc.strerror or exc}") from exc
    if not lines or not lines[0].strip():
        raise ConfigError(f"{name}_file {key_file!r} is empty")
    return lines[0].strip()


def problem(header: str | None, key: str) -> str:
    """Why an ``Authorization`` value does not carry ``key`` ("" = it does)."""
    if not header:
        return "missing API key: send 'Authorization: Bearer <key>'"
    if not header.startswith(SCHEME):
        return "the Authorization header must be 'Bearer <key>'"
    if not hmac.compare_digest(header[len(SCHEME) :].strip().encode(), key.encode()):
        return "invalid API key"
    return ""


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata presenting ``key`` (none when it is empty)."""
    return ((HEADER, SCHEME + key),) if key else ()


class RequireKey(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED, before the handler runs, to calls without the key."""

    def __init__(self, key: str) -> None:
        self.key = key

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN_GRPC):
            return await continuation(handler_call_details)
        meta = dict(handler_call_details.invocation_metadata or ())
        why = problem(meta.get(HEADER), self.key)
        if not why:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None

        async def refuse(_request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        async def refuse_stream(_request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
            yield  # pragma: no cover - abort raises

        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                refuse_stream,
                request_deserializer=None,
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            refuse, request_deserializer=None, response_serializer=handler.response_serializer
        )
