"""``/v1/pdserve/pins``: a tenant pins a prefix (a system prompt) in the KV store so eviction
never takes it (docs/router.md, "Pinned prefixes"; the store's side: docs/architecture.md, "Tenant
shares and pins").

- ``POST /v1/pdserve/pins`` with ``{"name", "prompt" | "messages" | "prompt_token_ids",
  "model"?, "cache_salt"?}``: the router tokenizes the prefix as a request would (``prompt``
  with ``add_special_tokens``, default true; ``messages`` through the chat template with
  ``add_generation_prompt`` false unless given, so the system message's tokens are the prefix
  of every chat prompt that starts with it), computes the keys of its full chunks under the
  caller's tenant's chain root (its salt, :meth:`pdserve.tenants.Tenants.salt`, and the
  request's ``cache_salt``) and asks the master to pin them for the tenant. Chunks not stored
  yet are pinned when a request stores them; the answer says how many are stored now.
- ``DELETE /v1/pdserve/pins/{name}`` unpins, ``GET /v1/pdserve/pins`` lists the tenant's pins
  and its use of the pool.

The tenant is the one the request's API key (or a trusted gateway) names; a pin past its
memory share is 429 (RESOURCE_EXHAUSTED) naming the share and the size. A router without a
``store_master`` (or on a Mooncake store) answers 503.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from aiohttp import web

from pdserve import errors, tenants
from pdserve.hashing import chunk_keys
from pdserve.services.router import request as rq
from pdserve.services.router.frontend import Frontend
from pdserve.services.router.openai_errors import error_response, read_json
from pdserve.services.router.openai_fields import flag
from pdserve.v1 import kvstore_pb2

API = "/v1/pdserve/pins"
#: Fields a pin request may hold.
FIELDS = frozenset(
    {
        "name",
        "model",
        "prompt",
        "messages",
        "prompt_token_ids",
        "cache_salt",
        "add_special_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
    }
)


def pin_tokens(fe: Frontend, body: dict[str, Any]) -> list[int]:
    """The token ids of the prefix ``body`` names (exactly one of ``prompt``, ``messages``,
    ``prompt_token_ids``); InvalidArgument naming the field otherwise."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise errors.InvalidArgument(
            f"unknown field {unknown[0]!r}; a pin takes {', '.join(sorted(FIELDS))}",
            param=unknown[0],
        )
    given = [f for f in ("prompt", "messages", "prompt_token_ids") if body.get(f) is not None]
    if len(given) != 1:
        raise errors.InvalidArgument(
            "give exactly one of prompt, messages and prompt_token_ids"
            + (f" (got {', '.join(given)})" if given else ""),
            param="prompt",
        )
    limits = fe.current_limits()
    if given[0] == "messages":
        return fe.chat_ids(body["messages"], limits, {"add_generation_prompt": False, **body})
    if given[0] == "prompt":
        prompt = body["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise errors.InvalidArgument("prompt must be a non-empty string", param="prompt")
        rq.check_text_size(len(prompt), limits, "prompt")
        special = flag(body, "add_special_tokens", True)
        return rq.check_token_ids(
            fe.tokenizer.encode(prompt, add_special_tokens=special), limits, "prompt"
        )
    ids = body["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        raise errors.InvalidArgument(
            "prompt_token_ids must be a non-empty list of token ids", param="prompt_token_ids"
        )
    return rq.check_token_ids(ids, limits, "prompt_token_ids")


def pin_name(value: Any) -> str:
    """The pin's name (the master checks its length and characters)."""
    if not isinstance(value, str) or not value:
        raise errors.InvalidArgument("name (a non-empty string) is required", param="name")
    return value


def pin_keys(fe: Frontend, body: dict[str, Any]) -> tuple[list[str], int]:
    """The chunk keys of the prefix ``body`` names, in the calling tenant's chain, and the
    prefix's length (tokens); InvalidArgument when it holds no full chunk."""
    fp = fe.orchestrator.fp
    if fp is None:
        raise errors.Unavailable("no worker has registered its KV fingerprint yet; retry")
    tokens = pin_tokens(fe, body)
    keys = chunk_keys(fp, tokens, rq.tenant_salt(body.get("cache_salt")))
    if not keys:
        raise errors.InvalidArgument(
            f"the prefix has {len(tokens)} tokens, less than one chunk ({fp.chunk_size} "
            "tokens): only full chunks are stored, so there is nothing to pin",
            param="prompt",
        )
    return keys, len(tokens)


class MasterPins:
    """The master's pin calls through pdserve's store client, opened on first use (blocking:
    call from a thread)."""

    def __init__(self, master: str) -> None:
        self.master = master
        self._client: Any = None
        self._lock = threading.Lock()

    def link(self) -> Any:
        if not self.master:
            raise errors.Unavailable(
                "this router has no store_master: pins live in pdserve's KV store"
            )
        with self._lock:
            if self._client is None:
                from pdserve.store import open_store

                self._client = open_store(self.master, control="grpc")
            return self._client.master

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def _pin_json(p: kvstore_pb2.PinInfo) -> dict[str, Any]:
    return {
        "name": p.name,
        "chunks": p.keys,
        "stored_chunks": p.present,
        "stored_bytes": p.bytes,
        "created_ms": p.created_ms,
    }


def add_routes(app: web.Application, fe: Frontend, master: str) -> None:
    """The pin endpoints on ``app``, pinning in the store of master ``master``."""
    from pdserve.store.client import pins

    link = MasterPins(master)

    async def create(request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise errors.InvalidArgument("request body must be a JSON object")
            own = fe.for_model(body.get("model"))
            rq.check_model(body.get("model") or "", own.limits)
            name = pin_name(body.get("name"))
            keys, n_tokens = await asyncio.to_thread(pin_keys, own, body)
            tenant = tenants.current.get()
            resp = await asyncio.to_thread(lambda: pins.pin_keys(link.link(), tenant, name, keys))
        except Exception as exc:
            return error_response(exc)
        out = _pin_json(resp.pin)
        out.update(
            tokens=n_tokens,
            pinned_tokens=len(keys) * own.orchestrator.fp.chunk_size,
            tenant_pinned_bytes=resp.tenant_pinned_bytes,
            memory_share_bytes=resp.memory_share_bytes,
        )
        return web.json_response(out)

    async def delete(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        tenant = tenants.current.get()
        try:
            removed = await asyncio.to_thread(lambda: pins.unpin_keys(link.link(), tenant, name))
        except Exception as exc:
            return error_response(exc)
        if not removed:
            return error_response(errors.NotFound(f"no pin named {name[:80]!r}"))
        return web.json_response({"name": name, "deleted": True})

    async def listing(request: web.Request) -> web.Response:
        tenant = tenants.current.get()
        try:
            resp = await asyncio.to_thread(lambda: pins.list_pins(link.link(), tenant))
        except Exception as exc:
            return error_response(exc)
        usage = [u for u in resp.tenants if u.tenant == tenant]
        mine = [_pin_json(p) for p in resp.pins if p.tenant == tenant]
        out: dict[str, Any] = {"object": "list", "data": mine}
        if usage:
            u = usage[0]
            out["usage"] = {
                "memory_bytes": u.memory_bytes,
                "disk_bytes": u.disk_bytes,
                "memory_share_bytes": u.memory_share_bytes,
                "disk_share_bytes": u.disk_share_bytes,
                "pinned_bytes": u.pinned_bytes,
            }
        return web.json_response(out)

    async def cleanup(_app: web.Application) -> None:
        link.close()

    app.router.add_post(API, create)
    app.router.add_get(API, listing)
    app.router.add_delete(API + "/{name}", delete)
    app.on_cleanup.append(cleanup)
