"""A fake OpenAI completions server for the bench client's tests: ``handler`` answers
``POST /v1/completions`` on a free 127.0.0.1 port, in the running loop."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any


async def serve_completions(handler: Callable[[Any], Awaitable[Any]]) -> tuple[Any, str]:
    """(the aiohttp runner to clean up, the server's base URL)."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"
