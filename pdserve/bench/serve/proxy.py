"""The colocated baseline's round-robin proxy, a process of its own:
``python -m pdserve.bench.serve.proxy PORT BACKEND...``."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence


def proxy_main(port: int, backends: Sequence[str]) -> None:
    """Serves ``127.0.0.1:port``: each POST goes to the next backend in turn, every other
    request to the first; responses (SSE included) are streamed through unchanged."""
    import aiohttp
    from aiohttp import web

    turn = itertools.cycle(range(len(backends)))
    hop = {"content-length", "transfer-encoding", "connection", "content-encoding"}

    async def forward(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        backend = backends[next(turn)] if request.method == "POST" else backends[0]
        headers = {k: v for k, v in request.headers.items() if k.lower() == "content-type"}
        async with session.request(
            request.method, backend + request.path_qs, data=await request.read(), headers=headers
        ) as up:
            resp = web.StreamResponse(
                status=up.status,
                headers={k: v for k, v in up.headers.items() if k.lower() not in hop},
            )
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def on_startup(app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None)
        connector = aiohttp.TCPConnector(limit=0)
        app["session"] = aiohttp.ClientSession(timeout=timeout, connector=connector)

    async def on_cleanup(app: web.Application) -> None:
        await app["session"].close()

    app = web.Application()
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_route("*", "/{tail:.*}", forward)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


if __name__ == "__main__":
    proxy_main(int(sys.argv[1]), sys.argv[2:])
