"""/v1/responses and /v1/messages bodies as the chat requests they mean (services/router/api/
responses_input.py, messages.py), the bounded memory behind ``previous_response_id``
(responses_store.py), and the field table covering OpenAI's, Anthropic's and vLLM's request
models of both APIs. No network: plain functions."""

from __future__ import annotations

import importlib.util

import pytest

from pdserve.errors import InvalidArgument, NotFound
from pdserve.services.router.api.messages import chat_body as messages_chat
from pdserve.services.router.api.responses_input import chat_body as responses_chat
from pdserve.services.router.api.responses_store import ResponseStore
from pdserve.services.router.openai_fields import REFUSED, REFUSED_IN, check_fields, known

TOOL = {"type": "function", "name": "add", "parameters": {"type": "object"}}


def test_responses_input_becomes_chat_messages():
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "ok"}]
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "add 1 and 2"}]},
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call_output", "call_id": "c1", "output": "3"},
        ],
        "max_output_tokens": 7,
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "add"},
        "text": {"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}}},
        "temperature": 0,
    }
    chat, conversation = responses_chat(body, history)
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat["messages"][1:] == conversation
    assert conversation[:2] == history
    user, calls, result = conversation[2:]
    assert user == {"role": "user", "content": "add 1 and 2"}
    assert [c["id"] for c in calls["tool_calls"]] == ["c1", "c2"]  # one assistant turn
    assert calls["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert result == {"role": "tool", "tool_call_id": "c1", "content": "3"}
    assert chat["max_tokens"] == 7 and chat["temperature"] == 0
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert responses_chat({"model": "m", "input": "hi"}, [])[0]["messages"] == [
        {"role": "user", "content": "hi"}
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": 3}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        ({"input": [{"type": "function_call_output", "output": "3"}]}, "input[0].call_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "x", "tools": [TOOL], "tool_choice": "maybe"}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": "x", "instructions": 5}, "instructions"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "messages": []}, "messages"),  # a chat field, not a Responses one
        ({"input": "x", "max_tokens": 5}, "max_tokens"),
    ],
)
def test_malformed_responses_bodies_are_400s_naming_the_field(body, param):
    with pytest.raises(InvalidArgument) as info:
        responses_chat({"model": "m", **body}, [])
    assert info.value.param == param, info.value
    assert param.split("[")[0] in str(info.value)


def test_anthropic_messages_become_chat_messages():
    body = {
        "model": "m",
        "max_tokens": 9,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "add 1 and 2"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Adding."},
                    {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1, "b": 2}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "3"},
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
        "tools": [{"name": "add", "description": "adds", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["\n\n"],
        "top_k": 1,
    }
    chat = messages_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "add 1 and 2"},
        {
            "role": "assistant",
            "content": "Adding.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "3"},
        {"role": "user", "content": "Thanks"},
    ]
    assert chat["tools"][0]["function"] == {
        "name": "add",
        "parameters": {"type": "object"},
        "description": "adds",
    }
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)
    assert (chat["max_tokens"], chat["stop"], chat["top_k"]) == (9, ["\n\n"], 1)
    named = messages_chat({**body, "tool_choice": {"type": "tool", "name": "add"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "add"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content[0]",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use"}]}]},
            "messages[0].content[0]",
        ),
        ({"system": 5}, "system"),
        ({"tools": [{"name": "f"}]}, "tools[0]"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking"),
        ({"max_completion_tokens": 5}, "max_completion_tokens"),
    ],
)
def test_malformed_messages_bodies_are_400s_naming_the_field(body, param):
    good = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(InvalidArgument) as info:
        messages_chat({**good, **body})
    assert info.value.param == param, info.value


def test_the_store_is_bounded_expires_and_names_what_is_missing():
    now = [0.0]
    store = ResponseStore(max_stored=2, ttl_s=10, clock=lambda: now[0])
    for k in range(3):
        store.put(f"r{k}", [{"role": "user", "content": str(k)}], {"id": f"r{k}"})
    assert len(store) == 2
    with pytest.raises(NotFound, match="r0") as info:
        store.get("r0")  # dropped: the oldest beyond max_stored
    assert info.value.param == "previous_response_id"
    assert store.get("r2").messages == [{"role": "user", "content": "2"}]
    now[0] = 10.5
    with pytest.raises(NotFound, match="10 s"):
        store.get("r1")  # past its ttl
    assert len(store) == 1


def test_every_responses_and_messages_field_is_honoured_accepted_or_refused():
    import anthropic.types.message_create_params as anthropic_params
    import openai.types.responses.response_create_params as responses_params

    for fields, api in (
        (responses_params.ResponseCreateParamsBase.__annotations__, "/v1/responses"),
        (anthropic_params.MessageCreateParamsBase.__annotations__, "/v1/messages"),
    ):
        assert len(fields) > 10
        assert set(fields) <= known(api), sorted(set(fields) - known(api))


@pytest.mark.slow  # importing vLLM runs a subprocess (cpuinfo's `file`)
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_every_vllm_responses_and_messages_field_is_known_and_its_default_passes():
    from pydantic_core import PydanticUndefined
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    for model, api in (
        (ResponsesRequest, "/v1/responses"),
        (AnthropicMessagesRequest, "/v1/messages"),
    ):
        fields = model.model_fields
        assert set(fields) <= known(api), sorted(set(fields) - known(api))
        refused = REFUSED.keys() | REFUSED_IN.get(api, {}).keys()
        for name, info in fields.items():
            if name in refused and info.default is not PydanticUndefined:
                check_fields({name: info.default}, api=api)


def test_chat_history_with_tool_calls_and_results():
    from pdserve.services.router.request import check_messages

    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    msgs = check_messages(
        [
            {"role": "user", "content": "add"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
        ]
    )
    assert msgs[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
        ],
    }  # arguments as an object for the template, as vLLM passes them
    assert msgs[2] == {"role": "tool", "content": "1", "tool_call_id": "c1"}
    bad_calls = [
        ({"role": "assistant", "content": "", "tool_calls": {}}, "messages[0].tool_calls"),
        ({"role": "user", "content": "", "tool_calls": [call]}, "messages[0].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "add"}}]}, "tool_calls"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
            "not valid JSON",
        ),
        ({"role": "user", "content": "x", "tool_call_id": "c1"}, "tool_call_id"),
        ({"role": "assistant", "content": None}, "messages[0].content"),
    ]
    for message, words in bad_calls:
        with pytest.raises(InvalidArgument, match=words.replace("[", r"\[")):
            check_messages([message])


@pytest.mark.parametrize(
    "tools",
    [
        "get_weather",
        [],
        [{"type": "function"}],
        [{"type": "function", "function": {"name": ""}}],
        [{"type": "web_search"}],
        [{"type": "function", "function": {"name": "f", "parameters": "any"}}],
    ],
)
def test_malformed_chat_tools_are_400s_before_vllm_loads(tools, tmp_path):
    from pdserve.services.router.api.parsers import ParserConfig, Parsers

    parsers = Parsers(ParserConfig(), tmp_path)  # no model there: nothing may be loaded
    with pytest.raises(InvalidArgument, match="tools") as info:
        parsers.for_chat({"tools": tools})
    assert info.value.param == "tools"
