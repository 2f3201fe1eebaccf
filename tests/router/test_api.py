"""Bad input on both front ends (status + a message naming the field) and the OpenAI JSON and
SSE shapes, through an in-process router in front of fake workers."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import openai
import pytest
from router_fakes import FakeDecode, FakePrefill, expected_tokens, fake_cluster

from pdserve import grpcutil
from pdserve.v1 import common_pb2, meta_pb2, router_pb2, router_pb2_grpc


def S(**kw):
    return common_pb2.SamplingParams(**kw)


BAD_GRPC = [
    (dict(prompt=""), "exactly one of prompt, prompt_token_ids and messages"),
    (dict(prompt="hi", prompt_token_ids=[1, 2]), "got prompt, prompt_token_ids"),
    (dict(prompt_token_ids=[1, 99999]), "prompt_token_ids: token id 99999"),
    (dict(prompt="hi", sampling=S(temperature=-1.0)), "temperature must be >= 0"),
    (dict(prompt="hi", sampling=S(top_p=1.5)), "top_p must be in (0, 1]"),
    (dict(prompt="hi", sampling=S(max_tokens=999999)), "max_tokens 999999 exceeds the limit"),
    (dict(messages=[router_pb2.ChatMessage(content="x")]), "messages[0].role"),
    (dict(prompt="hi", request_id="x" * 200), "request_id must be 1-128"),
    # cache_salt: set but empty, too long, or holding a character vLLM refuses
    (dict(prompt="hi", cache_salt=""), "cache_salt must be a non-empty string"),
    (dict(prompt="hi", cache_salt="s" * 129), "cache_salt must be at most 128 characters"),
    (dict(prompt="hi", cache_salt="tenant/a"), "must not contain '@', '/'"),
    (dict(prompt="hi", cache_salt="a\0b"), "must not contain '@', '/'"),
    # n: 1-16 generations (0 = unset = 1)
    (dict(prompt="hi", n=17), "n must be an integer in [1, 16], got 17"),
    (dict(prompt="hi", n=2**32 - 1), "n must be an integer in [1, 16]"),
]


def test_grpc_bad_input_is_invalid_argument_naming_the_field(tiny_model_dir):
    async def main():
        async with (
            fake_cluster([FakePrefill()], [FakeDecode()], tiny_model_dir) as (r, _),
            grpcutil.channel(f"127.0.0.1:{r.grpc_port}") as ch,
        ):
            stub = router_pb2_grpc.RouterServiceStub(ch)
            for kwargs, msg in BAD_GRPC:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Generate(router_pb2.GenerateRequest(**kwargs))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs
                assert msg in err.value.details(), (kwargs, err.value.details())
            # An unknown model is NOT_FOUND, as in the workers (one shared check).
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(router_pb2.GenerateRequest(prompt="hi", model="gpt-4"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert "model: unknown model 'gpt-4'" in err.value.details()

    asyncio.run(main())


BAD_HTTP = [
    ("/v1/completions", {"model": "tiny", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 2}, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    # numbers their proto fields (uint32, uint64, float) cannot hold
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_k": 2**32}, "top_k"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": 10**400}, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2**40}, "max_tokens"),
    # parameters out of range, or not implemented: refused by name, never silently ignored
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 1, "echo": True}, "echo"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "best_of": True}, "best_of"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 17}, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "suffix": "x"}, "suffix"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "min_p": 0.1}, "min_p"),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "presence_penalty": 3},
        "presence_penalty",
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "frequency_penalty": "x"},
        "frequency_penalty",
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "repetition_penalty": 0},
        "repetition_penalty",
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "logit_bias": {"99999": 1}},
        "logit_bias",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"a": 1}}, "logit_bias"),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "stop_token_ids": [10**6]},
        "stop_token_ids",
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "stream_options": {"continuous_usage_stats": True}},
        "stream_options",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 21,
        },
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "echo": True},
        "echo",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "xml"},
        },
        "response_format",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
        },
        "response_format",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"description": "no name"}}],
        },
        "tools",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "cache_salt": ""}, "cache_salt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "cache_salt": 7}, "cache_salt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "cache_salt": "s" * 129}, "cache_salt"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "a@b"},
        "cache_salt",
    ),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, "messages"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content",
    ),
]


def test_http_bad_input_is_400_with_openai_error_json(tiny_model_dir):
    async def main():
        async with (
            fake_cluster([FakePrefill()], [FakeDecode()], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            for path, body, param in BAD_HTTP:
                async with http.post(path, json=body) as resp:
                    assert resp.status == 400, body
                    err = (await resp.json())["error"]
                    assert set(err) == {"message", "type", "param", "code"}
                    assert err["param"] == param and param in err["message"], err
                    assert err["type"] == "invalid_request_error"
            async with http.post("/v1/completions", json={"model": "nope", "prompt": "hi"}) as resp:
                assert resp.status == 404
                err = (await resp.json())["error"]
                assert (err["code"], err["param"]) == ("model_not_found", "model")
                assert "unknown model 'nope'" in err["message"]
            async with http.post("/v1/completions", data=b"{not json") as resp:
                assert resp.status == 400
                assert "not valid JSON" in (await resp.json())["error"]["message"]
            lone = b'{"model": "tiny", "prompt": "a\\ud800b"}'  # a lone surrogate
            async with http.post("/v1/completions", data=lone) as resp:
                assert resp.status == 400
                assert "lone surrogate" in (await resp.json())["error"]["message"]
            # Text that cannot fit the context is refused before it is tokenized.
            cap = r.frontend.current_limits().max_model_len * 64
            for body in (
                {"model": "tiny", "prompt": "a" * (cap + 1)},
                {"model": "tiny", "messages": [{"role": "user", "content": "a" * (cap + 1)}]},
            ):
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                async with http.post(path, json=body) as resp:
                    assert resp.status == 400
                    assert "characters" in (await resp.json())["error"]["message"]
            async with http.get("/v1/nothing") as resp:
                assert resp.status == 404 and "error" in await resp.json()
            # The same parameters at their "off" values are fine.
            off = {
                "logprobs": False,
                "presence_penalty": 0,
                "frequency_penalty": 0.0,
                "logit_bias": {},
                "response_format": {"type": "text"},
                "tools": [],
                "echo": False,
                "best_of": 1,
            }
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **off}
            async with http.post("/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()

    asyncio.run(main())


def test_http_429_when_queue_is_full(tiny_model_dir):
    async def main():
        d = FakeDecode(token_delay_s=0.05)
        cluster = fake_cluster([FakePrefill()], [d], tiny_model_dir, max_inflight=1, max_queue=0)
        async with (
            cluster as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 40, "stream": True}
            async with http.post("/v1/completions", json=body) as slow:
                await slow.content.readline()  # streaming: admitted
                async with http.post("/v1/completions", json={**body, "stream": False}) as resp:
                    assert resp.status == 429
                    err = (await resp.json())["error"]
                    assert err["code"] == "rate_limit_exceeded" and "queue full" in err["message"]

    asyncio.run(main())


def test_openai_package_chat_stream_and_completion_shapes(tiny_model_dir):
    async def main():
        async with fake_cluster([FakePrefill()], [FakeDecode()], tiny_model_dir) as (r, _):
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{r.http_port}/v1", api_key="x")
            tok = r.frontend.tokenizer
            msgs = [{"role": "user", "content": "hello there"}]
            prompt = tok.apply_chat_template(msgs)
            want = expected_tokens(prompt, 5)
            stream = await client.chat.completions.create(
                model="tiny",
                messages=msgs,
                max_tokens=5,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == "".join(f"<{t}>" for t in want)
            finals = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert finals[-1] == "length" and set(finals[:-1]) == {None}
            assert chunks[-1].usage.completion_tokens == 5
            assert chunks[-1].usage.prompt_tokens == len(prompt)

            comp = await client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3)
            assert comp.object == "text_completion"
            assert comp.choices[0].text == "".join(f"<{t}>" for t in expected_tokens([5, 6, 7], 3))
            assert comp.usage.total_tokens == 6 and comp.choices[0].finish_reason == "length"

            chat = await client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
            assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 2
            parts = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
            chat2 = await client.chat.completions.create(model="tiny", messages=parts, max_tokens=2)
            assert chat2.choices[0].message.content == chat.choices[0].message.content

            models = await client.models.list()
            assert [m.id for m in models.data] == ["tiny"]
            with pytest.raises(openai.BadRequestError) as err:
                await client.completions.create(model="tiny", prompt="hi", top_p=3)
            assert err.value.body["param"] == "top_p"
            await client.close()

    asyncio.run(main())


def test_sse_ends_with_done_and_health_metrics(tiny_model_dir):
    async def main():
        async with (
            fake_cluster([FakePrefill()], [FakeDecode()], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            body = {"model": "tiny", "prompt": "abc", "max_tokens": 3, "stream": True}
            async with http.post("/v1/completions", json=body) as resp:
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                lines = [ln.decode().strip() async for ln in resp.content]
            events = [ln[len("data: ") :] for ln in lines if ln.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])
            async with http.get("/health") as resp:
                assert resp.status == 200 and (await resp.json())["decode_workers"] == 1
            async with http.get("/metrics") as resp:
                assert "pdserve_router_requests" in await resp.text()

    asyncio.run(main())


def test_http_client_disconnect_cancels_the_decode_stream(tiny_model_dir):
    async def main():
        d = FakeDecode(token_delay_s=0.05)
        async with (
            fake_cluster([FakePrefill()], [d], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "stream": True}
            resp = await http.post("/v1/completions", json=body)
            await resp.content.readline()
            assert d.active == 1
            resp.close()  # the client goes away mid-stream
            deadline = asyncio.get_running_loop().time() + 5
            while d.active and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            assert d.active == 0 and d.cancelled == 1

    asyncio.run(main())


def test_request_id_from_the_header_or_metadata_is_used_and_echoed(tiny_model_dir):
    async def main():
        d = FakeDecode()
        async with (
            fake_cluster([FakePrefill()], [d], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
            grpcutil.channel(f"127.0.0.1:{r.grpc_port}") as ch,
        ):
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
            for stream in (False, True):
                rid = f"http-{stream}"
                headers = {"x-request-id": rid}
                async with http.post(
                    "/v1/completions", json={**body, "stream": stream}, headers=headers
                ) as resp:
                    assert resp.status == 200 and resp.headers["x-request-id"] == rid
                    await resp.read()
                assert d.calls[-1].request_id == rid
            # The body's request_id wins over the header; a fresh id is echoed when none.
            async with http.post(
                "/v1/completions", json={**body, "request_id": "mine"}, headers=headers
            ) as resp:
                assert resp.headers["x-request-id"] == "mine" == d.calls[-1].request_id
            async with http.post("/v1/completions", json=body) as resp:
                assert resp.headers["x-request-id"] == d.calls[-1].request_id != ""

            stub = router_pb2_grpc.RouterServiceStub(ch)
            req = router_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=S(max_tokens=2))
            call = stub.Generate(req, metadata=(("x-request-id", "grpc-1"),))
            out = await call
            assert out.request_id == "grpc-1" == d.calls[-1].request_id
            assert ("x-request-id", "grpc-1") in tuple(await call.initial_metadata())
            stream_call = stub.GenerateStream(req, metadata=(("x-request-id", "grpc-2"),))
            assert {m.request_id async for m in stream_call} == {"grpc-2"}
            assert d.calls[-1].request_id == "grpc-2"

    asyncio.run(main())


def test_cache_salt_reaches_the_workers_from_both_front_ends(tiny_model_dir):
    async def main():
        p, d = FakePrefill(), FakeDecode()
        async with (
            fake_cluster([p], [d], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
            grpcutil.channel(f"127.0.0.1:{r.grpc_port}") as ch,
        ):
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            for path, body in (
                ("/v1/completions", {"model": "tiny", "prompt": [5, 6, 7]}),
                ("/v1/chat/completions", chat),
            ):
                for salt, sent in (("t-" + "x" * 126, "t-" + "x" * 126), (None, "")):
                    req = {**body, "max_tokens": 2, "cache_salt": salt}
                    async with http.post(path, json=req) as resp:
                        assert resp.status == 200, await resp.text()
                    assert p.calls[-1].cache_salt == d.calls[-1].cache_salt == sent
            stub = router_pb2_grpc.RouterServiceStub(ch)
            for kwargs, sent in ((dict(cache_salt="tenant-é"), "tenant-é"), ({}, "")):
                req = router_pb2.GenerateRequest(
                    prompt_token_ids=[5, 6, 7], sampling=S(max_tokens=2), **kwargs
                )
                await stub.Generate(req)
                assert p.calls[-1].cache_salt == d.calls[-1].cache_salt == sent

    asyncio.run(main())


def test_chat_roles_are_the_enum_on_grpc_and_strings_on_http():
    from pdserve.errors import InvalidArgument
    from pdserve.services.router import request as rq

    msgs = [
        {"role": router_pb2.CHAT_ROLE_SYSTEM, "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert rq.check_messages(msgs) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    for bad in (router_pb2.CHAT_ROLE_UNSPECIFIED, 42, "bot"):
        with pytest.raises(InvalidArgument) as err:
            rq.check_messages([{"role": bad, "content": "x"}])
        assert err.value.param == "messages[0].role"


def test_limits_the_workers_advertise_are_enforced_and_refused_workers_shown(tiny_model_dir):
    """The router takes the smallest max_model_len and max_tokens_limit its workers registered
    (a longer prompt is a 400 naming the limit, never an error deep inside a worker), ignores
    those of refused workers, and lists refused workers in ListModels and /v1/models."""

    async def main():
        async with (
            fake_cluster([FakePrefill()], [FakeDecode()], tiny_model_dir) as (r, servers),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
            grpcutil.channel(f"127.0.0.1:{r.grpc_port}") as ch,
        ):
            limits = {"max_model_len": "64", "max_tokens_limit": "8"}
            odd = {"fingerprint": "00" * 32, "kv_dtype": "float32", "chunk_size": "8",
                   "max_model_len": "16"}  # fmt: skip
            r.frontend.pool.sync(
                [
                    meta_pb2.Instance(instance_id="small", role=common_pb2.ROLE_DECODE,
                                      address=servers[1].address, model="tiny", labels=limits),
                    meta_pb2.Instance(instance_id="odd", role=common_pb2.ROLE_DECODE,
                                      address="127.0.0.1:9", model="tiny", labels=odd),
                ]
            )  # fmt: skip
            for body, param, msg in (
                ({"prompt": [5] * 100}, "prompt", "model context of 64 tokens"),
                ({"prompt": [5] * 60, "max_tokens": 8}, "max_tokens", "context of 64 tokens"),
                ({"prompt": [5] * 10, "max_tokens": 9}, "max_tokens", "exceeds the limit of 8"),
            ):
                async with http.post("/v1/completions", json={"model": "tiny", **body}) as resp:
                    assert resp.status == 400, body
                    err = (await resp.json())["error"]
                    assert err["param"] == param and msg in err["message"], err
            stub = router_pb2_grpc.RouterServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(router_pb2.GenerateRequest(prompt_token_ids=[5] * 64))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "model context of 64 tokens" in err.value.details()
            (info,) = (await stub.ListModels(router_pb2.ListModelsRequest())).models
            assert info.max_model_len == 64 and info.decode_workers == 2  # static + small
            (refused,) = info.refused_workers
            assert refused.startswith("odd: KV fingerprint differs")
            assert "chunk_size 8 != 4" in refused
            async with http.get("/v1/models") as resp:
                assert (await resp.json())["data"][0]["refused_workers"] == [refused]
            ok = {"model": "tiny", "prompt": [5] * 10, "max_tokens": 8}
            async with http.post("/v1/completions", json=ok) as resp:
                assert resp.status == 200, await resp.text()

    asyncio.run(main())
