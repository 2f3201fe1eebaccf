"""The router's edge limits: HTTP header and body timeouts and the per-address connection cap
(pdserve/http_edge.py, over real sockets), the wrong-API-key limiter
(pdserve/auth.py KeyFailures, over HTTP and gRPC), and Tokenize's size rule."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import threading
import time

import aiohttp
import grpc
import pytest
from aiohttp import web
from router_fakes import FakeDecode, FakePrefill, fake_cluster

from pdserve import auth, http_edge
from pdserve.config import ConfigError
from pdserve.http_edge import EdgeLimits, EdgeSite, PeerConnections
from pdserve.services.router.config import RouterConfig
from pdserve.v1 import router_pb2, router_pb2_grpc

KEY = "s3cret-key"
#: Short enough for a fast test, long enough for a loaded 2-core machine to send a request.
TIMEOUT = 0.5
#: How long a test waits for the server to close a connection it should close.
CLOSED_WITHIN = 5.0


# --- peers -----------------------------------------------------------------------------------


def test_grpc_peer_host():
    assert auth.grpc_peer_host("ipv4:10.1.2.3:50051") == "10.1.2.3"
    assert auth.grpc_peer_host("ipv6:[::1]:50051") == "::1"
    assert auth.grpc_peer_host("ipv6:%5B::1%5D:50051") == "::1"
    assert auth.grpc_peer_host("unix:/tmp/sock") == "unix:/tmp/sock"


def test_peer_connections_cap_and_release():
    peers = PeerConnections(2)
    assert peers.admit("a") and peers.admit("a") and not peers.admit("a")
    assert peers.admit("b")
    peers.release("a")
    assert peers.admit("a")
    for _ in range(2):
        peers.release("a")
    assert peers.open == {"b": 1}
    assert all(PeerConnections(0).admit("a") for _ in range(1000))  # 0 = no cap


def test_peer_connections_total_cap_refuses_every_address_with_503():
    peers = PeerConnections(2, total_cap=3)
    assert peers.refusal("a") is None and peers.refusal("a") is None
    assert peers.refusal("a") is http_edge.TOO_MANY  # a's own cap first
    assert peers.refusal("b") is None and peers.total == 3
    assert peers.refusal("c") is http_edge.FULL  # all together at 3: refused, not counted
    assert peers.open == {"a": 2, "b": 1}
    peers.release("a")
    assert peers.total == 2 and peers.admit("c")
    assert http_edge.FULL.startswith(b"HTTP/1.1 503 ") and b"service_unavailable" in http_edge.FULL
    assert b"Retry-After: 1" in http_edge.FULL and b"Connection: close" in http_edge.FULL


def test_total_cap_is_at_most_a_quarter_of_the_descriptor_limit(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (1024, 20000))
    assert http_edge.total_cap(4096) == 256
    assert http_edge.total_cap(100) == 100
    assert http_edge.total_cap(0) == 0  # no cap
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (resource.RLIM_INFINITY,) * 2)
    assert http_edge.total_cap(4096) == 4096


def test_config_checks_the_limits():
    for bad in (
        {"http_header_timeout_s": 0},
        {"http_body_timeout_s": -1},
        {"http_max_conns_per_peer": -1},
        {"http_max_connections": -1},
        {"api_key_failures": -1},
        {"api_key_failures_global": -1},
        {"api_key_failure_window_s": 0},
    ):
        with pytest.raises(ConfigError):
            RouterConfig(decode=["127.0.0.1:1"], **bad).validate()


# --- HTTP connections over real sockets -----------------------------------------------------


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def slow(request: web.Request) -> web.Response:
    await asyncio.sleep(3 * TIMEOUT)  # longer than the header timeout: a response is not cut
    return web.Response(text="slow")


async def echo(request: web.Request) -> web.Response:
    return web.Response(body=await request.read())


class Edge:
    """A small aiohttp app behind an EdgeSite on 127.0.0.1, a free port."""

    def __init__(self, limits: EdgeLimits) -> None:
        self.limits = limits

    async def __aenter__(self) -> Edge:
        app = web.Application()
        app.router.add_get("/ok", ok)
        app.router.add_get("/slow", slow)
        app.router.add_post("/echo", echo)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        self.site = EdgeSite(self.runner, "127.0.0.1", 0, self.limits, access_log=None)
        await self.site.start()
        self.url = f"http://127.0.0.1:{self.site.port}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()

    async def raw(self, data: bytes = b"", source: str = "127.0.0.1"):
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", self.site.port, local_addr=(source, 0)
        )
        if data:
            writer.write(data)
            await writer.drain()
        return reader, writer

    async def get(self, path: str = "/ok", source: str = "127.0.0.1") -> tuple[int, str]:
        connector = aiohttp.TCPConnector(local_addr=(source, 0))
        async with (
            aiohttp.ClientSession(self.url, connector=connector) as http,
            http.get(path) as resp,
        ):
            return resp.status, await resp.text()


async def closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes (fails if it does not in time); b"" when
    the close broke a write of ours."""
    try:
        return await asyncio.wait_for(reader.read(), CLOSED_WITHIN)
    except ConnectionError:
        return b""


async def until(condition) -> None:
    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_partial_heads_and_silent_connections_are_closed_while_others_are_served():
    async def main():
        limits = EdgeLimits(header_timeout_s=TIMEOUT, body_timeout_s=TIMEOUT, max_per_peer=0)
        async with Edge(limits) as edge:
            t0 = time.monotonic()
            partial = [await edge.raw(b"GET /ok HTTP/1.1\r\nHost: x\r\nX-A: ") for _ in range(20)]
            silent = await edge.raw()
            trickle = await edge.raw(b"GET /ok HTTP/1.1\r\n")

            async def drip() -> None:  # a header line every so often: no deadline reset
                with contextlib.suppress(ConnectionError):
                    for i in range(30):
                        await asyncio.sleep(TIMEOUT / 5)
                        trickle[1].write(b"X-%d: y\r\n" % i)

            dripping = asyncio.ensure_future(drip())
            assert await edge.get() == (200, "ok")  # others are served meanwhile
            assert await edge.get("/slow") == (200, "slow")  # past the timeout: not cut
            for reader, _ in [*partial, silent, trickle]:
                assert await closed(reader) == b""
            assert time.monotonic() - t0 < CLOSED_WITHIN
            await until(lambda: edge.site.peers.open == {})
            dripping.cancel()
            for _, writer in [*partial, silent, trickle]:
                writer.close()

    asyncio.run(main())


def test_a_kept_alive_connection_serves_requests_then_closes_when_idle():
    async def main():
        async with Edge(EdgeLimits(header_timeout_s=TIMEOUT, max_per_peer=0)) as edge:
            reader, writer = await edge.raw()
            for _ in range(3):  # each request within the timeout of the previous response
                writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CLOSED_WITHIN)
                assert head.startswith(b"HTTP/1.1 200")
                assert await reader.readexactly(2) == b"ok"
                await asyncio.sleep(TIMEOUT / 5)
            assert await closed(reader) == b""  # idle past the timeout
            writer.close()

    asyncio.run(main())


def test_a_stalled_body_is_closed_a_whole_one_answered():
    async def main():
        limits = EdgeLimits(header_timeout_s=TIMEOUT, body_timeout_s=TIMEOUT, max_per_peer=0)
        async with Edge(limits) as edge:
            head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
            stalled, writer = await edge.raw(head + b"x" * 10)
            whole, writer2 = await edge.raw(head + b"y" * 100)
            answer = await asyncio.wait_for(whole.readuntil(b"\r\n\r\n"), CLOSED_WITHIN)
            assert answer.startswith(b"HTTP/1.1 200")
            assert await whole.readexactly(100) == b"y" * 100
            assert await closed(stalled) == b""
            for w in (writer, writer2):
                w.close()

    asyncio.run(main())


def test_one_address_is_capped_and_others_are_served():
    async def main():
        async with Edge(EdgeLimits(header_timeout_s=30.0, max_per_peer=3)) as edge:
            held = [await edge.raw() for _ in range(3)]
            reader, writer = await edge.raw()  # the 4th from 127.0.0.1: 429 and closed, unread
            answer = await closed(reader)
            assert answer.startswith(b"HTTP/1.1 429") and b"rate_limit_exceeded" in answer
            writer.close()
            assert await edge.get(source="127.0.0.2") == (200, "ok")  # another address
            held.pop()[1].close()  # a slot frees up
            await until(lambda: edge.site.peers.open.get("127.0.0.1") == 2)
            assert await edge.get() == (200, "ok")
            for _, w in held:
                w.close()

    asyncio.run(main())


def test_all_addresses_together_are_capped_and_answered_503():
    async def main():
        limits = EdgeLimits(header_timeout_s=30.0, max_per_peer=0, max_connections=3)
        async with Edge(limits) as edge:
            held = [await edge.raw(source=f"127.0.0.{i}") for i in (2, 3, 4)]
            await until(lambda: edge.site.peers.total == 3)
            reader, writer = await edge.raw(source="127.0.0.5")  # a 4th address: 503, closed
            answer = await closed(reader)
            assert answer.startswith(b"HTTP/1.1 503") and b"service_unavailable" in answer
            writer.close()
            held.pop()[1].close()  # a slot frees up
            await until(lambda: edge.site.peers.total == 2)
            assert await edge.get(source="127.0.0.5") == (200, "ok")
            for _, w in held:
                w.close()
            assert edge.site._backlog == http_edge.BACKLOG  # aiohttp's 128 overflowed

    asyncio.run(main())


# --- the router: config -> limits, over HTTP and gRPC ----------------------------------------


def test_wrong_keys_are_answered_429_past_their_budget_and_never_refuse_the_right_key(
    tiny_model_dir,
):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    good, bad = {"Authorization": f"Bearer {KEY}"}, {"Authorization": "Bearer wrong"}

    async def post(port: int, headers: dict[str, str], source: str = "127.0.0.1"):
        connector = aiohttp.TCPConnector(local_addr=(source, 0))
        async with (
            aiohttp.ClientSession(f"http://127.0.0.1:{port}", connector=connector) as http,
            http.post("/v1/completions", json=body, headers=headers) as resp,
        ):
            return resp.status, resp.headers, await resp.json()

    async def main():
        cluster = fake_cluster(
            [FakePrefill()],
            [FakeDecode()],
            tiny_model_dir,
            api_key=KEY,
            api_key_failures=3,
            api_key_failures_global=8,
            http_header_timeout_s=TIMEOUT,
        )
        async with (
            cluster as (r, _),
            grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc_port}") as ch,
        ):
            stub = router_pb2_grpc.RouterServiceStub(ch)
            req = router_pb2.GenerateRequest(model="tiny", prompt_token_ids=[5, 6, 7])
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await stub.Generate(req, timeout=10, metadata=auth.bearer("wrong"))
                assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as exc:  # the same wrong key, a 4th time
                await stub.Generate(req, timeout=10, metadata=auth.bearer("wrong"))
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "too many wrong API keys" in exc.value.details()
            assert 0 < int(dict(exc.value.trailing_metadata())["retry-after"]) <= 60
            # the right key from the same address is served, on gRPC and HTTP alike
            assert (await stub.Generate(req, timeout=10, metadata=auth.bearer(KEY))).token_ids
            assert (await post(r.http_port, good))[0] == 200

            # HTTP shares the count: the same wrong key from 127.0.0.1 is answered 429 there
            status, headers, err = await post(r.http_port, bad)
            assert status == 429 and 0 < int(headers["Retry-After"]) <= 60
            assert err["error"]["code"] == "rate_limit_exceeded"
            assert "too many wrong API keys" in err["error"]["message"]
            assert (await post(r.http_port, {"Authorization": "Bearer other"}))[0] == 401
            # 6 wrong keys so far; the global budget (8) ends after two more from elsewhere
            for source, key in (("127.0.0.2", "a"), ("127.0.0.3", "b")):
                assert (await post(r.http_port, {"Authorization": f"Bearer {key}"}, source))[
                    0
                ] == 401
            status, headers, _ = await post(r.http_port, {"Authorization": "Bearer c"}, "127.0.0.4")
            assert status == 429 and 0 < int(headers["Retry-After"]) <= 60
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in stub.GenerateStream(req, timeout=10, metadata=auth.bearer("d")):
                    pass
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for source in ("127.0.0.1", "127.0.0.4"):  # still never the right key
                assert (await post(r.http_port, good, source))[0] == 200
            async for _ in stub.GenerateStream(req, timeout=10, metadata=auth.bearer(KEY)):
                pass
            async with (  # health stays open
                aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
                http.get("/health") as resp,
            ):
                assert resp.status == 200

            # the router's HTTP port is an EdgeSite: a partial head is closed
            reader, writer = await asyncio.open_connection("127.0.0.1", r.http_port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            assert await closed(reader) == b""
            writer.close()

    asyncio.run(main())


def test_tokenize_applies_the_prompt_size_rule_and_runs_off_the_loop(tiny_model_dir):
    async def main():
        async with (
            fake_cluster([FakePrefill()], [FakeDecode()], tiny_model_dir) as (r, _),
            grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc_port}") as ch,
        ):
            stub = router_pb2_grpc.RouterServiceStub(ch)
            tok = r.frontend.tokenizer
            threads = []
            encode = tok.encode

            def recording(text, **kw):
                threads.append(threading.current_thread())
                return encode(text, **kw)

            tok.encode = recording
            out = await stub.Tokenize(router_pb2.TokenizeRequest(text="hello world"), timeout=10)
            assert "".join(out.tokens) == "hello world"
            assert threads and threading.main_thread() not in threads  # the loop's thread

            threads.clear()
            cap = r.frontend.current_limits().max_model_len * 64
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.Tokenize(router_pb2.TokenizeRequest(text="a" * (cap + 1)), timeout=10)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"text has {cap + 1} characters; no more than {cap}" in exc.value.details()
            assert not threads  # refused before tokenizing
            # Generate's rule, word for word
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.Generate(router_pb2.GenerateRequest(prompt="a" * (cap + 1)), timeout=10)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"prompt has {cap + 1} characters; no more than {cap}" in exc.value.details()

    asyncio.run(main())
