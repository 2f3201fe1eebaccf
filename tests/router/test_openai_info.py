"""The endpoints that describe the server, as vLLM's OpenAI server answers them, through an
in-process router: /v1/models with ``root`` and /v1/models/{id} (the OpenAI SDK's
``models.list`` and ``models.retrieve``), /tokenize and /detokenize against the model's own
tokenizer, /version; bad input is a 400 or 404 in OpenAI's error shape."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from router_fakes import FakeDecode, FakePrefill, fake_cluster
from transformers import AutoTokenizer

from pdserve import __version__


def test_models_tokenize_detokenize_and_version(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = "Tokenize me, please."
    msgs = [{"role": "user", "content": "hi"}]
    chat = tok.encode(
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )

    async def main():
        async with (
            fake_cluster([FakePrefill()], [FakeDecode()], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{r.http_port}/v1", api_key="x")
            listed = await client.models.list()
            (model,) = listed.data
            assert model.id == "tiny" and model.model_extra["root"] == str(tiny_model_dir)
            got = await client.models.retrieve("tiny")
            assert got.id == "tiny" and got.model_extra["max_model_len"] > 0
            with pytest.raises(openai.NotFoundError, match="does not exist"):
                await client.models.retrieve("other/model")
            await client.close()

            async def post(path: str, body: dict) -> tuple[int, dict]:
                async with http.post(path, json=body) as resp:
                    return resp.status, await resp.json()

            status, out = await post("/tokenize", {"model": "tiny", "prompt": text})
            assert status == 200 and out["tokens"] == tok.encode(text), out
            assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0
            bare = await post("/tokenize", {"prompt": text, "add_special_tokens": False})
            assert bare == (200, {**out, "tokens": tok.encode(text, add_special_tokens=False),
                                  "count": len(tok.encode(text, add_special_tokens=False))})  # fmt: skip
            status, out = await post("/tokenize", {"messages": msgs})
            assert status == 200 and out["tokens"] == chat
            ids = tok.encode(text, add_special_tokens=False)
            assert await post("/detokenize", {"tokens": ids}) == (200, {"prompt": tok.decode(ids)})
            for path, body, param in (
                ("/tokenize", {}, "prompt"),
                ("/tokenize", {"prompt": text, "model": 3}, "model"),
                ("/detokenize", {"tokens": [10**9]}, "tokens"),
                ("/detokenize", {"tokens": "abc"}, "tokens"),
            ):
                status, out = await post(path, body)
                assert status == 400 and out["error"]["param"] == param, (path, body, out)
            status, out = await post("/tokenize", {"prompt": text, "model": "other"})
            assert status == 404 and out["error"]["code"] == "model_not_found"
            async with http.get("/version") as resp:
                assert resp.status == 200 and (await resp.json()) == {"version": __version__}

    asyncio.run(main())
