"""The OpenAI error shape of the router's HTTP API: ``{"error": {"message", "type", "param",
"code"}}`` with 400 (bad input), 404 (unknown model or path), 429 (admission refused), 503 (no
worker), 504 (deadline), 500 (a bug, logged); and :func:`read_json`, every endpoint's JSON
body, refused in that shape when it is not one."""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from pdserve import errors

log = logging.getLogger(__name__)

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


def with_retry_after(exc: BaseException, headers: dict[str, str] | None) -> dict[str, str] | None:
    """``headers`` plus ``Retry-After`` (seconds) when ``exc`` is a rate limit's refusal."""
    if isinstance(exc, errors.RateLimited):
        return {**(headers or {}), "Retry-After": exc.retry_after}
    return headers


def error_response(exc: BaseException, headers: dict[str, str] | None = None) -> web.Response:
    """``exc`` in the OpenAI error shape; a rate limit's 429 carries ``Retry-After``."""
    status, body = error_body(exc)
    headers = with_retry_after(exc, headers)
    if status == 500:
        log.error("internal error: %r", exc, exc_info=exc)
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def http_errors(request: web.Request, handler) -> web.StreamResponse:
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


async def read_json(request: web.Request) -> Any:
    """The request's JSON body; InvalidArgument when it is not JSON, holds a lone surrogate
    (``\\ud800``: JSON may spell one, no UTF-8 text can hold it, and the tokenizer would fail
    on it deep inside) or is nested too deeply for the parser."""
    try:
        body = json.loads(await request.read())
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # a ValueError too: first
        raise errors.InvalidArgument(
            "request body holds invalid Unicode (a lone surrogate)"
        ) from None
    except ValueError as exc:
        raise errors.InvalidArgument(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # [[[[... thousands deep: json gives up (a RuntimeError)
        raise errors.InvalidArgument("request body is nested too deeply") from None
    return body
