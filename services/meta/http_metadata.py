"""Mooncake-compatible HTTP metadata endpoint, so Mooncake Transfer Engines can use pdserve's
meta as their metadata server (``metadata_server = "http://host:port/metadata"``).

Protocol (as Mooncake's own ``mooncake.http_metadata_server``): ``GET``/``PUT``/``DELETE``
``/metadata?key=<k>``; PUT bodies are JSON; GET returns the stored bytes (200) or 404
``metadata not found``. Unlike Mooncake's reference server, an existing ``rpc_meta`` key may be
overwritten, so a restarted engine can re-publish under its old name. Values go through the
meta backend (with etcd they survive a meta restart).
"""

from __future__ import annotations

import json

from aiohttp import web

from pdserve.errors import PdserveError
from pdserve.services.meta.backends.base import Backend

PATH = "/metadata"
#: Largest accepted PUT body (bytes); Mooncake segment descriptors are a few KiB.
MAX_BODY_BYTES = 4 * 1024 * 1024
_MAX_KEY = 1024


def _text(text: str, status: int) -> web.Response:
    return web.Response(text=text, status=status, content_type="application/json")


def make_app(backend: Backend) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        key = request.query.get("key", "").strip()
        if not key:
            return _text("metadata key is required (?key=<k>)", 400)
        if len(key) > _MAX_KEY:
            return _text(f"metadata key longer than {_MAX_KEY} characters", 400)
        try:
            if request.method == "GET":
                value = await backend.kv_get(key)
                if value is None:
                    return _text("metadata not found", 404)
                return web.Response(body=value, status=200, content_type="application/json")
            if request.method == "PUT":
                if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
                    return _text(f"metadata body larger than {MAX_BODY_BYTES} bytes", 413)
                body = await request.read()
                try:
                    json.loads(body)
                except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
                    return _text(f"metadata body is not valid JSON: {exc}", 400)
                await backend.kv_put(key, body)
                return _text("metadata updated", 200)
            if request.method == "DELETE":
                if not await backend.kv_delete(key):
                    return _text("metadata not found", 404)
                return _text("metadata deleted", 200)
        except PdserveError as exc:
            return _text(f"metadata backend error: {exc}", 503)
        return _text(f"method {request.method} not allowed (GET, PUT, DELETE)", 405)

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_route("*", PATH, handle)
    return app


async def start(backend: Backend, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serves the endpoint on the running loop; returns the runner and the bound port."""
    runner = web.AppRunner(make_app(backend), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host=host, port=port)
    await site.start()
    server = site._server
    bound = server.sockets[0].getsockname()[1] if server is not None else port
    return runner, bound
