"""OpenAI's Responses API on the router: POST /v1/responses (streaming and not) and
GET /v1/responses/{id}, over the chat path (:mod:`.responses_input` turns the body into a chat
request, :class:`~.chat_run.ChatRun` runs it), so a response's text is the chat endpoint's
token for token. Output items: ``reasoning`` (with a reasoning parser), one ``message`` with
an ``output_text`` part, and a ``function_call`` per tool call. An answer is kept for
``previous_response_id`` in the router's bounded memory (:mod:`.responses_store`), for the
tenant that created it only, unless the request says ``store: false``. Errors are OpenAI's shape (:mod:`..openai_errors`); an error
after the stream began is an ``error`` event.

Streaming events, in order: ``response.created``, ``response.in_progress``; per output item
``response.output_item.added``, its parts and deltas (``response.reasoning_text.delta``,
``response.content_part.added``, ``response.output_text.delta`` / ``.done``,
``response.content_part.done``, ``response.function_call_arguments.delta`` / ``.done``),
``response.output_item.done``; then ``response.completed`` with the whole response. Tool calls
are sent once the generation has ended (the whole text is parsed for them).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web

from pdserve import errors, tenants
from pdserve.services.router.api.chat_run import ChatRun, Turn
from pdserve.services.router.api.responses_input import chat_body
from pdserve.services.router.api.responses_store import ResponseStore
from pdserve.services.router.frontend import Frontend
from pdserve.services.router.openai_errors import error_body, error_response, read_json
from pdserve.telemetry import REQUEST_ID_HEADER, request_id_var


def add_routes(app: web.Application, fe: Frontend) -> None:
    store = fe.responses

    async def create(request: web.Request) -> web.StreamResponse:
        return await _create(fe, store, request)

    async def retrieve(request: web.Request) -> web.StreamResponse:
        try:
            item = store.get(_own(request.match_info["id"]), param="response_id")
        except errors.NotFound as exc:
            return error_response(exc)
        return web.json_response(item.response)

    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{id}", retrieve)


def _own(rid: str) -> str:
    """The store key of response ``rid`` for the request's tenant: a tenant finds only its own
    responses (another's id is unknown to it: 404)."""
    return f"{tenants.current.get()}\x00{rid}"


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def _create(fe: Frontend, store: ResponseStore, request: web.Request) -> web.StreamResponse:
    headers: dict[str, str] = {}
    try:
        body = await read_json(request)
        prev = body.get("previous_response_id") if isinstance(body, dict) else None
        if prev is not None and not isinstance(prev, str):
            raise errors.InvalidArgument(
                "previous_response_id must be a string", param="previous_response_id"
            )
        history = store.get(_own(prev)).messages if prev else []
        chat, conversation = chat_body(body, history)
        header_id = request.headers.get(REQUEST_ID_HEADER, "")
        if header_id and not chat.get("request_id"):
            chat["request_id"] = header_id
        keep = body.get("store", True)
        if not isinstance(keep, bool):
            raise errors.InvalidArgument("store must be true or false", param="store")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise errors.InvalidArgument("stream must be true or false", param="stream")
        run = await ChatRun.start(fe, chat)
    except Exception as exc:
        return error_response(exc, headers)
    request_id_var.set(run.request_id)
    headers[REQUEST_ID_HEADER] = run.request_id
    shape = _Shape(run.fe, body, _id("resp"), prev, keep)

    def remember(response: dict[str, Any], turn: Turn) -> None:
        if keep:
            store.put(_own(shape.id), [*conversation, _assistant(turn)], response)

    if not stream:
        turn = await run.whole()
        response = shape.response(turn, shape.items(turn))
        remember(response, turn)
        return web.json_response(response, headers=headers)
    return await _stream(request, run, shape, headers, remember)


def _assistant(turn: Turn) -> dict[str, Any]:
    """The chat message a later response's conversation holds for this one's output."""
    msg: dict[str, Any] = {"role": "assistant", "content": turn.content or ""}
    if turn.tool_calls:
        msg["tool_calls"] = turn.tool_calls
    return msg


class _Shape:
    """The Responses objects of one request: ids, the echoed settings, the output items."""

    def __init__(
        self, fe: Frontend, body: dict[str, Any], rid: str, prev: str | None, keep: bool
    ) -> None:
        self.id = rid
        self.created = int(time.time())
        self.model = fe.limits.model
        self.body = body
        self.prev = prev
        self.keep = keep
        self.message_id = _id("msg")
        self.reasoning_id = _id("rs")

    def response(self, turn: Turn | None, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The ``response`` object (``turn`` None: in progress)."""
        b = self.body
        incomplete = turn is not None and turn.finish == "length"
        status = "in_progress" if turn is None else ("incomplete" if incomplete else "completed")
        usage = None
        if turn is not None:
            usage = {
                "input_tokens": turn.prompt_tokens,
                "input_tokens_details": {"cached_tokens": turn.cached_tokens},
                "output_tokens": turn.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": turn.prompt_tokens + turn.completion_tokens,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": usage,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "metadata": b.get("metadata") or {},
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": self.prev,
            "store": self.keep,
            "temperature": b.get("temperature"),
            "top_p": b.get("top_p"),
            "text": b.get("text") or {"format": {"type": "text"}},
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [],
            "truncation": "disabled",
            "user": b.get("user"),
        }

    def reasoning_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "status": status,
        }

    def message_item(self, text: str | None, status: str = "completed") -> dict[str, Any]:
        content = [] if text is None else [_part(text)]
        return {
            "type": "message",
            "id": self.message_id,
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def items(self, turn: Turn) -> list[dict[str, Any]]:
        """The output items of a finished turn."""
        out = []
        if turn.reasoning:
            out.append(self.reasoning_item(turn.reasoning))
        if turn.content or not turn.tool_calls:
            out.append(self.message_item(turn.content or ""))
        out += [_call_item(c) for c in turn.tool_calls]
        return out


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"],
        "status": status,
    }


async def _stream(request, run: ChatRun, shape: _Shape, headers, remember) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await resp.prepare(request)
    seq = 0

    async def send(kind: str, **payload: Any) -> None:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **payload}
        seq += 1
        await resp.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())

    items: list[dict[str, Any]] = []
    #: The item being streamed: "reasoning", "message" or None.
    open_kind: str | None = None
    text = {"reasoning": "", "message": ""}

    async def close() -> None:
        nonlocal open_kind
        if open_kind == "reasoning":
            done = shape.reasoning_item(text["reasoning"])
            await send(
                "response.reasoning_text.done",
                item_id=shape.reasoning_id,
                output_index=len(items),
                content_index=0,
                text=text["reasoning"],
            )
        elif open_kind == "message":
            done = shape.message_item(text["message"])
            where = {"item_id": shape.message_id, "output_index": len(items), "content_index": 0}
            await send("response.output_text.done", **where, text=text["message"], logprobs=[])
            await send("response.content_part.done", **where, part=_part(text["message"]))
        else:
            return
        await send("response.output_item.done", output_index=len(items), item=done)
        items.append(done)
        open_kind = None

    async def piece(kind: str, delta: str) -> None:
        nonlocal open_kind
        if open_kind != kind:
            await close()
            open_kind = kind
            if kind == "reasoning":
                item = shape.reasoning_item("", "in_progress")
            else:
                item = shape.message_item(None, "in_progress")
            await send("response.output_item.added", output_index=len(items), item=item)
            if kind == "message":
                await send(
                    "response.content_part.added",
                    item_id=shape.message_id,
                    output_index=len(items),
                    content_index=0,
                    part=_part(""),
                )
        text[kind] += delta
        item_id = shape.reasoning_id if kind == "reasoning" else shape.message_id
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra = {} if kind == "reasoning" else {"logprobs": []}
        where = {"item_id": item_id, "output_index": len(items), "content_index": 0}
        await send(name, **where, delta=delta, **extra)

    try:
        await send("response.created", response=shape.response(None, []))
        await send("response.in_progress", response=shape.response(None, []))
        async for delta in run.deltas():
            if delta.get("reasoning"):
                await piece("reasoning", delta["reasoning"])
            if delta.get("content"):
                await piece("message", delta["content"])
        turn = run.turn
        assert turn is not None
        if not turn.tool_calls and open_kind != "message" and not text["message"]:
            await piece("message", "")  # an empty answer is still one message
        await close()
        for call in turn.tool_calls:
            item = _call_item(call)
            index = len(items)
            await send("response.output_item.added", output_index=index, item=item)
            where = {"item_id": item["id"], "output_index": index}
            await send("response.function_call_arguments.delta", **where, delta=item["arguments"])
            await send(
                "response.function_call_arguments.done", **where, arguments=item["arguments"]
            )
            await send("response.output_item.done", output_index=index, item=item)
            items.append(item)
        response = shape.response(turn, items)
        remember(response, turn)
        await send("response.completed", response=response)
    except (ConnectionResetError, ConnectionError):
        return resp
    except Exception as exc:
        err = error_body(exc)[1]["error"]
        await send("error", code=err["code"], message=err["message"], param=err["param"])
    await resp.write_eof()
    return resp
