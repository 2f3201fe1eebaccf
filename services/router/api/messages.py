"""Anthropic's Messages API on the router: POST /v1/messages (streaming and not), over the chat
path as vLLM serves it, so the text is the chat endpoint's token for token. ``system`` becomes a
system message, ``tool_use`` blocks an assistant message's ``tool_calls``, ``tool_result``
blocks tool messages, ``tools`` (``{name, description, input_schema}``) and ``tool_choice``
(``auto`` / ``any`` / ``tool`` / ``none``) the chat ones (``any`` is ``required``); the answer
has ``text`` and ``tool_use`` content blocks and Anthropic's ``stop_reason``. Errors are
Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``; streaming sends
Anthropic's events (``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``,
``message_delta``, ``message_stop``; tool_use blocks once the generation has ended).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from pdserve.errors import InvalidArgument
from pdserve.services.router.api.chat_run import ChatRun, Turn
from pdserve.services.router.frontend import Frontend
from pdserve.services.router.openai_errors import error_body, read_json, with_retry_after
from pdserve.services.router.openai_fields import check_fields
from pdserve.telemetry import REQUEST_ID_HEADER, request_id_var

API = "/v1/messages"
#: HTTP status -> Anthropic's error type.
_ERRORS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
_STOP = {"length": "max_tokens", "stop": "end_turn", "abort": "end_turn", "tool_calls": "tool_use"}


def add_routes(app: web.Application, fe: Frontend) -> None:
    async def create(request: web.Request) -> web.StreamResponse:
        return await _create(fe, request)

    app.router.add_post(API, create)


def error_response(exc: BaseException, headers: dict[str, str] | None = None) -> web.Response:
    status, body = error_body(exc)
    kind = _ERRORS.get(status, "api_error")
    return web.json_response(
        {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}},
        status=status,
        headers=with_retry_after(exc, headers),
    )


async def _create(fe: Frontend, request: web.Request) -> web.StreamResponse:
    try:
        body = await read_json(request)
        chat = chat_body(body)
        header_id = request.headers.get(REQUEST_ID_HEADER, "")
        if header_id:
            chat["request_id"] = header_id
        run = await ChatRun.start(fe, chat)
    except Exception as exc:
        return error_response(exc)
    request_id_var.set(run.request_id)
    headers = {REQUEST_ID_HEADER: run.request_id}
    mid = f"msg_{uuid.uuid4().hex}"
    if not body.get("stream"):
        turn = await run.whole()
        return web.json_response(_message(mid, run.fe.limits.model, turn), headers=headers)
    return await _stream(request, run, mid, run.fe.limits.model, headers)


def chat_body(body: Any) -> dict[str, Any]:
    """The chat completions body of an Anthropic Messages ``body`` (400 naming what is wrong)."""
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object")
    check_fields(body, api=API)
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidArgument("max_tokens is required: a positive integer", param="max_tokens")
    if body.get("stream") not in (None, True, False):
        raise InvalidArgument("stream must be true or false", param="stream")
    chat: dict[str, Any] = {
        k: body[k]
        for k in ("model", "temperature", "top_p", "top_k", "cache_salt", "chat_template_kwargs")
        if k in body
    }
    chat["max_tokens"] = max_tokens
    messages = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text(system, "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise InvalidArgument("messages must be a non-empty list", param="messages")
    for i, m in enumerate(turns):
        messages += _turn(m, f"messages[{i}]")
    chat["messages"] = messages
    stop = body.get("stop_sequences")
    if stop is not None:
        chat["stop"] = stop
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(body["tool_choice"]))
    return chat


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for k, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text":
                raise InvalidArgument(f"{where}[{k}] must be a text block", param=where)
            if not isinstance(block.get("text"), str):
                raise InvalidArgument(f"{where}[{k}].text must be a string", param=where)
            out.append(block["text"])
        return "".join(out)
    raise InvalidArgument(f"{where} must be a string or a list of text blocks", param=where)


def _turn(m: Any, where: str) -> list[dict[str, Any]]:
    """The chat messages of one Anthropic message: text, tool_use and tool_result blocks."""
    role = m.get("role") if isinstance(m, dict) else None
    if role not in ("user", "assistant"):
        raise InvalidArgument(f"{where}.role must be user or assistant", param=f"{where}.role")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidArgument(
            f"{where}.content must be a string or a list of blocks", param=f"{where}.content"
        )
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for k, block in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            name, args, cid = block.get("name"), block.get("input"), block.get("id")
            if not isinstance(name, str) or not isinstance(args, dict) or not isinstance(cid, str):
                raise InvalidArgument(
                    f"{at}: tool_use needs id, name and input (an object)", param=at
                )
            fn = {"name": name, "arguments": json.dumps(args)}
            calls.append({"id": cid, "type": "function", "function": fn})
        elif kind == "tool_result" and role == "user":
            cid = block.get("tool_use_id")
            if not isinstance(cid, str):
                raise InvalidArgument(f"{at}: tool_result needs tool_use_id", param=at)
            text = _text(block.get("content", ""), f"{at}.content")
            results.append({"role": "tool", "tool_call_id": cid, "content": text})
        else:
            raise InvalidArgument(
                f"{at}: {kind!r:.30} blocks are not supported here (text; tool_use from the "
                "assistant; tool_result from the user)",
                param=at,
            )
    out = list(results)
    if texts or calls or not results:
        msg: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidArgument("tools must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        name = tool.get("name") if isinstance(tool, dict) else None
        schema = tool.get("input_schema") if isinstance(tool, dict) else None
        if not isinstance(name, str) or not isinstance(schema, dict):
            raise InvalidArgument(
                f"tools[{i}] must be {{name, description, input_schema}} (custom tools only)",
                param=f"tools[{i}]",
            )
        fn = {"name": name, "parameters": schema}
        if "description" in tool:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    out: dict[str, Any]
    if kind in ("auto", "none"):
        out = {"tool_choice": kind}
    elif kind == "any":
        out = {"tool_choice": "required"}
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out = {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    else:
        raise InvalidArgument(
            "tool_choice must be {type: auto | any | none} or {type: tool, name}",
            param="tool_choice",
        )
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def _blocks(turn: Turn) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if turn.content or not turn.tool_calls:
        out.append({"type": "text", "text": turn.content or ""})
    for c in turn.tool_calls:
        fn = c["function"]
        out.append({"type": "tool_use", "id": c["id"], "name": fn["name"], "input": _args(fn)})
    return out


def _args(fn: dict[str, Any]) -> Any:
    try:
        return json.loads(fn["arguments"] or "{}")
    except ValueError:
        return {}


def _usage(turn: Turn | None) -> dict[str, Any]:
    return {
        "input_tokens": turn.prompt_tokens if turn else 0,
        "output_tokens": turn.completion_tokens if turn else 0,
        "cache_read_input_tokens": turn.cached_tokens if turn else 0,
    }


def _message(mid: str, model: str, turn: Turn | None) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _blocks(turn) if turn else [],
        "stop_reason": _STOP.get(turn.finish, "end_turn") if turn else None,
        "stop_sequence": None,
        "usage": _usage(turn),
    }


async def _stream(request, run: ChatRun, mid: str, model: str, headers) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await resp.prepare(request)

    async def send(kind: str, **payload: Any) -> None:
        data = json.dumps({"type": kind, **payload})
        await resp.write(f"event: {kind}\ndata: {data}\n\n".encode())

    try:
        await send("message_start", message=_message(mid, model, None))
        await send("content_block_start", index=0, content_block={"type": "text", "text": ""})
        async for delta in run.deltas():
            if delta.get("content"):
                text = {"type": "text_delta", "text": delta["content"]}
                await send("content_block_delta", index=0, delta=text)
        await send("content_block_stop", index=0)
        turn = run.turn
        assert turn is not None
        for k, c in enumerate(turn.tool_calls, start=1):
            fn = c["function"]
            block = {"type": "tool_use", "id": c["id"], "name": fn["name"], "input": {}}
            await send("content_block_start", index=k, content_block=block)
            partial = {"type": "input_json_delta", "partial_json": fn["arguments"]}
            await send("content_block_delta", index=k, delta=partial)
            await send("content_block_stop", index=k)
        stop = {"stop_reason": _STOP.get(turn.finish, "end_turn"), "stop_sequence": None}
        await send("message_delta", delta=stop, usage=_usage(turn))
        await send("message_stop")
    except (ConnectionResetError, ConnectionError):
        return resp
    except Exception as exc:
        status, body = error_body(exc)
        err = {"type": _ERRORS.get(status, "api_error"), "message": body["error"]["message"]}
        await send("error", error=err)
    await resp.write_eof()
    return resp
