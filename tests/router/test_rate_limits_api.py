"""Rate limits and priority through the router's APIs (an in-process router over fake workers):
a tenant past its rate limit gets OpenAI's 429 with Retry-After and gRPC RESOURCE_EXHAUSTED
with retry-after in the trailing metadata; ``priority`` is checked and reaches the workers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import grpc
import pytest
from router_fakes import FakeDecode, FakePrefill, fake_cluster

from pdserve import auth
from pdserve.services.router.fair_queue import engine_priority
from pdserve.v1 import router_pb2, router_pb2_grpc

KA, KB = "a" * 16 + "-alpha-key", "b" * 16 + "-beta-key"
BODY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}


def _tenants(tmp_path: Path) -> str:
    path = tmp_path / "tenants"
    # one request, then one per 100 s: the second is refused however slow the machine is
    path.write_text(f"alpha {KA} rps=0.01\nbeta {KB}\n")
    return str(path)


def test_over_the_rate_limit_is_429_with_retry_after_and_resource_exhausted(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    async def main() -> None:
        cluster = fake_cluster(
            [FakePrefill()], [FakeDecode()], tiny_model_dir, tenant_keys_file=_tenants(tmp_path)
        )
        async with (
            cluster as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            alpha = {"Authorization": f"Bearer {KA}"}
            async with http.post("/v1/completions", json=BODY, headers=alpha) as resp:
                assert resp.status == 200, await resp.text()
            async with http.post("/v1/chat/completions", json=_chat(), headers=alpha) as resp:
                assert resp.status == 429
                wait = int(resp.headers["Retry-After"])
                assert 90 <= wait <= 100
                err = (await resp.json())["error"]
                assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
                assert (
                    "tenant 'alpha' is over its rate limit of 0.01 requests per second"
                    in (err["message"])
                )
            anthropic = {**_chat(), "messages": [{"role": "user", "content": "hi"}]}
            async with http.post("/v1/messages", json=anthropic, headers=alpha) as resp:
                assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 90
                assert (await resp.json())["error"]["type"] == "rate_limit_error"
            beta = {"Authorization": f"Bearer {KB}"}  # another tenant is not limited by it
            for _ in range(3):
                async with http.post("/v1/completions", json=BODY, headers=beta) as resp:
                    assert resp.status == 200, await resp.text()
            async with http.get("/metrics") as resp:
                text = await resp.text()
            assert 'pdserve_router_tenant_rate_limited_total{limit="requests",tenant="alpha"}' in (
                text
            )
            async with grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc_port}") as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                req = router_pb2.GenerateRequest(model="tiny", prompt_token_ids=[5, 6, 7])
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    async for _ in stub.GenerateStream(req, timeout=10, metadata=auth.bearer(KA)):
                        pass
                assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "retry in" in exc.value.details()
                trailing = dict(exc.value.trailing_metadata() or ())
                assert 90 <= int(trailing["retry-after"]) <= 100
                resp = await stub.Generate(req, timeout=10, metadata=auth.bearer(KB))
                assert resp.token_ids

    asyncio.run(main())


def _chat(**extra: object) -> dict:
    msgs = [{"role": "user", "content": "hi"}]
    return {"model": "tiny", "messages": msgs, "max_tokens": 2, **extra}


def test_priority_is_checked_and_reaches_the_workers(tiny_model_dir: Path) -> None:
    async def main() -> None:
        prefill, decode = FakePrefill(), FakeDecode()
        async with (
            fake_cluster([prefill], [decode], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            for bad in ("high", 1.5, True, 2**31, -(2**31) - 1):
                async with http.post("/v1/completions", json={**BODY, "priority": bad}) as resp:
                    assert resp.status == 400
                    err = (await resp.json())["error"]
                    assert (
                        err["param"] == "priority"
                        and "priority must be an integer" in (err["message"])
                    )
            async with http.post("/v1/completions", json={**BODY, "priority": 3}) as resp:
                assert resp.status == 200, await resp.text()
            # the caller's priority, then the tenant's fairness rank (0: nothing else in flight)
            want = engine_priority(3, 0)
            assert (prefill.calls[-1].priority, decode.calls[-1].priority) == (want, want)
            async with http.post("/v1/chat/completions", json=_chat(priority=-7)) as resp:
                assert resp.status == 200, await resp.text()
            want = engine_priority(-7, 0)
            assert (prefill.calls[-1].priority, decode.calls[-1].priority) == (want, want)
            responses = {"model": "tiny", "input": "hi", "priority": 1}
            async with http.post("/v1/responses", json=responses) as resp:
                assert resp.status == 400
                assert "honoured on completions and chat completions" in await resp.text()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc_port}") as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                req = router_pb2.GenerateRequest(
                    model="tiny", prompt_token_ids=[5, 6, 7], priority=-(2**31)
                )
                assert (await stub.Generate(req, timeout=10)).token_ids
            assert (prefill.calls[-1].priority, decode.calls[-1].priority) == (-(2**31),) * 2

    asyncio.run(main())
