"""The chat completions answer of a request with tools or a reasoning parser (a
:class:`~pdserve.services.router.api.chat_run.ChatRun`): the message with ``tool_calls`` and
``reasoning`` / ``reasoning_content``, or its SSE stream of deltas in OpenAI's shape (tool
calls as ``delta.tool_calls[{index, id, type, function: {name, arguments}}]``), with
finish_reason ``tool_calls`` as vLLM sets it."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from pdserve.services.router.api.chat_run import ChatRun
from pdserve.services.router.openai_errors import error_body


async def answer(
    request: web.Request,
    run: ChatRun,
    meta: dict[str, Any],
    headers: dict[str, str],
    *,
    stream: bool,
    usage: bool,
) -> web.StreamResponse:
    if not stream:
        turn = await run.whole()
        choice = {"index": 0, "message": turn.message(), "logprobs": None}
        body = {
            **meta,
            "object": "chat.completion",
            "choices": [{**choice, "finish_reason": turn.finish}],
            "usage": turn.usage(),
        }
        return web.json_response(body, headers=headers)
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await resp.prepare(request)
    obj = {**meta, "object": "chat.completion.chunk"}

    async def send(payload: dict[str, Any]) -> None:
        await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**obj, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    try:
        await send(chunk({"role": "assistant", "content": ""}))
        async for delta in run.deltas():
            if "reasoning" in delta:
                delta["reasoning_content"] = delta["reasoning"]
            await send(chunk(delta))
        assert run.turn is not None
        await send(chunk({}, run.turn.finish))
        if usage:
            await send({**obj, "choices": [], "usage": run.turn.usage()})
    except (ConnectionResetError, ConnectionError):
        return resp
    except Exception as exc:
        await send(error_body(exc)[1])
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
