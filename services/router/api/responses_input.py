"""A /v1/responses body as the chat completions body it means (vLLM serves Responses over its
chat path the same way): ``instructions`` a system message, ``input`` (a string, or items:
messages, ``function_call`` and ``function_call_output``) chat messages after the stored
conversation of ``previous_response_id``, flat function ``tools`` and ``tool_choice`` in the
chat shape, ``text.format`` as ``response_format``, ``max_output_tokens`` as ``max_tokens``.
Every malformed part is a 400 naming it."""

from __future__ import annotations

from typing import Any

from pdserve.errors import InvalidArgument
from pdserve.services.router.openai_fields import check_fields

API = "/v1/responses"
#: Fields passed to the chat request as they are.
_SAME = (
    "model", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "stop_token_ids", "cache_salt",
    "request_id", "include_reasoning", "skip_special_tokens", "chat_template_kwargs",
    "parallel_tool_calls",
)  # fmt: skip
_ROLES = ("user", "system", "developer", "assistant")


def chat_body(body: Any, history: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict]]:
    """(the chat completions body of a Responses ``body``, the conversation it continues with:
    ``history`` (the previous response's, [] for none) and this input, without the
    instructions, which OpenAI does not carry to the next response)."""
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object")
    check_fields(body, api=API)
    turn = input_messages(body.get("input"))
    conversation = [*history, *turn]
    messages = list(conversation)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidArgument("instructions must be a string", param="instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict[str, Any] = {k: body[k] for k in _SAME if k in body}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    fmt = text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat, conversation


def input_messages(items: Any) -> list[dict[str, Any]]:
    """Chat messages of a Responses ``input``: consecutive ``function_call`` items become one
    assistant message's ``tool_calls``; ``reasoning`` items are dropped (the model's own
    past reasoning is not fed back, as vLLM does)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidArgument("input must be a string or a non-empty list of items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidArgument(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise InvalidArgument(
                    f"{where}.role must be one of {list(_ROLES)}, got {role!r:.40}",
                    param=f"{where}.role",
                )
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = _function_call(item, where)
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidArgument(f"{where}.call_id must be a string", param=f"{where}.call_id")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind != "reasoning":
            raise InvalidArgument(
                f"{where}.type must be message, function_call, function_call_output or "
                f"reasoning, got {kind!r:.40}",
                param=f"{where}.type",
            )
    if not out:
        raise InvalidArgument("input holds no message", param="input")
    return out


def _text(content: Any, where: str) -> str:
    """The text of a string or a list of text parts (input_text, output_text, text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str
            ):
                raise InvalidArgument(
                    f"{where}[{k}]: only text parts ({{type: input_text, text}}) are supported",
                    param=where,
                )
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidArgument(f"{where} must be a string or a list of text parts", param=where)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
    for field, value in (("call_id", call_id), ("name", name), ("arguments", args)):
        if not isinstance(value, str) or (field != "arguments" and not value):
            raise InvalidArgument(f"{where}.{field} must be a string", param=f"{where}.{field}")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Responses function tools (``{type: function, name, description, parameters, strict}``)
    in the chat shape; other tool types are refused."""
    if not isinstance(tools, list):
        raise InvalidArgument("tools must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise InvalidArgument(
                f"tools[{i}]: only function tools are supported, got {kind!r:.40}",
                param=f"tools[{i}]",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise InvalidArgument(f"tools[{i}].name must be a string", param=f"tools[{i}].name")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        extra = sorted(set(tool) - {"type", *fn})
        if extra:
            raise InvalidArgument(f"tools[{i}]: unknown fields {extra}", param=f"tools[{i}]")
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """``none`` / ``auto`` / ``required`` / ``{type: function, name}`` in the chat shape."""
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(name, str) and name:
            return {"type": "function", "function": {"name": name}}
    raise InvalidArgument(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}, '
        f"got {choice!r:.80}",
        param="tool_choice",
    )


def text_format(text: Any) -> dict[str, Any] | None:
    """The chat ``response_format`` of Responses' ``text: {format: ...}`` (None: plain)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise InvalidArgument("text must be {format: {type: ...}}", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise InvalidArgument(
            "text.verbosity: not supported by this server (not implemented); leave it unset",
            param="text.verbosity",
        )
    fmt = text.get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise InvalidArgument("text.format must be an object", param="text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]},
        }
    raise InvalidArgument(
        "text.format must be {type: text}, {type: json_object} or {type: json_schema, name, "
        f"schema}}, got {fmt!r:.80}",
        param="text.format",
    )
