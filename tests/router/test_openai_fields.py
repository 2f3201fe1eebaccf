"""Every field of OpenAI's and vLLM's completions and chat request models is honoured or refused
by the router (services/router/openai_fields.py), each refused one accepting its default; a
field neither API has is a 400 naming it. vLLM's prompt options reach the workers as vLLM
applies them: ``truncate_prompt_tokens``, ``add_special_tokens``, ``add_generation_prompt``,
``continue_final_message`` and ``chat_template_kwargs``, and the ``developer`` and ``tool``
roles (the prompt ids a fake decode worker receives, against the model's own tokenizer)."""

from __future__ import annotations

import asyncio
import importlib.util

import aiohttp
import pytest
from router_fakes import FakeDecode, FakePrefill, fake_cluster
from transformers import AutoTokenizer

from pdserve.errors import InvalidArgument
from pdserve.services.router.openai_fields import ACCEPTED, CHAT, COMPLETIONS, REFUSED, check_fields

KNOWN = ACCEPTED.keys() | REFUSED.keys()


def test_every_openai_field_is_honoured_accepted_or_refused():
    import openai.types.chat.completion_create_params as chat_params
    import openai.types.completion_create_params as completion_params

    for params, honoured in ((completion_params, COMPLETIONS), (chat_params, CHAT)):
        fields = set(params.CompletionCreateParamsBase.__annotations__)
        assert len(fields) > 10
        assert fields <= honoured | KNOWN, sorted(fields - honoured - KNOWN)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_every_vllm_field_is_known_and_its_default_passes():
    from pydantic_core import PydanticUndefined
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    for model, honoured, chat in ((CompletionRequest, COMPLETIONS, False),
                                  (ChatCompletionRequest, CHAT, True)):  # fmt: skip
        fields = model.model_fields
        assert len(fields) > 40
        assert set(fields) <= honoured | KNOWN, sorted(set(fields) - honoured - KNOWN)
        for name, info in fields.items():
            if name in REFUSED and info.default is not PydanticUndefined:
                check_fields({name: info.default}, chat=chat)  # a client sending vLLM's default


def test_unknown_fields_are_refused_with_the_closest_name():
    with pytest.raises(InvalidArgument, match="did you mean 'max_tokens'") as info:
        check_fields({"max_token": 5}, chat=False)
    assert info.value.param == "max_token"
    with pytest.raises(InvalidArgument, match="unknown field") as info:
        check_fields({"typical_p": 0.9}, chat=True)
    with pytest.raises(InvalidArgument, match="not a field of /v1/completions"):
        check_fields({"messages": []}, chat=False)
    with pytest.raises(InvalidArgument, match=r"priority: not supported .*honoured on completions"):
        check_fields({"priority": 3}, api="/v1/responses")
    check_fields({"user": "u-1", "priority": 3, "skip_special_tokens": True}, chat=True)


def _run(tiny_model_dir, requests: list[tuple[str, dict]]) -> list[tuple[int, dict, list[int]]]:
    """Each (path, body) through an in-process router: (status, JSON answer, the prompt ids the
    decode worker received, [] when none was called)."""

    async def main():
        dec = FakeDecode()
        out = []
        async with (
            fake_cluster([FakePrefill()], [dec], tiny_model_dir) as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            for path, body in requests:
                before = len(dec.calls)
                async with http.post(path, json={"model": "tiny", "max_tokens": 2, **body}) as resp:
                    answer = await resp.json()
                    ids = list(dec.calls[-1].prompt_token_ids) if len(dec.calls) > before else []
                    out.append((resp.status, answer, ids))
        return out

    return asyncio.run(main())


def test_prompt_options_reach_the_workers_as_vllm_applies_them(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = "The quick brown fox jumps over the lazy dog"
    plain = tok.encode(text)
    bare = tok.encode(text, add_special_tokens=False)  # the same here: the tiny model has no BOS
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}]

    def chat_ids(**kw) -> list[int]:
        rendered = tok.apply_chat_template(msgs, tokenize=False, **kw)
        return tok.encode(rendered, add_special_tokens=False)

    continued = chat_ids(add_generation_prompt=False, continue_final_message=True)
    generation = chat_ids(add_generation_prompt=True)
    assert continued != generation
    # OpenAI's developer and tool roles reach the template as vLLM passes them
    roles = [{"role": "developer", "content": "Be brief."}, msgs[0],
             {"role": "tool", "content": "42"}]  # fmt: skip
    with_roles = tok.encode(
        tok.apply_chat_template(roles, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    runs = _run(
        tiny_model_dir,
        [
            ("/v1/completions", {"prompt": text, "truncate_prompt_tokens": 3}),
            ("/v1/completions", {"prompt": text, "add_special_tokens": False}),
            ("/v1/completions", {"prompt": text, "truncate_prompt_tokens": -1}),
            ("/v1/chat/completions", {"messages": msgs}),
            (
                "/v1/chat/completions",
                {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True},
            ),
            ("/v1/chat/completions", {"messages": msgs, "chat_template_kwargs": {"x": 1}}),
            ("/v1/chat/completions", {"messages": roles}),
        ],
    )
    assert [r[0] for r in runs] == [200] * len(runs), runs
    want = [plain[-3:], bare, plain, generation, continued, generation, with_roles]
    assert [r[2] for r in runs] == want


def test_prompt_options_refuse_what_vllm_refuses(tiny_model_dir):
    msgs = [{"role": "user", "content": "hi"}]
    bad = [
        ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("/v1/completions", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_token": 3}, "max_token"),
        ("/v1/chat/completions", {"messages": msgs, "continue_final_message": True},
         "continue_final_message"),  # with add_generation_prompt (true by default)
        ("/v1/chat/completions", {"messages": msgs, "add_generation_prompt": False,
                                  "continue_final_message": True}, "continue_final_message"),
        ("/v1/chat/completions", {"messages": msgs, "chat_template_kwargs": {"tokenize": True}},
         "chat_template_kwargs"),
        ("/v1/chat/completions", {"messages": msgs, "echo": True}, "echo"),
    ]  # fmt: skip
    runs = _run(tiny_model_dir, [(path, body) for path, body, _ in bad])
    for (status, answer, ids), (_, _, param) in zip(runs, bad, strict=True):
        assert status == 400 and answer["error"]["param"] == param, answer
        assert ids == []  # refused before any worker
