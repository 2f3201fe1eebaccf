"""API keys of the public API: one key, or one per tenant, presented as ``Authorization: Bearer KEY`` on HTTP
and as ``authorization: Bearer KEY`` gRPC metadata, looked up by SHA-256 digest among the
configured keys (one, or a key per tenant: :mod:`pdserve.tenants`), which names the tenant.

Open without a key: the health checks (HTTP ``/health``, ``grpc.health.v1``), gRPC
reflection, and ``/metrics`` unless the service says otherwise.

Wrong keys are counted per client address and key, and over all addresses
(:class:`KeyFailures`): past a budget a wrong key is answered 429 / RESOURCE_EXHAUSTED with
Retry-After instead of 401; the right key is always served, from the same address too.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote

import grpc

from pdserve import tenants
from pdserve.config_fields import ConfigError
from pdserve.errors import PermissionDenied
from pdserve.tenants import Tenants

#: gRPC methods answered without a key (prefixes of the full method name).
OPEN_GRPC = ("/grpc.health.v1.Health/", "/grpc.reflection.")
HEADER = "authorization"
SCHEME = "Bearer "
WRONG_KEY = "invalid API key"
#: Most (client address, wrong key) pairs :class:`KeyFailures` tracks at once.
MAX_PEERS = 10_000
#: Wrong keys from all addresses together within a window before each is answered 429.
GLOBAL_LIMIT = 100

log = logging.getLogger(__name__)


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


def problem(header: str | None, keys: Tenants) -> tuple[str, str]:
    """``(why, tenant)``: why an ``Authorization`` value carries none of ``keys`` ("" = it
    does), and the tenant whose key it carries."""
    if not header:
        return "missing API key: send 'Authorization: Bearer <key>'", ""
    if not header.startswith(SCHEME):
        return "the Authorization header must be 'Bearer <key>'", ""
    tenant = keys.tenant_of(header[len(SCHEME) :].strip())
    return (WRONG_KEY, "") if tenant is None else ("", tenant)


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata presenting ``key`` (none when it is empty)."""
    return ((HEADER, SCHEME + key),) if key else ()


class KeyFailures:
    """Wrong API keys, counted per client address and key presented, and over all addresses
    together. A key is always compared, and a right one always served: wrong keys never lock
    out the right key, from the same address either (the users behind a NAT or a gateway share
    it). A wrong key past one of two budgets is answered 429 with Retry-After (gRPC
    RESOURCE_EXHAUSTED with ``retry-after``) instead of 401, so clients back off:

    - the same wrong key from one address more than ``limit`` times within ``window_s`` of its
      first (a client retrying with a stale key);
    - more than ``global_limit`` wrong keys from all addresses together within ``window_s`` of
      the first (guesses spread over many addresses, or many keys from one).

    Either is off at 0. Missing or malformed keys guess nothing and do not count. Guessing
    itself is defeated by the keys' length (tenant keys have 16+ characters, ``pdserve up``'s
    43), which the budgets cannot replace: refusing keys uncompared would refuse the right one
    too. Memory is bounded: at most ``max_peers`` (address, key) pairs, the oldest window
    forgotten first. One instance serves HTTP and gRPC alike (one event loop: no locking)."""

    def __init__(
        self,
        limit: int = 10,
        window_s: float = 60.0,
        *,
        global_limit: int = GLOBAL_LIMIT,
        max_peers: int = MAX_PEERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert limit >= 0 and global_limit >= 0 and window_s > 0 and max_peers > 0
        self.limit = limit
        self.global_limit = global_limit
        self.window_s = window_s
        self.max_peers = max_peers
        self.clock = clock
        #: (address, SHA-256 of the key) -> [window start, wrong keys in it], oldest first.
        self.windows: OrderedDict[tuple[str, bytes], list[float]] = OrderedDict()
        #: [window start, wrong keys in it] over all addresses.
        self.everyone: list[float] = [-math.inf, 0]

    def failed(self, peer: str, key: str) -> float:
        """Counts the wrong ``key`` that ``peer`` presented; returns the seconds until the
        window of a budget it passes ends (0: within both: answer 401)."""
        now = self.clock()
        wait = 0.0
        if self.limit:
            pair = (peer, hashlib.sha256(key.encode()).digest())
            window = self._count(pair, now)
            if window[1] == self.limit + 1:
                log.warning(
                    "%s presented the same wrong API key %d times within %.0f s: answered 429 "
                    "until the window ends",
                    peer,
                    self.limit + 1,
                    self.window_s,
                )
            if window[1] > self.limit:
                wait = window[0] + self.window_s - now
        if self.global_limit:
            every = self.everyone
            if now - every[0] >= self.window_s:
                every[:] = [now, 0]
            every[1] += 1
            if every[1] == self.global_limit + 1:
                log.warning(
                    "%d wrong API keys within %.0f s from all addresses (the last from %s): "
                    "wrong keys are answered 429 until the window ends",
                    self.global_limit + 1,
                    self.window_s,
                    peer,
                )
            if every[1] > self.global_limit:
                wait = max(wait, every[0] + self.window_s - now)
        return wait

    def _count(self, pair: tuple[str, bytes], now: float) -> list[float]:
        """``pair``'s window with one more wrong key (a new window if its own has ended)."""
        window = self.windows.get(pair)
        if window is None or now - window[0] >= self.window_s:
            self.windows.pop(pair, None)
            while len(self.windows) >= self.max_peers:
                self.windows.popitem(last=False)
            window = self.windows[pair] = [now, 0]
        window[1] += 1
        return window


def refusal(
    header: str | None, keys: Tenants, peer: str, failures: KeyFailures | None
) -> tuple[str, float]:
    """Why a call from ``peer`` whose ``Authorization`` is ``header`` is refused: ``("", 0)``
    it is not (and :data:`pdserve.tenants.current` names its tenant from here on); ``(why,
    0)`` no or a wrong key (HTTP 401, UNAUTHENTICATED); ``(why, s)`` with ``s > 0``: a wrong
    key past a budget of ``failures``; try again in ``s`` seconds (HTTP 429 with Retry-After,
    RESOURCE_EXHAUSTED). A right key is never refused."""
    why, tenant = problem(header, keys)
    if not why:
        tenants.current.set(tenant)
        return "", 0.0
    if why == WRONG_KEY and failures is not None and header is not None:
        wait = failures.failed(peer, header[len(SCHEME) :].strip())
        if wait > 0:
            return f"too many wrong API keys: try again in {math.ceil(wait)} s", wait
    return why, 0.0


def grpc_peer_host(peer: str) -> str:
    """The address in a gRPC peer string (``ipv4:10.0.0.1:5000`` -> ``10.0.0.1``,
    ``ipv6:[::1]:5000`` or ``ipv6:%5B::1%5D:5000`` -> ``::1``); other forms as they are."""
    kind, _, rest = unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6") or ":" not in rest:
        return peer
    return rest.rsplit(":", 1)[0].strip("[]")


class TenantHeader(Protocol):
    """A trusted gateway's tenant header (services/router/gateway.py's ``Gateway``)."""

    #: The header's name (lowercase, as gRPC metadata).
    header: str

    def grpc_tenant(self, metadata: Mapping[str, str], peer: str, auth: Mapping) -> str | None:
        """The tenant the call's metadata names (None: it names none); PermissionDenied when
        the header comes from no trusted gateway or names no tenant."""
        ...


class RequireKey(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to calls without the key, and RESOURCE_EXHAUSTED to a wrong key
    past a budget of ``failures``. Guards unary-request methods (all pdserve has); refuses
    others outright. With ``gateway``, a call whose metadata names a tenant in its header is
    that tenant's without a key when it comes from a trusted gateway, and PERMISSION_DENIED
    otherwise (after its request is read: the peer decides).

    A call refused on its key is answered before its request message is read: its handler
    takes a request stream, which it never reads, instead of the whole message gRPC reads
    first for a unary request (measured: 15 MiB a keyless call; now at most a flow-control
    window). Accepted calls keep their unary handlers (and their traces)."""

    def __init__(
        self,
        keys: Tenants,
        failures: KeyFailures | None = None,
        gateway: TenantHeader | None = None,
    ) -> None:
        self.keys = keys
        self.failures = failures
        self.gateway = gateway

    async def _gate(self, context: grpc.aio.ServicerContext) -> None:
        """Aborts the call unless it carries the key or a trusted gateway's tenant (the peer
        known only here, not to the interceptor)."""
        meta = dict(context.invocation_metadata() or ())
        peer = grpc_peer_host(context.peer() or "")
        if self.gateway is not None:
            try:
                tenant = self.gateway.grpc_tenant(meta, peer, context.auth_context())
            except PermissionDenied as exc:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            if tenant is not None:
                tenants.current.set(tenant)
                return
        why, wait = refusal(meta.get(HEADER), self.keys, peer, self.failures)
        if wait:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                why,
                trailing_metadata=(("retry-after", str(math.ceil(wait))),),
            )
        if why:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_GRPC):
            return handler
        if handler.unary_unary is None and handler.unary_stream is None:
            raise TypeError(f"{handler_call_details.method}: RequireKey guards unary requests only")
        gate = self._gate
        if self._refused(handler_call_details.invocation_metadata):

            async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
                await gate(context)  # aborts: no or a wrong key (counted), the request unread
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, WRONG_KEY)

            make = (
                grpc.stream_stream_rpc_method_handler
                if handler.unary_stream is not None
                else grpc.stream_unary_rpc_method_handler
            )
            return make(refuse, response_serializer=handler.response_serializer)
        parse = handler.request_deserializer or (lambda raw: raw)

        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(raw: bytes, context: grpc.aio.ServicerContext):
                await gate(context)
                async for item in inner_stream(parse(raw), context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=None, response_serializer=handler.response_serializer
            )
        inner = handler.unary_unary

        async def unary(raw: bytes, context: grpc.aio.ServicerContext):
            await gate(context)
            result = inner(parse(raw), context)
            return await result if inspect.isawaitable(result) else result

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=None, response_serializer=handler.response_serializer
        )

    def _refused(self, metadata: Any) -> bool:
        """Whether a call with ``metadata`` is refused on its key alone: no or a wrong key,
        and no gateway's tenant header (whose verdict needs the peer)."""
        meta = dict(metadata or ())
        if self.gateway is not None and self.gateway.header in meta:
            return False
        return bool(problem(meta.get(HEADER), self.keys)[0])
