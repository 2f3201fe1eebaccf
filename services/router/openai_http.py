"""OpenAI-compatible HTTP API (aiohttp): /v1/completions, /v1/chat/completions (SSE streaming
and not; a chat request with tools or a reasoning parser is answered by
:mod:`~pdserve.services.router.api.chat_http`); /v1/responses and /v1/messages (Anthropic's
shape) are :mod:`~pdserve.services.router.api`'s; the endpoints that describe the server
(/v1/models, /tokenize, /version, /health, /metrics, ...) are
:mod:`~pdserve.services.router.openai_info`'s.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with 400 (bad
input), 401 (no or a wrong API key), 403 (a tenant header from no trusted gateway:
:mod:`~pdserve.services.router.gateway`), 404 (unknown model), 429 (admission refused, or a
wrong API key past a budget: :class:`pdserve.auth.KeyFailures`), 503 (no worker), 504
(deadline). Connection limits (header and body timeouts, connections per address) are
:mod:`~pdserve.http_edge`'s.

Beyond OpenAI's fields, the completions bodies take vLLM's ``cache_salt`` (a tenant's secret:
prefix caching and ``usage.prompt_tokens_details.cached_tokens`` only among requests with the
same salt; validated by :func:`pdserve.validation.check_cache_salt`), ``top_k``, ``seed``,
``ignore_eos``, ``repetition_penalty``, ``stop_token_ids`` and ``request_id``.

``logprobs`` / ``top_logprobs`` answer in OpenAI's shape of each API, ``n`` > 1 runs n
generations (choices indexed, usage summed), a completions ``prompt`` may be a batch (prompt
``k``'s generation ``j`` is choice ``k * n + j``, as in vLLM), ``echo`` prepends the prompt's text;
what is not implemented is refused with 400 naming it (docs/router.md, "OpenAI parameters").

Request ids: a request's id is its body's ``request_id``, else the ``x-request-id`` header,
else a fresh one; the response echoes it in ``x-request-id`` (and in the logs of every
service the request passes through).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve import auth, errors, tenants, tracing
from pdserve.requests import TokenLogprob
from pdserve.services.router import openai_info
from pdserve.services.router.api import chat_http, messages, responses
from pdserve.services.router.api.chat_run import FINISH, ChatRun
from pdserve.services.router.frontend import Frontend, openai_n
from pdserve.services.router.gateway import Gateway
from pdserve.services.router.openai_errors import (
    error_body,
    error_response,
    http_errors,
    read_json,
)
from pdserve.services.router.stream import StreamChunk
from pdserve.telemetry import REQUEST_ID_HEADER, request_id_var
from pdserve.tenants import Tenants
from pdserve.v1 import common_pb2

log = logging.getLogger(__name__)


def _require_key(
    keys: Tenants, metrics_open: bool, failures: auth.KeyFailures | None, gateway: Gateway
):
    """401 in the OpenAI error shape for a request without ``key`` (``Authorization: Bearer``,
    or Anthropic's ``x-api-key``), 429 (with Retry-After) for a wrong key past a budget of
    ``failures`` (/health is open, and /metrics with ``metrics_open``). A request whose ``gateway``
    header names a tenant is that tenant's without a key from a trusted gateway, else 403."""
    open_paths = {"/health"} | ({"/metrics"} if metrics_open else set())

    @web.middleware
    async def require(request: web.Request, handler) -> web.StreamResponse:
        if request.path in open_paths:
            return await handler(request)
        tls = request.transport.get_extra_info("ssl_object") if request.transport else None
        try:
            tenant = gateway.http_tenant(request.headers, request.remote or "", tls)
        except errors.PermissionDenied as exc:
            body = {"message": str(exc), "type": "permission_error", "param": None}
            return web.json_response({"error": {**body, "code": "permission_denied"}}, status=403)
        if tenant is not None:
            tenants.current.set(tenant)
            return await handler(request)
        header = request.headers.get("Authorization")
        if header is None and "x-api-key" in request.headers:  # Anthropic's clients
            header = f"Bearer {request.headers['x-api-key']}"
        why, wait = auth.refusal(header, keys, request.remote or "", failures)
        if wait:
            retry = {"Retry-After": str(math.ceil(wait))}
            return error_response(errors.ResourceExhausted(why), retry)
        if not why:
            return await handler(request)
        body = {"message": why, "type": "invalid_request_error", "param": None}
        return web.json_response(
            {"error": {**body, "code": "invalid_api_key"}},
            status=401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    return require


def make_app(
    fe: Frontend,
    *,
    keys: Tenants | None = None,
    metrics_open: bool = False,
    key_failures: auth.KeyFailures | None = None,
    gateway: Gateway | None = None,
) -> web.Application:
    """The OpenAI HTTP API over ``fe``; with ``keys`` (not open), every route but /health (and
    /metrics with ``metrics_open``) takes one of them, which names the tenant, or a
    tenant named by a trusted ``gateway`` (none: the gateway header is refused from all)."""
    middlewares = [*tracing.http_middlewares(), http_errors]  # a caller's traceparent
    if keys is not None and not keys.open:
        gate = gateway or Gateway(keys)
        middlewares.insert(0, _require_key(keys, metrics_open, key_failures, gate))
    app = web.Application(middlewares=middlewares)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _generate(fe, request, chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await _generate(fe, request, chat=True)

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    openai_info.add_routes(app, fe)
    responses.add_routes(app, fe)
    messages.add_routes(app, fe)
    return app


async def _generate(fe: Frontend, request: web.Request, *, chat: bool) -> web.StreamResponse:
    try:
        body = await read_json(request)
    except errors.InvalidArgument as exc:
        return error_response(exc)
    header_id = request.headers.get(REQUEST_ID_HEADER, "")
    if header_id and isinstance(body, dict) and not body.get("request_id"):
        body = {**body, "request_id": header_id}
    try:
        fe = fe.for_model(body.get("model") if isinstance(body, dict) else None)
        # Tokenizing a long prompt takes a while: off the event loop, so /health and other
        # requests keep being answered meanwhile.
        reqs, parse = await asyncio.to_thread(fe.from_openai_parsed, body, chat=chat)
    except Exception as exc:
        return error_response(exc)
    rid = reqs[0].request_id
    request_id_var.set(rid)
    headers = {REQUEST_ID_HEADER: rid}
    stream = bool(body.get("stream", False))
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        bad = errors.InvalidArgument(
            f"stream_options must be an object, got {stream_options!r:.100}", param="stream_options"
        )
        return error_response(bad, headers)
    usage_in_stream = bool(stream_options.get("include_usage", False))
    meta = {
        "id": ("chatcmpl-" if chat else "cmpl-") + (rid or uuid.uuid4().hex),
        "created": int(time.time()),
        "model": fe.limits.model,
    }
    if parse is not None:  # tools or a reasoning parser: the answer is parsed
        try:
            run = await ChatRun.open(fe, reqs[0], parse)
        except Exception as exc:
            return error_response(exc, headers)
        return await chat_http.answer(
            request, run, meta, headers, stream=stream, usage=usage_in_stream
        )
    n = openai_n(body)
    echo = bool(body.get("echo")) and not chat
    out = _Output(
        fe,
        chat=chat,
        n=n,
        logprobs=reqs[0].sampling.logprobs is not None,
        echoes=[fe.tokenizer.decode(r.prompt_token_ids) for r in reqs] if echo else [],
    )
    chunks = fe.generate_n(reqs, n)
    async with contextlib.aclosing(chunks):
        try:
            first = await anext(chunks)  # admission and worker errors surface before any byte
        except StopAsyncIteration:
            first = (0, StreamChunk([], "", [], common_pb2.FINISH_REASON_STOP))
        except Exception as exc:
            return error_response(exc, headers)
        if stream:
            return await _sse(request, chunks, first, meta, headers, out, usage=usage_in_stream)
        return await _whole(chunks, first, meta, headers, out, choices=len(reqs) * n)


@dataclass
class _Output:
    """How one request's answer is shaped: chat or completions, with logprobs (OpenAI's shape
    of each), with each prompt's text echoed (completions ``echo``); choice ``i`` answers
    prompt ``i // n``."""

    fe: Frontend
    chat: bool
    n: int
    logprobs: bool
    echoes: list[str]

    def echo(self, choice: int) -> str:
        return self.echoes[choice // self.n] if self.echoes else ""

    def prompt(self, choice: int) -> int:
        """The index of the prompt ``choice`` answers."""
        return choice // self.n

    def logprobs_json(self, items: list[TokenLogprob], offset: int = 0) -> Any:
        """OpenAI's ``logprobs`` of ``items``: completions ``{tokens, token_logprobs,
        top_logprobs, text_offset}`` (offsets from ``offset`` characters), chat
        ``{content: [{token, logprob, bytes, top_logprobs}]}``; None without logprobs."""
        if not self.logprobs:
            return None
        tok = self.fe.tokenizer
        strings = tok.token_strings([x.token_id for x in items])
        tops = [tok.token_strings([t for t, _ in x.top]) for x in items]
        if self.chat:
            return {
                "content": [
                    {
                        "token": s,
                        "logprob": x.logprob,
                        "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [
                            {"token": ts, "logprob": v, "bytes": list(ts.encode("utf-8"))}
                            for ts, (_, v) in zip(top, x.top, strict=True)
                        ],
                    }
                    for s, x, top in zip(strings, items, tops, strict=True)
                ]
            }
        offsets = []
        for s in strings:
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": strings,
            "token_logprobs": [x.logprob for x in items],
            "top_logprobs": [
                {ts: v for ts, (_, v) in zip(top, x.top, strict=True)}
                for x, top in zip(items, tops, strict=True)
            ],
            "text_offset": offsets,
        }


class _PromptUsage:
    """Prompt and cached tokens of a request's prompts, each counted once however many of its
    ``n`` generations report them; :meth:`usage` is OpenAI's ``usage`` object."""

    def __init__(self, out: _Output) -> None:
        self.out = out
        self.seen: dict[int, tuple[int, int]] = {}

    def add(self, choice: int, c: StreamChunk) -> None:
        k = self.out.prompt(choice)
        if c.prompt_tokens:  # the last report of a prompt wins (the worker's own count)
            self.seen[k] = (c.prompt_tokens, c.cached_tokens)

    def usage(self, completion: int) -> dict[str, Any]:
        prompt = sum(p for p, _ in self.seen.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c for _, c in self.seen.values())},
        }


async def _whole(
    gen,
    first: tuple[int, StreamChunk],
    meta: dict[str, Any],
    headers: dict[str, str],
    out: _Output,
    *,
    choices: int,
) -> web.Response:
    n = choices
    texts: list[list[str]] = [[] for _ in range(n)]
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    count = 0
    prompts = _PromptUsage(out)
    i, c = first
    try:
        while True:
            prompts.add(i, c)
            texts[i].append(c.text)
            lps[i].extend(c.logprobs)
            count += len(c.token_ids)
            if c.finish:
                finish[i] = FINISH.get(c.finish, "stop")
            try:
                i, c = await anext(gen)
            except StopAsyncIteration:
                break
    except Exception as exc:
        return error_response(exc, headers)
    answers = []
    for i in range(n):
        text = "".join(texts[i])
        logprobs = out.logprobs_json(lps[i])
        if out.chat:
            message = {"role": "assistant", "content": text}
            answers.append(
                {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish[i]}
            )
        else:
            answers.append(
                {
                    "index": i,
                    "text": out.echo(i) + text,
                    "logprobs": logprobs,
                    "finish_reason": finish[i],
                }
            )
    obj = "chat.completion" if out.chat else "text_completion"
    return web.json_response(
        {**meta, "object": obj, "choices": answers, "usage": prompts.usage(count)},
        headers=headers,
    )


async def _sse(
    request: web.Request,
    gen,
    first: tuple[int, StreamChunk],
    meta: dict[str, Any],
    headers: dict[str, str],
    out: _Output,
    *,
    usage: bool,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await resp.prepare(request)
    chat = out.chat
    obj = "chat.completion.chunk" if chat else "text_completion"
    #: Characters sent per choice (completions logprobs' text_offset).
    sent: dict[int, int] = {}

    async def send(payload: dict[str, Any]) -> None:
        await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def choice(
        i: int,
        text: str | None,
        finish: str | None,
        role: bool = False,
        lps: list[TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        logprobs = out.logprobs_json(lps, sent.get(i, 0)) if lps else None
        if chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    count = 0
    prompts = _PromptUsage(out)
    started: set[int] = set()
    try:
        item: tuple[int, StreamChunk] | None = first
        while item is not None:
            i, c = item
            prompts.add(i, c)
            if i not in started:
                started.add(i)
                if chat:
                    await send({**meta, "object": obj, "choices": [choice(i, "", None, True)]})
                elif out.echo(i):
                    await send({**meta, "object": obj, "choices": [choice(i, out.echo(i), None)]})
            count += len(c.token_ids)
            finish = FINISH.get(c.finish) if c.finish else None
            if c.text or finish or c.logprobs:
                payload = choice(i, c.text, finish, lps=c.logprobs)
                await send({**meta, "object": obj, "choices": [payload]})
            sent[i] = (
                sent.get(i, 0) + sum(len(s) for s in out.fe.tokenizer.token_strings(c.token_ids))
                if out.logprobs and not chat
                else 0
            )
            try:
                item = await anext(gen)
            except StopAsyncIteration:
                item = None
        if usage:
            await send({**meta, "object": obj, "choices": [], "usage": prompts.usage(count)})
    except (ConnectionResetError, ConnectionError):
        return resp  # the client went away: closing ``gen`` cancels the worker calls
    except Exception as exc:
        await send(error_body(exc)[1])
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
