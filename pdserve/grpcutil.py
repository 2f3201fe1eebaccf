"""The one place gRPC servers and channels are made.

Every server gets explicit message-size limits, the connection limits of
:mod:`pdserve.grpc_limits` (a first-frame deadline, a cap on open connections),
grpc.health.v1, reflection and the error mapping of :mod:`pdserve.errors`. With the process's
TLS set (:func:`pdserve.identity.configure`) every server requires, and every channel
presents, a certificate from the cluster's CA (mutual TLS); a public server (the router's API)
takes its own optional server-only TLS instead.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Counter

from pdserve import grpc_limits, identity, reloading, tracing_grpc
from pdserve.errors import RateLimited, status_for
from pdserve.telemetry import REGISTRY

log = logging.getLogger(__name__)

#: Default cap on one gRPC message (bytes). Payload bytes never travel in protobuf, so
#: control messages stay far below it; larger messages are rejected with RESOURCE_EXHAUSTED.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


#: Seconds between keepalive pings on every channel (with calls or not).
KEEPALIVE_S = 10
#: Seconds a ping may go unanswered before the connection is dropped (generous: a process
#: on a starved core, or stopped for seconds, still answers within it).
PING_TIMEOUT_S = 10


def _options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # A peer that vanishes without a reset (a killed container, a cut link, a frozen
        # process) is noticed within KEEPALIVE_S + PING_TIMEOUT_S and its calls fail
        # UNAVAILABLE, so the router resumes a stream elsewhere instead of waiting on it.
        # gRPC (1.85) waits for a ping's answer ``ping_timeout_ms`` (default 60 s), not
        # ``keepalive_timeout_ms`` alone: both are set (measured: 80 s with the latter only).
        ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
        ("grpc.keepalive_timeout_ms", PING_TIMEOUT_S * 1000),
        ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_S * 1000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


#: Servers accept the keepalive pings of the clients above (every KEEPALIVE_S, calls or
#: not; half that is allowed, for timer jitter). gRPC's default allows one every 5 minutes on
#: a connection without calls and answers the third sooner with GOAWAY "too_many_pings":
#: every idle channel was dropped after a minute.
_SERVER_OPTIONS = [("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_S * 500)]


@dataclass
class Server:
    """A started gRPC server with its health servicer."""

    server: grpc.aio.Server
    host: str
    port: int
    health: health.HealthServicer

    @property
    def address(self) -> str:
        """Where clients reach it: the bound host, or 127.0.0.1 for a wildcard bind."""
        host = "127.0.0.1" if self.host in ("", "0.0.0.0", "[::]", "::") else self.host
        return f"{host}:{self.port}"

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.health.set("", status)

    async def stop(self, grace: float = 5.0) -> None:
        self.set_serving(False)
        await self.server.stop(grace)


class _Malformed:
    """What a request that does not parse becomes, so the handler can refuse it."""

    def __init__(self, message: str) -> None:
        self.message = message


#: Every call a gRPC server of this process handled, and the seconds its handler took, by
#: method (the time of a streaming call is until its last message): which service is busy
#: with what, e.g. a KV master's calls per request served.
SERVER_CALLS = Counter(
    "pdserve_grpc_server_calls_total",
    "calls this process's gRPC servers handled, by full method name",
    ["method"],
    registry=REGISTRY,
)
SERVER_SECONDS = Counter(
    "pdserve_grpc_server_seconds_total",
    "seconds this process's gRPC handlers took (streams: to their last message), by method",
    ["method"],
    registry=REGISTRY,
)


class _Handled(grpc.aio.ServerInterceptor):
    """Wraps each pdserve handler: answers INVALID_ARGUMENT, with what failed, to request
    bytes that do not parse as the method's message (grpc would answer UNKNOWN or INTERNAL),
    and counts the call and its time (:data:`SERVER_CALLS`, :data:`SERVER_SECONDS`). Unary
    requests only: every pdserve method takes one request message."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = handler_call_details.method

        def safe_parse(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as exc:
                return _Malformed(f"{method}: the request is not a valid message: {exc}")

        calls, seconds = SERVER_CALLS.labels(method), SERVER_SECONDS.labels(method)

        def counted(start: float) -> None:
            calls.inc()
            seconds.inc(time.perf_counter() - start)

        async def check(request: Any, context: grpc.aio.ServicerContext) -> None:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                start = time.perf_counter()
                try:
                    await check(request, context)
                    result = inner(request, context)
                    return await result if inspect.isawaitable(result) else result
                finally:
                    counted(start)

            return grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=safe_parse,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                start = time.perf_counter()
                try:
                    await check(request, context)
                    result = inner_stream(request, context)
                    if hasattr(result, "__aiter__"):
                        async for item in result:
                            yield item
                    elif inspect.isawaitable(result):
                        await result
                    else:
                        for item in result:
                            yield item
                finally:
                    counted(start)

            return grpc.unary_stream_rpc_method_handler(
                stream,
                request_deserializer=safe_parse,
                response_serializer=handler.response_serializer,
            )
        return handler


async def start_server(
    servicers: Sequence[tuple[Callable[[Any, grpc.aio.Server], None], Any, str]],
    address: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    public_tls: tuple[bytes, bytes] | None = None,
    public_client_ca: bytes = b"",
    limits: grpc_limits.ConnectionLimits | None = None,
) -> Server:
    """Starts a grpc.aio server on ``address`` ("host:port", port 0 = any free port).

    ``servicers`` holds ``(add_XServicer_to_server, servicer, full service name)`` triples;
    ``interceptors`` run before pdserve's own (e.g. :class:`pdserve.auth.RequireKey`).
    An internal server is mutual TLS when the process has TLS; a public one (``public_tls``
    given: ``(cert PEM, key PEM)``, or ``(b"", b"")`` for plaintext) asks no client certificate
    unless ``public_client_ca`` (PEM) is given: then it requires one signed by that CA (the
    router's trusted gateways, services/router/gateway.py). NOTE: Python's gRPC cannot ask for
    an optional one: without ``require_client_auth`` it asks for none (measured: the auth
    context held no certificate though the client had one). ``limits``: the connections'
    deadline and cap (default: the process's, :func:`pdserve.grpc_limits.configure`).
    """
    limits = limits or grpc_limits.limits()
    options = [*_options(max_message_bytes), *_SERVER_OPTIONS, *limits.options()]
    # first: a refused call is in the trace too (but not one auth.RequireKey refuses on its
    # key: answered unread, by a request-streaming handler tracing_grpc does not wrap)
    traced = tracing_grpc.server_interceptors()
    server = grpc.aio.server(options=options, interceptors=[*traced, *interceptors, _Handled()])
    names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
    for add, servicer, name in servicers:
        add(servicer, server)
        names.append(name)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(names, server)
    port = _add_port(server, address, public_tls, public_client_ca)
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    await server.start()
    for name in names:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return Server(server, address.rsplit(":", 1)[0], port, health_servicer)


def _add_port(
    server: grpc.aio.Server,
    address: str,
    public_tls: tuple[bytes, bytes] | None,
    client_ca: bytes = b"",
) -> int:
    if public_tls is not None:
        cert, key = public_tls
        if not cert:
            return server.add_insecure_port(address)
        creds = grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca or None, require_client_auth=bool(client_ca)
        )
        return server.add_secure_port(address, creds)
    files = identity.tls()
    if files is None:
        return server.add_insecure_port(address)
    served = [identity.generation()]

    def config(files: identity.TlsFiles) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(files.key, files.cert)], root_certificates=files.ca
        )

    def renewed() -> grpc.ServerCertificateConfiguration | None:
        """gRPC asks at each handshake: the renewed certificate once there is one."""
        files, generation = identity.tls(), identity.generation()
        if files is None or generation == served[0]:
            return None
        served[0] = generation
        return config(files)

    creds = grpc.dynamic_ssl_server_credentials(
        config(files), renewed, require_client_authentication=True
    )
    return server.add_secure_port(address, creds)


def _credentials(public: bool | bytes) -> grpc.ChannelCredentials | None:
    """mTLS with the process's files; for a public server (the router's API) none, or
    server-only TLS against the CA given as ``public`` (PEM bytes)."""
    if public is True:
        return None
    if public:
        return grpc.ssl_channel_credentials(root_certificates=public)
    files = identity.tls()
    if files is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=files.ca, private_key=files.key, certificate_chain=files.cert
    )


#: Client-side reconnect backoff: gRPC's default starts at 1 s and grows to minutes, longer
#: than a heartbeat interval; pdserve peers restart and must be found again quickly. NOTE:
#: ``grpc.min_reconnect_backoff_ms`` is not set: gRPC takes it as the minimum time one
#: connection attempt may take (default 20 s). Set to 100 ms, an attempt whose TCP and TLS
#: handshake took longer on a busy machine was cut off, again and again ("connection attempt
#: timed out before receiving SETTINGS frame"), and a worker's store stayed out of reach.
#: A refused connection still fails at once, so a restarted peer is found within 300 ms.
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 300),
]


def channel(
    address: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    public: bool | bytes = False,
    server_name: str = "",
    role: str = "",
) -> grpc.aio.Channel:
    """An asyncio channel to ``address`` with the same limits as the servers and fast
    reconnects; mutual TLS when the process has TLS. ``public``: the server is a public API
    (the router's): True = plaintext, PEM bytes = TLS checked against that CA.
    ``server_name``: with TLS, the server must present the certificate issued to that
    identity name (a pdserve certificate carries its name; ``pdserve certs``), not merely any
    certificate of the cluster valid for the address; ``role``: likewise, any certificate of
    that role (``pdserve certs`` gives each :func:`identity.role_name`). ``address`` may list several servers of
    which one serves at a time (``host:port,host:port``: the KV masters of an HA setup):
    :mod:`pdserve.failover` sends each call to the one that answers."""
    if "," in address:  # every KV master of an HA setup: calls follow the one that serves
        from pdserve import failover

        def one(name: str) -> grpc.aio.Channel:
            return channel(name, max_message_bytes=max_message_bytes, public=public, role=role)

        return failover.AioFailoverChannel(failover.addresses(address), one)  # type: ignore[return-value]
    options = [*_options(max_message_bytes), *_RECONNECT_OPTIONS]
    traced = tracing_grpc.client_interceptors()  # the request's trace in each call's metadata
    creds = _credentials(public)
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=traced)
    expect = server_name or (identity.role_name(role) if role else "")
    if expect:
        options.append(("grpc.ssl_target_name_override", expect))
    if public:  # a public server's CA: no certificate of ours to renew
        return grpc.aio.secure_channel(address, creds, options=options, interceptors=traced)
    return reloading.AioReloadingChannel(  # type: ignore[return-value]
        lambda: grpc.aio.secure_channel(
            address, _credentials(False), options=options, interceptors=traced
        )
    )


def sync_channel(
    address: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    public: bool | bytes = False,
    role: str = "",
) -> grpc.Channel:
    """A blocking channel, for CLIs and code outside an event loop (``public`` and a list of
    addresses as for :func:`channel`)."""
    if "," in address:  # as for channel()
        from pdserve import failover

        def one(name: str) -> grpc.Channel:
            return sync_channel(name, max_message_bytes=max_message_bytes, public=public, role=role)

        return failover.SyncFailoverChannel(failover.addresses(address), one)  # type: ignore[return-value]
    options = [*_options(max_message_bytes), *_RECONNECT_OPTIONS]
    traced = tracing_grpc.intercept_sync  # the request's trace in each call's metadata
    creds = _credentials(public)
    if creds is None:
        return traced(grpc.insecure_channel(address, options=options))
    if role:
        options.append(("grpc.ssl_target_name_override", identity.role_name(role)))
    if public:
        return traced(grpc.secure_channel(address, creds, options=options))
    return reloading.SyncReloadingChannel(  # type: ignore[return-value]
        lambda: traced(grpc.secure_channel(address, _credentials(False), options=options))
    )


async def check_health(address: str, timeout: float = 2.0, public: bool | bytes = False) -> bool:
    """True when the server at ``address`` answers SERVING (``public`` as for :func:`channel`)."""
    async with channel(address, public=public) as ch:
        try:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING


#: Longest status message sent (characters). gRPC carries it percent-encoded in a trailer,
#: and a client drops a status whose metadata passes its limit (8-16 KiB): it then sees
#: RESOURCE_EXHAUSTED "received metadata size exceeds ..." instead. Messages that echo a
#: hostile value (a megabyte-long model name or lease id) are cut to fit (at most 4 UTF-8
#: bytes a character, 3 encoded characters a byte: about 6 KiB).
MAX_ERROR_CHARS = 512


def error_status(exc: BaseException, name: str) -> tuple[grpc.StatusCode, str]:
    """The status and message an error raised by the handler ``name`` answers with (gRPC
    and the KV master's control wire alike); an INTERNAL one is logged with its traceback."""
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("unhandled error in %s", name, exc_info=exc)
        message = f"internal error in {name}: {type(exc).__name__}: {exc}"
    else:
        message = str(exc) or type(exc).__name__
    if len(message) > MAX_ERROR_CHARS:
        message = f"{message[:MAX_ERROR_CHARS]}... ({len(message)} characters)"
    return code, message


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, name: str) -> None:
    """Ends the call with ``exc``'s status; a rate limit adds the trailing metadata
    ``retry-after`` (whole seconds, :class:`pdserve.errors.RateLimited`)."""
    if isinstance(exc, RateLimited):
        trailing = (("retry-after", exc.retry_after),)
        await context.abort(*error_status(exc, name), trailing_metadata=trailing)
    await context.abort(*error_status(exc, name))


def rpc(method: Callable) -> Callable:
    """Decorates a servicer method (unary or server-streaming) so that exceptions become gRPC
    statuses via :func:`pdserve.errors.status_for`."""
    name = method.__qualname__
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext):
            try:
                # aclosing: when the client cancels, the wrapper is closed at its yield; close
                # the service's generator right away too so it frees its resources now, not at
                # garbage collection.
                async with contextlib.aclosing(method(self, request, context)) as items:
                    async for item in items:
                        yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort(context, exc, name)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, name)

    return unary_wrapper
