"""The HTTP endpoints that describe the server, shaped as vLLM's OpenAI server answers them:
``GET /v1/models`` (with ``root``, the model's folder, which ``vllm bench serve`` without
``--model`` reads as its tokenizer) and ``GET /v1/models/{id}`` (the OpenAI SDK's
``models.retrieve``), ``POST /tokenize`` and ``/detokenize``, ``GET /version``, ``/health``
and ``/metrics``."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve import __version__
from pdserve.errors import InvalidArgument, ModelNotFound
from pdserve.services.router import request as rq
from pdserve.services.router.frontend import Frontend
from pdserve.services.router.openai_errors import error_response, read_json
from pdserve.services.router.openai_fields import flag
from pdserve.services.router.workers import DECODE
from pdserve.telemetry import REGISTRY


def add_routes(app: web.Application, fe: Frontend) -> None:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [_model(m) for m in fe.every_model()]})

    async def model(request: web.Request) -> web.Response:
        name = request.match_info["model_id"]
        found = [m for m in fe.every_model() if m.limits.model == name]
        if not found:
            return error_response(ModelNotFound(f"the model {name!r:.80} does not exist"))
        return web.json_response(_model(found[0]))

    def answer(compute):  # a POST body -> JSON (tokenizing off the event loop)
        async def handle(request: web.Request) -> web.Response:
            try:
                body = await _body(request)
                own = fe.for_model(body.get("model"))  # optional, as in vLLM
                rq.check_model(body.get("model") or "", own.limits)
                return web.json_response(await asyncio.to_thread(compute, own, body))
            except Exception as exc:
                return error_response(exc)

        return handle

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def health(request: web.Request) -> web.Response:
        counts = {m.limits.model: len(m.pool.candidates(DECODE)) for m in fe.every_model()}
        idle = [name for name, n in counts.items() if not n]
        status = "ok" if not idle else "no decode worker"
        if idle and len(counts) > 1:
            status += f" for {', '.join(idle)}"
        body = {"status": status, "decode_workers": sum(counts.values())}
        return web.json_response(body, status=503 if idle else 200)

    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id:.+}", model)
    app.router.add_post("/tokenize", answer(_tokenize))
    app.router.add_post("/detokenize", answer(_detokenize))
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", _metrics)


def _model(fe: Frontend) -> dict[str, Any]:
    """One /v1/models entry, with vLLM's ``root``, ``parent`` and ``max_model_len``."""
    info = fe.model_info()
    out: dict[str, Any] = {
        "id": info.name,
        "object": "model",
        "created": 0,
        "owned_by": "pdserve",
        "root": str(fe.tokenizer.model_dir),
        "parent": None,
        "max_model_len": info.max_model_len,
    }
    if info.refused_workers:
        out["refused_workers"] = list(info.refused_workers)
    return out


async def _body(request: web.Request) -> dict[str, Any]:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise InvalidArgument("model must be a string", param="model")
    return body


def _tokenize(fe: Frontend, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's /tokenize: ``prompt`` (with ``add_special_tokens``, default true) or ``messages``
    (with the chat options of /v1/chat/completions) -> ``{count, max_model_len, tokens}``."""
    limits = fe.current_limits()
    if "messages" in body:
        ids = fe.chat_ids(body["messages"], limits, body)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidArgument("prompt (a string) or messages is required", param="prompt")
        rq.check_text_size(len(prompt), limits, "prompt")
        ids = fe.tokenizer.encode(prompt, add_special_tokens=flag(body, "add_special_tokens", True))
    return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids}


def _detokenize(fe: Frontend, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's /detokenize: ``tokens`` -> ``{prompt}``."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise InvalidArgument("tokens must be a list of token ids", param="tokens")
    ids = rq.check_token_ids(tokens, fe.current_limits(), "tokens") if tokens else []
    return {"prompt": fe.tokenizer.decode(ids)}


async def _metrics(request: web.Request) -> web.Response:
    resp = web.Response(body=generate_latest(REGISTRY))
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp
