"""Mooncake-compatible HTTP metadata endpoint, so Mooncake Transfer Engines can use pdserve's
meta as their metadata server (``metadata_server = "http://host:port/metadata"``).

Protocol (as Mooncake's own ``mooncake.http_metadata_server``): ``GET``/``PUT``/``DELETE``
``/metadata?key=<k>``; PUT bodies are JSON; GET returns the stored bytes (200) or 404
``metadata not found``. Unlike Mooncake's reference server, an existing ``rpc_meta`` key may be
overwritten, so a restarted engine can re-publish under its old name. Values go through the
meta backend (with etcd they survive a meta restart).

**Off unless asked for** (``http_metadata``): only Transfer Engines that take meta as their
metadata server need it, and pdserve's own store never does (its transports connect peer to
peer). ``pdserve up`` turns it on only for ``--store-backend mooncake
--store-metadata-server meta``; meta's HTTP port otherwise serves Prometheus discovery alone.

**Closed or authenticated whenever it is on.** Mooncake's client (libcurl in the Transfer
Engine) presents no client certificate and, in the pinned 0.3.13, no header of its own, so TLS
client authentication cannot guard it. Hence (:meth:`MetaConfig.validate
<pdserve.services.meta.server.MetaConfig.validate>`):

- On a loopback address it is closed to other hosts (``pdserve up``'s case).
- On any other address it needs ``http_token``; meta refuses to start without one unless
  ``http_metadata_open`` is given (or ``insecure`` on a cluster without TLS, where every port is
  open already). With the token, **every** request (GET too) must carry it: segment
  descriptors hold buffer addresses and, for RDMA, remote keys. ``Authorization: Bearer
  <token>`` (``MC_METADATA_HTTP_TOKEN`` in recent Mooncake versions), or the token as the
  password of URL credentials, ``http://pdserve:TOKEN@host:port/metadata``: libcurl sends
  those as Basic authentication on every request (tests/meta/test_mooncake_te.py moves bytes
  between two real engines that way). Compared in constant time. Mooncake logs that URL when a
  request fails, so the token can reach its logs. Any token holder may write any key: the
  protocol carries no identity, so there is no per-key ownership.
- **HTTPS**: with TLS configured the endpoint serves HTTPS with meta's certificate. It does
  not ask for client certificates (Mooncake's client presents none). libcurl checks meta's
  certificate against the host's trust store (Mooncake sets no CA file), so a Transfer Engine
  reaches an HTTPS meta only once the pdserve CA is installed there (e.g.
  ``update-ca-certificates``); untested here with a real engine.

**Bounds, whatever the address**, so no client can grow meta's memory (or etcd) without
limit: ``http_max_value_bytes`` per value (413; aiohttp stops reading a body past it),
``http_max_keys`` keys and ``http_max_total_bytes`` in all (507; overwriting a present key
within the total stays possible). The total is counted from the backend once, then kept by this
process: with several meta processes on one etcd, concurrent writers can pass the caps by what
the others wrote since.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import ssl
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve import identity
from pdserve.errors import PdserveError
from pdserve.services.meta.backends.base import Backend

if TYPE_CHECKING:  # aiohttp is imported when the endpoint starts, not with MetaConfig
    from aiohttp import web

    from pdserve.http_edge import EdgeLimits

PATH = "/metadata"
#: Default cap on one value (bytes): Mooncake segment descriptors are a few KiB, and
#: Mooncake's own server takes at most aiohttp's default of 1 MiB.
MAX_VALUE_BYTES = 1024 * 1024
#: Default cap on the number of keys (a Transfer Engine publishes a few).
MAX_KEYS = 4096
#: Default cap on the bytes of every value together: thousands of engines' descriptors, and a
#: bound on what anonymous writes on loopback can take.
MAX_TOTAL_BYTES = 64 * 1024 * 1024
_MAX_KEY = 1024
_HOW = (
    "send 'Authorization: Bearer <token>' (Mooncake: MC_METADATA_HTTP_TOKEN) or put the token "
    "in the metadata URL as http://pdserve:<token>@host:port/metadata"
)
_REALM = {"WWW-Authenticate": 'Bearer realm="pdserve-meta"'}


def _text(text: str, status: int, **headers: str) -> web.Response:
    from aiohttp import web

    return web.Response(text=text, status=status, content_type="application/json", headers=headers)


def token_problem(header: str | None, token: str) -> str:
    """Why an ``Authorization`` value does not carry ``token`` ("" = it does, or no token
    is set). Bearer carries the token; Basic carries it as the password."""
    if not token:
        return ""
    if not header:
        return f"the metadata endpoint takes the meta's http_token: {_HOW}"
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() == "bearer":
        given = value.strip()
    elif scheme.lower() == "basic":
        try:
            given = base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return "the Authorization header's Basic credentials are not base64 of user:token"
    else:
        return f"the Authorization header must be Bearer or Basic: {_HOW}"
    if not hmac.compare_digest(given.encode(), token.encode()):
        return "invalid metadata token"
    return ""


def make_app(
    backend: Backend,
    *,
    token: str = "",
    max_keys: int = MAX_KEYS,
    max_value_bytes: int = MAX_VALUE_BYTES,
    max_total_bytes: int = MAX_TOTAL_BYTES,
) -> web.Application:
    """An aiohttp app serving the protocol at :data:`PATH` from ``backend``, within the caps;
    with ``token`` every request must carry it."""
    import asyncio

    from aiohttp import web

    # bytes of every value stored, counted from the backend at the first write; PUTs run one
    # at a time, so two of them cannot both pass a cap
    used: list[int] = []
    writing = asyncio.Lock()

    async def handle(request: web.Request) -> web.Response:
        key = request.query.get("key", "").strip()
        if not key:
            return _text("metadata key is required (?key=<k>)", 400)
        if len(key) > _MAX_KEY:
            return _text(f"metadata key longer than {_MAX_KEY} characters", 400)
        why = token_problem(request.headers.get("Authorization"), token)
        if why:
            return _text(why, 401, **_REALM)
        try:
            if request.method == "GET":
                value = await backend.kv_get(key)
                if value is None:
                    return _text("metadata not found", 404)
                return web.Response(body=value, status=200, content_type="application/json")
            if request.method == "PUT":
                return await put(request, key)
            if request.method == "DELETE":
                async with writing:
                    old = await backend.kv_get(key)
                    if old is None or not await backend.kv_delete(key):
                        return _text("metadata not found", 404)
                    if used:
                        used[0] -= len(old)
                return _text("metadata deleted", 200)
        except PdserveError as exc:
            return _text(f"metadata backend error: {exc}", 503)
        return _text(f"method {request.method} not allowed (GET, PUT, DELETE)", 405)

    async def put(request: web.Request, key: str) -> web.Response:
        too_big = f"metadata value larger than http_max_value_bytes ({max_value_bytes} bytes)"
        if request.content_length is not None and request.content_length > max_value_bytes:
            return _text(too_big, 413)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked body without a length
            return _text(too_big, 413)
        try:
            json.loads(body)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            return _text(f"metadata body is not valid JSON: {exc}", 400)
        async with writing:
            if not used:
                used.append(await backend.kv_bytes())
            old = await backend.kv_get(key)
            if old is None and await backend.kv_count() >= max_keys:
                return _text(
                    f"metadata holds its http_max_keys ({max_keys}) keys: delete some or raise "
                    "http_max_keys",
                    507,
                )
            total = used[0] - len(old or b"") + len(body)
            if total > max_total_bytes:
                return _text(
                    f"metadata would hold {total} bytes, over its http_max_total_bytes "
                    f"({max_total_bytes} bytes): delete some or raise http_max_total_bytes",
                    507,
                )
            await backend.kv_put(key, body)
            used[0] = total
        return _text("metadata updated", 200)

    app = web.Application(client_max_size=max_value_bytes)
    app.router.add_route("*", PATH, handle)
    return app


def ssl_context(files: identity.TlsFiles) -> ssl.SSLContext:
    """Server-side TLS with the service's certificate, following its renewals; no client
    certificate asked for."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _, cert, key = files.paths
    ctx.load_cert_chain(Path(cert).expanduser(), Path(key).expanduser())
    return identity.renewing(ctx)


async def start(
    app: web.Application,
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None = None,
    limits: EdgeLimits | None = None,
) -> tuple[web.AppRunner, int]:
    """Serves ``app`` on the running loop (HTTPS with ``ssl_context``), each connection
    bounded as the router's HTTP port bounds its (:mod:`pdserve.http_edge`: a deadline for a
    request head and a TLS handshake, caps per address and in all); returns the runner and the
    bound port (``limits``: default :class:`~pdserve.http_edge.EdgeLimits`'s)."""
    from aiohttp import web

    from pdserve.http_edge import EdgeLimits, EdgeSite

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = EdgeSite(
        runner, host, port, limits or EdgeLimits(), ssl_context=ssl_context, access_log=None
    )
    await site.start()
    return runner, site.port
