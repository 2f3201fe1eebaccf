"""OpenAI parameter parity through an in-process router in front of fake workers: logprobs
shapes (the first token's from prefill), n > 1, echo, the sampling fields the workers get,
guided decoding's plan, and the gRPC Abort and GetServerInfo."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest
from router_fakes import FakeDecode, FakePrefill, expected_tokens, fake_cluster

from pdserve import grpcutil
from pdserve.services.router.openai_fields import COMPLETIONS, REFUSED
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

CHAT = [{"role": "user", "content": "hi"}]


def fake_lp(t: int) -> float:
    """router_fakes.fake_logprobs's log probability of token t."""
    return -((t % 7) + 1) / 10


async def _sse(resp: aiohttp.ClientResponse) -> list[dict]:
    events = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


def test_completions_logprobs_shape_and_values(tiny_model_dir):
    """Read plan: the first token's logprobs come from prefill, the rest from decode; every
    token has them, in OpenAI's completions shape."""

    async def main():
        async with (
            fake_cluster([FakePrefill()], [FakeDecode()], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 2}
            async with http.post("/v1/completions", json=body) as resp:
                assert resp.status == 200
                out = await resp.json()
            want = expected_tokens([5, 6, 7], 4)
            lp = out["choices"][0]["logprobs"]
            assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
            assert lp["token_logprobs"] == pytest.approx([fake_lp(t) for t in want])
            tok = r.frontend.tokenizer
            assert lp["tokens"] == tok.token_strings(want)
            # top 2 per token (keys are token strings: two may coincide)
            assert all(1 <= len(d) <= 2 for d in lp["top_logprobs"])
            offsets = [0]
            for s in lp["tokens"][:-1]:
                offsets.append(offsets[-1] + len(s))
            assert lp["text_offset"] == offsets
            # without logprobs: null, as before
            body.pop("logprobs")
            async with http.post("/v1/completions", json=body) as resp:
                assert (await resp.json())["choices"][0]["logprobs"] is None

    asyncio.run(main())


def test_chat_logprobs_streamed(tiny_model_dir):
    async def main():
        async with (
            fake_cluster([FakePrefill()], [FakeDecode()], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            body = {
                "model": "tiny",
                "messages": CHAT,
                "max_tokens": 3,
                "logprobs": True,
                "top_logprobs": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with http.post("/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                events = await _sse(resp)
            content = []
            for ev in events:
                for ch in ev["choices"]:
                    if ch["logprobs"]:
                        content += ch["logprobs"]["content"]
            assert len(content) == 3
            for item in content:
                assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
                assert item["bytes"] == list(item["token"].encode())
                assert len(item["top_logprobs"]) == 3
                assert item["top_logprobs"][0]["logprob"] == pytest.approx(item["logprob"])
            assert events[-1]["usage"]["completion_tokens"] == 3

    asyncio.run(main())


def test_n_fans_out_with_distinct_seeds_and_sums_usage(tiny_model_dir):
    async def main():
        dec = FakeDecode()
        async with (
            fake_cluster([FakePrefill()], [dec], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "n": 3, "seed": 7}
            async with http.post(
                "/v1/completions", json=body, headers={"x-request-id": "req-n"}
            ) as resp:
                assert resp.status == 200
                out = await resp.json()
            assert [c["index"] for c in out["choices"]] == [0, 1, 2]
            assert all(c["finish_reason"] == "length" for c in out["choices"])
            assert out["usage"]["completion_tokens"] == 9
            assert out["usage"]["prompt_tokens"] == len(r.frontend.tokenizer.encode("hi"))
            assert sorted(c.sampling.seed for c in dec.calls) == [7, 8, 9]
            assert sorted(c.request_id for c in dec.calls) == ["req-n", "req-n-1", "req-n-2"]
            # streamed: every index gets its tokens and its finish
            body["stream"] = True
            chat = {**{k: v for k, v in body.items() if k != "prompt"}, "messages": CHAT}
            async with http.post("/v1/chat/completions", json=chat) as resp:
                events = await _sse(resp)
            finishes = {
                ch["index"]: ch["finish_reason"]
                for ev in events
                for ch in ev["choices"]
                if ch["finish_reason"]
            }
            assert finishes == {0: "length", 1: "length", 2: "length"}

    asyncio.run(main())


def test_batched_prompts_index_choices_as_vllm_does(tiny_model_dir):
    """A completions prompt that is a batch (strings or token-id lists): prompt k's generation j
    is choice k * n + j, each prompt's tokens counted once in usage, echo per prompt; a bad
    element is named by its index."""

    async def main():
        dec = FakeDecode()
        async with (
            fake_cluster([FakePrefill()], [dec], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            tok = r.frontend.tokenizer
            body = {"model": "tiny", "prompt": ["hi", [5, 6, 7, 8]], "max_tokens": 3, "n": 2}
            body |= {"echo": True, "request_id": "req-b"}
            async with http.post("/v1/completions", json=body) as resp:
                assert resp.status == 200
                out = await resp.json()
            assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
            echoes = [tok.decode(tok.encode("hi")), tok.decode([5, 6, 7, 8])]
            for c in out["choices"]:
                gen = "".join(f"<{t}>" for t in expected_tokens(_ids(c, tok), 3))  # fake text
                want = echoes[c["index"] // 2] + gen
                assert c["text"] == want, c
            assert out["usage"]["prompt_tokens"] == len(tok.encode("hi")) + 4
            assert out["usage"]["completion_tokens"] == 12
            assert sorted(c.request_id for c in dec.calls) == [
                "req-b",
                "req-b-1",
                "req-b-p1",
                "req-b-p1-1",
            ]
            # streamed: the same texts per index
            async with http.post("/v1/completions", json={**body, "stream": True}) as resp:
                events = await _sse(resp)
            texts: dict[int, str] = {}
            for ev in events:
                for ch in ev["choices"]:
                    texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            assert texts == {c["index"]: c["text"] for c in out["choices"]}
            for bad, message in (
                (["hi", ""], "prompt[1] must not be empty"),
                (["hi", 5], "prompt[1] must be a non-empty string or a list of token ids"),
                ([], "prompt must be a non-empty string"),
                (["x"] * 200, "at most 256"),
            ):
                async with http.post(
                    "/v1/completions", json={**body, "prompt": bad, "echo": False}
                ) as resp:
                    assert resp.status == 400
                    err = (await resp.json())["error"]
                assert message in err["message"] and err["param"] == "prompt", (bad, err)

    asyncio.run(main())


def _ids(choice: dict, tok) -> list[int]:
    """The prompt ids of a batched choice of the test above (index // n = 2)."""
    return tok.encode("hi") if choice["index"] < 2 else [5, 6, 7, 8]


def test_echo_prepends_the_prompt(tiny_model_dir):
    async def main():
        async with (
            fake_cluster([FakePrefill()], [FakeDecode()], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            body = {"model": "tiny", "prompt": "hello there", "max_tokens": 2, "echo": True}
            async with http.post("/v1/completions", json=body) as resp:
                text = (await resp.json())["choices"][0]["text"]
            prompt_text = r.frontend.tokenizer.decode(r.frontend.tokenizer.encode("hello there"))
            assert text.startswith(prompt_text) and len(text) > len(prompt_text)
            async with http.post("/v1/completions", json={**body, "stream": True}) as resp:
                events = await _sse(resp)
            assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == text

    asyncio.run(main())


def test_sampling_fields_reach_both_workers(tiny_model_dir):
    async def main():
        pre, dec = FakePrefill(), FakeDecode()
        async with (
            fake_cluster([pre], [dec], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            body = {
                "model": "tiny",
                "prompt": "hi",
                "max_tokens": 2,
                "presence_penalty": 0.5,
                "frequency_penalty": -0.25,
                "repetition_penalty": 1.3,
                "logit_bias": {"42": -100, "7": 2.5},
                "stop_token_ids": [11, 12],
            }
            async with http.post("/v1/completions", json=body) as resp:
                assert resp.status == 200
            for s in (pre.calls[0].sampling, dec.calls[0].sampling):
                assert s.presence_penalty == 0.5 and s.frequency_penalty == -0.25
                assert s.repetition_penalty == pytest.approx(1.3)
                assert dict(s.logit_bias) == {42: -100.0, 7: 2.5}
                assert list(s.stop_token_ids) == [11, 12]
                assert not s.HasField("logprobs")

    asyncio.run(main())


def test_response_format_runs_on_one_worker(tiny_model_dir):
    """Guided decoding keeps a grammar state per generation: the router sends it to one
    worker (local plan), with the constraint."""

    async def main():
        pre, dec = FakePrefill(), FakeDecode()
        async with (
            fake_cluster([pre], [dec], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
            for fmt, check in (
                ({"type": "json_object"}, lambda s: s.json_object and not s.json_schema),
                (
                    {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                    lambda s: json.loads(s.json_schema) == schema,
                ),
            ):
                body = {"model": "tiny", "messages": CHAT, "max_tokens": 2, "response_format": fmt}
                async with http.post("/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
                assert check(dec.calls[-1].sampling)
                assert not dec.calls[-1].HasField("kv")
            assert pre.calls == []

    asyncio.run(main())


def test_unsupported_parameters_are_named_with_a_reason(tiny_model_dir):
    async def main():
        async with (
            fake_cluster([FakePrefill()], [FakeDecode()], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            for name, (off, why) in REFUSED.items():
                if name in COMPLETIONS:
                    continue  # refused on chat only (echo)
                body = {"model": "tiny", "prompt": "hi", name: "on"}
                async with http.post("/v1/completions", json=body) as resp:
                    assert resp.status == 400, name
                    err = (await resp.json())["error"]
                    assert err["param"] == name and why in err["message"]
                # the "off" values pass
                async with http.post(
                    "/v1/completions", json={**body, name: off[-1], "max_tokens": 1}
                ) as resp:
                    assert resp.status == 200, (name, await resp.text())

    asyncio.run(main())


def test_grpc_logprobs_stop_token_ids_abort_and_server_info(tiny_model_dir):
    async def main():
        dec = FakeDecode(token_delay_s=0.05)
        async with (
            fake_cluster([FakePrefill()], [dec], tiny_model_dir) as (r, _),
            grpcutil.channel(f"127.0.0.1:{r.grpc_port}") as ch,
        ):
            stub = router_pb2_grpc.RouterServiceStub(ch)
            s = common_pb2.SamplingParams(max_tokens=3, logprobs=1, stop_token_ids=[13])
            out = await stub.Generate(router_pb2.GenerateRequest(prompt_token_ids=[5], sampling=s))
            assert list(out.logprobs.token_ids) == list(out.token_ids)
            assert list(out.logprobs.token_logprobs) == pytest.approx(
                [fake_lp(t) for t in out.token_ids]
            )
            assert [len(t.values) for t in out.logprobs.top_logprobs] == [1, 1, 1]
            assert list(dec.calls[-1].sampling.stop_token_ids) == [13]

            # Abort: the running stream ends with CANCELLED and the worker call is cancelled
            long = common_pb2.SamplingParams(max_tokens=200)
            req = router_pb2.GenerateRequest(
                request_id="to-abort", prompt_token_ids=[5], sampling=long
            )
            call = stub.GenerateStream(req)
            got = [await call.read()]
            info = await stub.GetServerInfo(router_pb2.GetServerInfoRequest())
            assert info.active_requests == 1
            await stub.Abort(router_pb2.AbortRequest(request_id="to-abort"))
            while (m := await call.read()) != grpc.aio.EOF:
                got.append(m)
            assert got[-1].finish_reason == common_pb2.FINISH_REASON_CANCELLED
            assert sum(len(m.token_ids) for m in got) < 200
            assert (await call.code()) == grpc.StatusCode.OK
            for _ in range(50):
                if dec.cancelled:
                    break
                await asyncio.sleep(0.02)
            assert dec.cancelled == 1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Abort(router_pb2.AbortRequest(request_id="to-abort"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

            info = await stub.GetServerInfo(router_pb2.GetServerInfoRequest())
            assert info.model == "tiny" and info.server_type == "pdserve-router"
            assert info.max_model_len > 0 and info.vocab_size > 0 and info.version
            assert (info.chunk_size, info.kv_dtype) == (4, "float32")
            assert (info.prefill_workers, info.decode_workers) == (1, 1)
            assert info.active_requests == 0 and info.max_logprobs == 20

    asyncio.run(main())


def test_grpc_n_fans_out_with_choice_indexes(tiny_model_dir):
    """GenerateRequest.n: the same fan-out as the HTTP API's n (seeds s + i, ids <id>-<i>);
    GenerateStream marks every message with its choice's index, each choice's tokens arrive
    in order and end with its finish; Generate answers every choice in `choices`. Out of
    range (checked before any work) is INVALID_ARGUMENT naming n, on both calls."""

    async def main():
        dec = FakeDecode()
        async with (
            fake_cluster([FakePrefill()], [dec], tiny_model_dir) as (r, _),
            grpcutil.channel(f"127.0.0.1:{r.grpc_port}") as ch,
        ):
            stub = router_pb2_grpc.RouterServiceStub(ch)
            prompt = [5, 6, 7]
            want = expected_tokens(prompt, 4)
            sampling = common_pb2.SamplingParams(max_tokens=4, seed=7, logprobs=1)
            req = router_pb2.GenerateRequest(
                prompt_token_ids=prompt, sampling=sampling, request_id="g-n", n=3
            )
            msgs = [m async for m in stub.GenerateStream(req)]
            assert {m.request_id for m in msgs} == {"g-n"}
            for i in range(3):
                mine = [m for m in msgs if m.index == i]
                assert [t for m in mine for t in m.token_ids] == want
                assert mine[0].prompt_tokens == len(prompt)
                assert [m.finish_reason for m in mine][-1] == common_pb2.FINISH_REASON_LENGTH
                assert not any(m.finish_reason for m in mine[:-1])
                assert sum(len(m.logprobs.token_ids) for m in mine) == 4
            assert sorted(c.sampling.seed for c in dec.calls) == [7, 8, 9]
            assert sorted(c.request_id for c in dec.calls) == ["g-n", "g-n-1", "g-n-2"]

            dec.calls.clear()
            req.request_id = "g-u"
            out = await stub.Generate(req)
            assert [c.index for c in out.choices] == [0, 1, 2]
            for c in out.choices:
                assert list(c.token_ids) == want and c.text
                assert c.finish_reason == common_pb2.FINISH_REASON_LENGTH
                assert list(c.logprobs.token_ids) == want
            assert list(out.token_ids) == want and out.text == out.choices[0].text
            assert out.prompt_tokens == len(prompt) and out.total_ms >= out.ttft_ms > 0
            assert sorted(c.sampling.seed for c in dec.calls) == [7, 8, 9]
            # n = 1 (or unset): one generation, index 0, no choices list
            one = await stub.Generate(router_pb2.GenerateRequest(prompt_token_ids=prompt, n=1))
            assert not one.choices and len(one.token_ids) > 0
            streamed = [
                m async for m in stub.GenerateStream(router_pb2.GenerateRequest(prompt="hi"))
            ]
            assert {m.index for m in streamed} == {0}

            calls = len(dec.calls)
            for bad in (17, 100):
                for call in (stub.Generate, stub.GenerateStream):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        res = call(router_pb2.GenerateRequest(prompt="hi", n=bad))
                        if call is stub.GenerateStream:
                            [m async for m in res]
                        else:
                            await res
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert f"n must be an integer in [1, 16], got {bad}" in err.value.details()
            assert len(dec.calls) == calls

    asyncio.run(main())


def test_grpc_abort_ends_every_choice(tiny_model_dir):
    """Abort(request_id) of a GenerateStream with n = 2 ends both choices with
    FINISH_REASON_CANCELLED."""

    async def main():
        dec = FakeDecode(token_delay_s=0.05)
        async with (
            fake_cluster([FakePrefill()], [dec], tiny_model_dir) as (r, _),
            grpcutil.channel(f"127.0.0.1:{r.grpc_port}") as ch,
        ):
            stub = router_pb2_grpc.RouterServiceStub(ch)
            req = router_pb2.GenerateRequest(
                prompt="hi",
                request_id="g-abort",
                n=2,
                sampling=common_pb2.SamplingParams(max_tokens=200),
            )

            async def abort_soon():
                await asyncio.sleep(0.3)
                await stub.Abort(router_pb2.AbortRequest(request_id="g-abort"))

            task = asyncio.ensure_future(abort_soon())
            msgs = [m async for m in stub.GenerateStream(req)]
            await task
            finishes = {m.index: m.finish_reason for m in msgs if m.finish_reason}
            assert finishes == {
                0: common_pb2.FINISH_REASON_CANCELLED,
                1: common_pb2.FINISH_REASON_CANCELLED,
            }
            assert sum(len(m.token_ids) for m in msgs) < 400

    asyncio.run(main())


def test_abort_over_http_ends_every_choice(tiny_model_dir):
    """An OpenAI request with n > 1 aborts under its request id: every choice finishes with
    "abort"."""

    async def main():
        dec = FakeDecode(token_delay_s=0.05)
        async with (
            fake_cluster([FakePrefill()], [dec], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
            grpcutil.channel(f"127.0.0.1:{r.grpc_port}") as ch,
        ):
            stub = router_pb2_grpc.RouterServiceStub(ch)
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 200, "n": 2}

            async def abort_soon():
                await asyncio.sleep(0.3)
                await stub.Abort(router_pb2.AbortRequest(request_id="h-abort"))

            task = asyncio.ensure_future(abort_soon())
            async with http.post(
                "/v1/completions", json=body, headers={"x-request-id": "h-abort"}
            ) as resp:
                out = await resp.json()
            await task
            assert [c["finish_reason"] for c in out["choices"]] == ["abort", "abort"]
            assert out["usage"]["completion_tokens"] < 400

    asyncio.run(main())
