"""The router's API key: refused without it (HTTP 401 in the OpenAI shape, gRPC
UNAUTHENTICATED), served with it, health open."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import pytest
from router_fakes import FakeDecode, FakePrefill, fake_cluster

from pdserve import auth
from pdserve.config import ConfigError
from pdserve.services.router.config import RouterConfig
from pdserve.v1 import router_pb2, router_pb2_grpc

KEY = "s3cret-key"
BODY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}


def test_http_and_grpc_need_the_key(tiny_model_dir):
    async def main():
        cluster = fake_cluster([FakePrefill()], [FakeDecode()], tiny_model_dir, api_key=KEY)
        async with cluster as (r, _):
            async with aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http:
                for headers, why in (
                    ({}, "missing API key"),
                    ({"Authorization": "Bearer wrong"}, "invalid API key"),
                    ({"Authorization": KEY}, "must be 'Bearer <key>'"),
                ):
                    async with http.post("/v1/completions", json=BODY, headers=headers) as resp:
                        assert resp.status == 401
                        assert resp.headers["WWW-Authenticate"] == "Bearer"
                        err = (await resp.json())["error"]
                        assert err["code"] == "invalid_api_key" and why in err["message"]
                async with http.get("/v1/models") as resp:
                    assert resp.status == 401
                good = {"Authorization": f"Bearer {KEY}"}
                async with http.post("/v1/completions", json=BODY, headers=good) as resp:
                    assert resp.status == 200, await resp.text()
                for path in ("/health", "/metrics"):  # open
                    async with http.get(path) as resp:
                        assert resp.status == 200
            async with grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc_port}") as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                req = router_pb2.GenerateRequest(model="tiny", prompt_token_ids=[5, 6, 7])
                for call in (stub.Generate, stub.ListModels):
                    arg = req if call is stub.Generate else router_pb2.ListModelsRequest()
                    with pytest.raises(grpc.aio.AioRpcError) as exc:
                        await call(arg, timeout=10, metadata=auth.bearer("wrong"))
                    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert "invalid API key" in exc.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    async for _ in stub.GenerateStream(req, timeout=10):
                        pass
                assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
                resp = await stub.Generate(req, timeout=10, metadata=auth.bearer(KEY))
                assert resp.token_ids and resp.prompt_tokens == 3

    asyncio.run(main())


def test_metrics_need_the_key_beyond_loopback_unless_metrics_open(tiny_model_dir, monkeypatch):
    """/metrics takes an API key once keys are configured, unless metrics_open or the router
    binds loopback only (its HTTP port here is on 127.0.0.1: made to count as beyond)."""
    from pdserve.services.router import server

    assert server.metrics_open(RouterConfig(decode=["127.0.0.1:1"], api_key=KEY))
    beyond = RouterConfig(decode=["127.0.0.1:1"], api_key=KEY, host="10.1.2.3")
    assert not server.metrics_open(beyond)
    assert server.metrics_open(
        RouterConfig(decode=["127.0.0.1:1"], host="0.0.0.0", metrics_open=True)
    )
    monkeypatch.setattr(server, "is_loopback", lambda host: False)

    async def scrape(port: int, headers: dict[str, str]) -> int:
        async with (
            aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http,
            http.get("/metrics", headers=headers) as resp,
        ):
            assert resp.status != 200 or "pdserve_router_requests" in await resp.text()
            return resp.status

    async def main():
        for metrics_open, without_key in ((False, 401), (True, 200)):
            cluster = fake_cluster(
                [FakePrefill()],
                [FakeDecode()],
                tiny_model_dir,
                api_key=KEY,
                metrics_open=metrics_open,
            )
            async with cluster as (r, _):
                assert await scrape(r.http_port, {}) == without_key
                assert await scrape(r.http_port, {"Authorization": "Bearer wrong"}) == without_key
                assert await scrape(r.http_port, {"Authorization": f"Bearer {KEY}"}) == 200
                async with (
                    aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
                    http.get("/health") as resp,
                ):
                    assert resp.status == 200

    asyncio.run(main())


def test_key_file_and_bad_settings(tmp_path):
    path = tmp_path / "key"
    path.write_text(f"{KEY}\n")
    cfg = RouterConfig(decode=["127.0.0.1:1"], api_key_file=str(path))
    cfg.validate()
    assert cfg.api_key == KEY
    with pytest.raises(ConfigError, match="not both"):
        RouterConfig(decode=["127.0.0.1:1"], api_key="x", api_key_file=str(path)).validate()
    with pytest.raises(ConfigError, match="empty"):
        (tmp_path / "empty").write_text("\n")
        RouterConfig(decode=["127.0.0.1:1"], api_key_file=str(tmp_path / "empty")).validate()
    with pytest.raises(ConfigError, match="api_key_file"):
        RouterConfig(decode=["127.0.0.1:1"], api_key_file=str(tmp_path / "nope")).validate()


def test_up_banner_sends_the_key_without_printing_it():
    from pdserve.commands.up import UpConfig, banner

    text = banner(UpConfig(api_key=KEY))
    assert KEY not in text
    assert 'Authorization: Bearer $(cat .pdserve/run/api_key)"' in text
    assert "PDSERVE_API_KEY=$(cat .pdserve/run/api_key) " in text
    assert "Authorization" not in banner(UpConfig(auth=False))
