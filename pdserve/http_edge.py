"""HTTP connections of pdserve's aiohttp servers (the router's OpenAI API, meta's Mooncake
metadata endpoint), limited at the protocol level, where aiohttp has no header
timeout of its own (its keep-alive timer is an hour): a connection must deliver a complete
request head (request line and headers) within ``header_timeout_s`` of opening or of its
previous response, so an idle kept-alive connection lasts that long too; a request's body must
arrive in full within ``body_timeout_s`` of its head; else the connection is closed, without an
answer. One client address holds at most ``max_per_peer`` open connections: a further one is
answered 429 and closed at once, unread, while other addresses are served; all addresses
together hold at most ``max_connections`` (never above a quarter of the process's
file-descriptor limit, the gRPC ports taking up to half): a further one is answered 503 and
closed at once. A client that sends part of a request and stalls thus holds a file descriptor
for seconds, one address cannot take them all, and many addresses cannot take the process's.
The listening socket's accept queue is :data:`BACKLOG` (aiohttp's 128 overflowed under a burst
of connections, and a dropped SYN cost a new client a 1 s retransmission).

NOTE: :class:`EdgeHandler` reads three fields of aiohttp's ``RequestHandler``
(``_request_count``, ``_messages``, ``_request_in_progress``): tests/router/test_edge_limits.py
drives it over real sockets, so an aiohttp that renames them fails there, not in production.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EdgeLimits:
    """What an HTTP connection may take (the router's ``http_*`` fields; meta's endpoint
    takes these defaults)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    #: Open connections per client address (0 = no cap).
    max_per_peer: int = 128
    #: Open connections from all addresses together (0 = no cap; see :func:`total_cap`).
    max_connections: int = 4096


#: The HTTP port's accept queue (the kernel caps it at net.core.somaxconn), as gRPC core's.
BACKLOG = 4096


def total_cap(max_connections: int) -> int:
    """The cap on all open HTTP connections applied: ``max_connections``, at most a quarter
    of the file-descriptor limit (0 = none)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if not max_connections or soft == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, soft // 4))


class PeerConnections:
    """Open connections per client address, at most ``cap`` each, and at most ``total_cap``
    from all together (0 = no cap). Holds only addresses with a connection open, so its size
    is bounded by the open connections."""

    def __init__(self, cap: int, total_cap: int = 0) -> None:
        self.cap = cap
        self.total_cap = total_cap
        self.total = 0
        self.open: dict[str, int] = {}

    def refusal(self, peer: str) -> bytes | None:
        """Counts a new connection of ``peer`` and returns None; or, when ``peer`` or all
        together are at their cap, the whole answer to send before closing it (not counted)."""
        if self.total_cap and self.total >= self.total_cap:
            return FULL
        n = self.open.get(peer, 0)
        if self.cap and n >= self.cap:
            return TOO_MANY
        self.open[peer] = n + 1
        self.total += 1
        return None

    def admit(self, peer: str) -> bool:
        """:meth:`refusal` as a yes or no."""
        return self.refusal(peer) is None

    def release(self, peer: str) -> None:
        """One of ``peer``'s connections closed."""
        self.total -= 1
        n = self.open[peer] - 1
        if n:
            self.open[peer] = n
        else:
            del self.open[peer]


def _refusal(status: str, message: str, kind: str, code: str) -> bytes:
    """The whole answer to a connection refused at a cap (OpenAI's error shape)."""
    error = {"message": message, "type": kind, "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


#: The answer to a connection over its address's cap.
TOO_MANY = _refusal(
    "429 Too Many Requests",
    "too many open connections from this address: close some and retry",
    "rate_limit_error",
    "rate_limit_exceeded",
)
#: The answer to a connection over the cap of all addresses together.
FULL = _refusal(
    "503 Service Unavailable",
    "the server is at its open connections limit: retry shortly",
    "server_error",
    "service_unavailable",
)


class EdgeHandler(RequestHandler):
    """aiohttp's connection protocol plus :class:`EdgeLimits`: one timer per connection,
    armed for the next request head (at opening and after each response) or for the body of
    the head just parsed, and the per-address count."""

    def __init__(
        self, manager: web.Server, *, limits: EdgeLimits, peers: PeerConnections, **kwargs: Any
    ) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._peers = peers
        #: The client address once admitted (None: refused, or closed).
        self._peer: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        #: The body the timer waits for (None: it waits for a head).
        self._body: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if peername else ""
        answer = self._peers.refusal(peer)
        if answer is not None:
            log.debug("HTTP connection of %s refused at a cap (%s)", peer, answer[9:12].decode())
            assert isinstance(transport, asyncio.WriteTransport)
            transport.write(answer)
            transport.close()  # aiohttp never sees this connection
            return
        self._peer = peer
        super().connection_made(transport)
        self._expect_head()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._peer is None:
            return
        self._peers.release(self._peer)
        self._peer = None
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        heads = self._request_count
        super().data_received(data)
        if self._request_count != heads and self._messages:  # a request head is complete
            body = self._messages[-1][1]
            if body.is_eof():
                self._disarm()  # its response re-arms for the next head
            else:
                self._arm(self._limits.body_timeout_s, self._body_late)
                self._body = body

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        out = await super().finish_response(request, resp, start_time)
        if self._peer is not None and (self._body is None or self._body.is_eof()):
            self._expect_head()  # else the body still on its way keeps its deadline
        return out

    def _expect_head(self) -> None:
        self._arm(self._limits.header_timeout_s, self._head_late)

    def _head_late(self) -> None:
        self._timer = None
        if self._messages or self._request_in_progress:
            return  # a head came after all; its response re-arms
        log.debug("%s sent no complete request head in time: closed", self._peer)
        self.force_close()

    def _body_late(self) -> None:
        self._timer = None
        if self._body is not None and not self._body.is_eof():
            log.debug("%s sent no complete request body in time: closed", self._peer)
            self.force_close()

    def _arm(self, delay: float, late: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self._loop.call_later(delay, late)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._body = None


class EdgeSite(web.BaseSite):
    """A TCP site (as ``web.TCPSite``) whose connections are :class:`EdgeHandler` under
    ``limits``; a TLS handshake gets ``header_timeout_s`` too. ``handler_args`` go to
    aiohttp's ``RequestHandler`` (``access_log``, ...)."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        limits: EdgeLimits,
        *,
        ssl_context: ssl.SSLContext | None = None,
        **handler_args: Any,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=BACKLOG)
        self._host = host
        self._port = port
        self.limits = limits
        self.peers = PeerConnections(limits.max_per_peer, total_cap(limits.max_connections))
        self._handler_args = handler_args

    @property
    def port(self) -> int:
        """The bound port (``port`` 0 binds a free one)."""
        assert self._server is not None, "start the site first"
        return self._server.sockets[0].getsockname()[1]

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        manager = self._runner.server
        assert manager is not None

        def handler() -> EdgeHandler:
            return EdgeHandler(
                manager, loop=loop, limits=self.limits, peers=self.peers, **self._handler_args
            )

        self._server = await loop.create_server(
            handler,
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            ssl_handshake_timeout=self.limits.header_timeout_s if self._ssl_context else None,
        )
