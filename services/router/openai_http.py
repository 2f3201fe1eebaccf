"""OpenAI-compatible HTTP API (aiohttp): /v1/completions, /v1/chat/completions (SSE streaming
and not), /v1/models, /health, /metrics.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with 400 (bad
input), 404 (unknown model), 429 (admission refused), 503 (no worker), 504 (deadline).

Beyond OpenAI's fields, the completions bodies take vLLM's ``cache_salt`` (a tenant's secret:
prefix caching and ``usage.prompt_tokens_details.cached_tokens`` only among requests with the
same salt; validated by :func:`pdserve.validation.check_cache_salt`), ``top_k``, ``seed``,
``ignore_eos`` and ``request_id``.

Request ids: a request's id is its body's ``request_id``, else the ``x-request-id`` header,
else a fresh one; the response echoes it in ``x-request-id`` (and in the logs of every
service the request passes through).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve import auth, errors
from pdserve.services.router.frontend import Frontend
from pdserve.services.router.orchestrator import StreamChunk
from pdserve.services.router.workers import DECODE
from pdserve.telemetry import REGISTRY, REQUEST_ID_HEADER, request_id_var
from pdserve.v1 import common_pb2

log = logging.getLogger(__name__)

FINISH = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_EOS: "stop",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_CANCELLED: "abort",
}
#: Error class -> HTTP status, OpenAI type and code; the first match wins (subclasses first).
_STATUS = {
    errors.InvalidArgument: (400, "invalid_request_error", "invalid_value"),
    errors.ModelNotFound: (404, "invalid_request_error", "model_not_found"),
    errors.NotFound: (404, "invalid_request_error", "not_found"),
    errors.ResourceExhausted: (429, "rate_limit_error", "rate_limit_exceeded"),
    errors.Unavailable: (503, "service_unavailable", "service_unavailable"),
    errors.DeadlineExceeded: (504, "timeout", "timeout"),
}


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """HTTP status and OpenAI error JSON for an exception."""
    status, etype, code = 500, "internal_error", "internal_error"
    for cls, info in _STATUS.items():
        if isinstance(exc, cls):
            status, etype, code = info
            break
    message = str(exc) or type(exc).__name__
    param = exc.param if isinstance(exc, errors.PdserveError) else None
    return status, {"error": {"message": message, "type": etype, "param": param, "code": code}}


def error_response(exc: BaseException, headers: dict[str, str] | None = None) -> web.Response:
    status, body = error_body(exc)
    if status == 500:
        log.error("internal error: %r", exc, exc_info=exc)
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def _http_errors(request: web.Request, handler) -> web.StreamResponse:
    """Unknown paths and methods answer in the OpenAI error shape too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        etype = "not_found" if exc.status == 404 else "invalid_request_error"
        body = {
            "message": f"{request.method} {request.path}: {exc.reason}",
            "type": etype,
            "param": None,
            "code": exc.status,
        }
        return web.json_response({"error": body}, status=exc.status)


def _require_key(key: str, metrics_need_key: bool):
    """401 in the OpenAI error shape for a request without ``key`` (/health is open, and
    /metrics unless ``metrics_need_key``)."""
    open_paths = {"/health"} | (set() if metrics_need_key else {"/metrics"})

    @web.middleware
    async def require(request: web.Request, handler) -> web.StreamResponse:
        why = (
            ""
            if request.path in open_paths
            else auth.problem(request.headers.get("Authorization"), key)
        )
        if not why:
            return await handler(request)
        body = {"message": why, "type": "invalid_request_error", "param": None}
        return web.json_response(
            {"error": {**body, "code": "invalid_api_key"}},
            status=401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    return require


def make_app(fe: Frontend, *, api_key: str = "", metrics_need_key: bool = False) -> web.Application:
    middlewares = [_http_errors]
    if api_key:
        middlewares.insert(0, _require_key(api_key, metrics_need_key))
    app = web.Application(middlewares=middlewares)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _generate(fe, request, chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await _generate(fe, request, chat=True)

    async def models(request: web.Request) -> web.Response:
        return await _models(fe)

    async def health(request: web.Request) -> web.Response:
        return await _health(fe)

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", _metrics)
    return app


async def _models(fe: Frontend) -> web.Response:
    info = fe.model_info()
    model = {
        "id": info.name,
        "object": "model",
        "created": 0,
        "owned_by": "pdserve",
        "max_model_len": info.max_model_len,
    }
    if info.refused_workers:
        model["refused_workers"] = list(info.refused_workers)
    return web.json_response({"object": "list", "data": [model]})


async def _health(fe: Frontend) -> web.Response:
    decode = len(fe.pool.candidates(DECODE))
    body = {"status": "ok" if decode else "no decode worker", "decode_workers": decode}
    return web.json_response(body, status=200 if decode else 503)


async def _metrics(request: web.Request) -> web.Response:
    resp = web.Response(body=generate_latest(REGISTRY))
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp


async def _generate(fe: Frontend, request: web.Request, *, chat: bool) -> web.StreamResponse:
    try:
        body = json.loads(await request.read())
        # JSON may spell a lone surrogate (\ud800) that no UTF-8 text can hold; the tokenizer
        # would fail on it deep inside. Refuse it here, whatever field it is in.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return error_response(
            errors.InvalidArgument("request body holds invalid Unicode (a lone surrogate)")
        )
    except ValueError as exc:
        return error_response(errors.InvalidArgument(f"request body is not valid JSON: {exc}"))
    except RecursionError:  # [[[[... thousands deep: json gives up (a RuntimeError)
        return error_response(errors.InvalidArgument("request body is nested too deeply"))
    header_id = request.headers.get(REQUEST_ID_HEADER, "")
    if header_id and isinstance(body, dict) and not body.get("request_id"):
        body = {**body, "request_id": header_id}
    try:
        # Tokenizing a long prompt takes a while: off the event loop, so /health and other
        # requests keep being answered meanwhile.
        req = await asyncio.to_thread(fe.from_openai, body, chat=chat)
    except Exception as exc:
        return error_response(exc)
    request_id_var.set(req.request_id)
    headers = {REQUEST_ID_HEADER: req.request_id}
    stream = bool(body.get("stream", False))
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        bad = errors.InvalidArgument(
            f"stream_options must be an object, got {stream_options!r:.100}", param="stream_options"
        )
        return error_response(bad, headers)
    usage_in_stream = bool(stream_options.get("include_usage", False))
    meta = {
        "id": ("chatcmpl-" if chat else "cmpl-") + (req.request_id or uuid.uuid4().hex),
        "created": int(time.time()),
        "model": fe.limits.model,
    }
    gen = fe.orchestrator.generate(req)
    async with contextlib.aclosing(gen):
        try:
            first = await anext(gen)  # admission and worker errors surface before any byte
        except StopAsyncIteration:
            first = StreamChunk([], "", [], common_pb2.FINISH_REASON_STOP)
        except Exception as exc:
            return error_response(exc, headers)
        if stream:
            return await _sse(request, gen, first, meta, headers, chat=chat, usage=usage_in_stream)
        return await _whole(gen, first, meta, headers, chat=chat)


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def _whole(
    gen, first: StreamChunk, meta: dict[str, Any], headers: dict[str, str], *, chat: bool
) -> web.Response:
    texts, count, finish, c = [], 0, None, first
    prompt, cached = first.prompt_tokens, first.cached_tokens
    try:
        while True:
            texts.append(c.text)
            count += len(c.token_ids)
            if c.finish:
                finish = FINISH.get(c.finish, "stop")
            try:
                c = await anext(gen)
            except StopAsyncIteration:
                break
    except Exception as exc:
        return error_response(exc, headers)
    text = "".join(texts)
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return web.json_response(
        {**meta, "object": obj, "choices": [choice], "usage": _usage(prompt, count, cached)},
        headers=headers,
    )


async def _sse(
    request: web.Request,
    gen,
    first: StreamChunk,
    meta: dict[str, Any],
    headers: dict[str, str],
    *,
    chat: bool,
    usage: bool,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await resp.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"

    async def send(payload: dict[str, Any]) -> None:
        await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def choice(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    prompt, cached, count = first.prompt_tokens, first.cached_tokens, 0
    try:
        if chat:
            await send({**meta, "object": obj, "choices": [choice("", None, role=True)]})
        c: StreamChunk | None = first
        while c is not None:
            count += len(c.token_ids)
            finish = FINISH.get(c.finish) if c.finish else None
            if c.text or finish:
                await send({**meta, "object": obj, "choices": [choice(c.text, finish)]})
            try:
                c = await anext(gen)
            except StopAsyncIteration:
                c = None
        if usage:
            await send(
                {**meta, "object": obj, "choices": [], "usage": _usage(prompt, count, cached)}
            )
    except (ConnectionResetError, ConnectionError):
        return resp  # the client went away: closing ``gen`` cancels the worker calls
    except Exception as exc:
        await send(error_body(exc)[1])
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
