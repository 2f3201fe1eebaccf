"""/v1/responses and /v1/messages through an in-process router over fake workers: the
Responses object (output message, usage, status), ``previous_response_id`` resolving the
stored conversation and a 404 after ``store: false``, GET /v1/responses/{id}; Anthropic's
answer and error shapes, and its ``x-api-key`` header accepted as the router's API key."""

from __future__ import annotations

import asyncio

import aiohttp
from router_fakes import FakeDecode, FakePrefill, fake_cluster

KEY = "s3cret-key"


def _run(tiny_model_dir, steps, **cfg):
    async def main():
        dec = FakeDecode()
        async with (
            fake_cluster([FakePrefill()], [dec], tiny_model_dir, **cfg) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            return await steps(http, dec)

    return asyncio.run(main())


def test_responses_store_and_continue(tiny_model_dir):
    async def steps(http: aiohttp.ClientSession, dec: FakeDecode):
        body = {"model": "tiny", "input": "hello there", "max_output_tokens": 3}
        async with http.post("/v1/responses", json=body) as resp:
            assert resp.status == 200, await resp.text()
            first = await resp.json()
        assert first["object"] == "response" and first["id"].startswith("resp_")
        assert first["status"] == "incomplete"  # max_output_tokens reached
        assert first["incomplete_details"] == {"reason": "max_output_tokens"}
        (message,) = first["output"]
        assert message["type"] == "message" and message["role"] == "assistant"
        text = message["content"][0]["text"]
        assert message["content"][0]["type"] == "output_text" and text
        assert first["usage"]["output_tokens"] == 3 and first["usage"]["input_tokens"] > 0
        prompt_first = list(dec.calls[-1].prompt_token_ids)
        async with http.get(f"/v1/responses/{first['id']}") as resp:
            assert (await resp.json())["output"] == first["output"]
        more = {**body, "input": "and again", "previous_response_id": first["id"]}
        async with http.post("/v1/responses", json=more) as resp:
            assert resp.status == 200, await resp.text()
        prompt_second = list(dec.calls[-1].prompt_token_ids)
        assert len(prompt_second) > len(prompt_first)  # the stored turns come first
        async with http.post("/v1/responses", json={**body, "store": False}) as resp:
            unstored = (await resp.json())["id"]
        async with http.post(
            "/v1/responses", json={**body, "previous_response_id": unstored}
        ) as resp:
            assert resp.status == 404
            err = (await resp.json())["error"]
            assert err["param"] == "previous_response_id" and "store: false" in err["message"]
        async with http.post("/v1/responses", json={**body, "input": []}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "input"

    _run(tiny_model_dir, steps)


def test_messages_shapes_and_anthropic_key_header(tiny_model_dir):
    async def steps(http: aiohttp.ClientSession, dec: FakeDecode):
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        async with http.post("/v1/messages", json=body, headers={"x-api-key": KEY}) as resp:
            assert resp.status == 200, await resp.text()
            msg = await resp.json()
        assert msg["type"] == "message" and msg["stop_reason"] == "max_tokens"
        assert msg["content"][0]["type"] == "text" and msg["usage"]["output_tokens"] == 2
        async with http.post("/v1/messages", json=body, headers={"x-api-key": "wrong"}) as resp:
            assert resp.status == 401
        bad = {**body, "max_tokens": None}
        async with http.post("/v1/messages", json=bad, headers={"x-api-key": KEY}) as resp:
            assert resp.status == 400
            err = await resp.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in err["error"]["message"]
        stream = {**body, "stream": True}
        async with http.post("/v1/messages", json=stream, headers={"x-api-key": KEY}) as resp:
            events = [
                line.removeprefix("event: ")
                for line in (await resp.text()).splitlines()
                if line.startswith("event: ")
            ]
        assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
        assert "content_block_delta" in events

    _run(tiny_model_dir, steps, api_key=KEY)


def test_a_tenant_finds_only_its_own_responses(tiny_model_dir, tmp_path):
    ka, kb = "a" * 16 + "-alpha-key", "b" * 16 + "-beta-key"
    keys = tmp_path / "tenants"
    keys.write_text(f"alpha {ka}\nbeta {kb}\n")

    async def steps(http: aiohttp.ClientSession, dec: FakeDecode):
        alpha, beta = ({"Authorization": f"Bearer {k}"} for k in (ka, kb))
        body = {"model": "tiny", "input": "hello", "max_output_tokens": 2}
        async with http.post("/v1/responses", json=body, headers=alpha) as resp:
            rid = (await resp.json())["id"]
        async with http.get(f"/v1/responses/{rid}", headers=alpha) as resp:
            assert resp.status == 200
        async with http.get(f"/v1/responses/{rid}", headers=beta) as resp:
            assert resp.status == 404
        more = {**body, "previous_response_id": rid}
        async with http.post("/v1/responses", json=more, headers=beta) as resp:
            assert resp.status == 404
        async with http.post("/v1/responses", json=more, headers=alpha) as resp:
            assert resp.status == 200

    _run(tiny_model_dir, steps, tenant_keys_file=str(keys))
