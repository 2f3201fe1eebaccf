"""Turns the public request forms (gRPC GenerateRequest, OpenAI JSON) into a validated
:class:`GenRequest`, and holds what both front ends share (tokenizer, limits, orchestrator,
the fan-out of ``n`` generations: :meth:`Frontend.generate_n`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pdserve import __version__, tenants
from pdserve.enums import DISAGG_MODE
from pdserve.errors import InvalidArgument
from pdserve.requests import MAX_LOGPROBS
from pdserve.services.router import request as rq
from pdserve.services.router.api.parsers import ChatParse, Parsers
from pdserve.services.router.api.responses_store import ResponseStore
from pdserve.services.router.engine_events import EngineCaches
from pdserve.services.router.openai_fields import chat_options, check_fields, flag, truncate
from pdserve.services.router.orchestrator import Orchestrator
from pdserve.services.router.stream import StreamChunk
from pdserve.services.router.workers import DECODE, PREFILL, WorkerPool
from pdserve.v1 import router_pb2

if TYPE_CHECKING:
    from pdserve.services.router.models import Models


class TokenizerLike(Protocol):
    vocab_size: int
    model_dir: Path  # the model's folder (/v1/models' root)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: Sequence[int]) -> str: ...
    def token_strings(self, token_ids: Sequence[int]) -> list[str]: ...
    def apply_chat_template(
        self,
        messages: Sequence[dict[str, str]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]: ...


@dataclass
class Frontend:
    tokenizer: TokenizerLike
    limits: rq.Limits
    orchestrator: Orchestrator
    pool: WorkerPool
    #: ``time.monotonic()`` at start, for GetServerInfo's uptime.
    started: float = field(default_factory=time.monotonic)
    #: The stock engines' own prefix caches, from their KV events (engine_kv_events).
    engines: EngineCaches | None = None
    #: vLLM's tool-call and reasoning parsers (None: tools are refused).
    parsers: Parsers | None = None
    #: /v1/responses answers kept for previous_response_id.
    responses: ResponseStore = field(default_factory=ResponseStore)
    #: Every model the router serves (services/router/models.py); None: this one alone.
    models: Models | None = None

    def for_model(self, model: object) -> Frontend:
        """The frontend of the model a request names (:meth:`Models.select`)."""
        return self if self.models is None else self.models.select(model)

    def every_model(self) -> list[Frontend]:
        return [self] if self.models is None else self.models.all()

    def current_limits(self) -> rq.Limits:
        """The configured limits, each lowered to the smallest value any registered worker
        (not refused) advertised: ``max_model_len`` (context) and ``max_tokens_limit``. A
        request over one is refused here, naming the limit, not deep inside a worker."""
        limits = self.limits
        for name in ("max_model_len", "max_tokens_limit"):
            advertised = [int(v) for v in self.pool.label_values(name) if v.isdigit() and int(v)]
            ours = getattr(limits, name)
            if advertised and (not ours or min(advertised) < ours):
                limits = replace(limits, **{name: min(advertised)})
        return limits

    def model_info(self) -> router_pb2.ModelInfo:
        return router_pb2.ModelInfo(
            name=self.limits.model,
            max_model_len=self.current_limits().max_model_len,
            prefill_workers=len(self.pool.candidates(PREFILL)),
            decode_workers=len(self.pool.candidates(DECODE)),
            refused_workers=[f"{w.id}: {w.refused}" for w in self.pool.refused()],
        )

    def server_info(self) -> router_pb2.GetServerInfoResponse:
        """RouterService.GetServerInfo: limits, KV settings, workers and state."""
        limits = self.current_limits()
        fp = self.orchestrator.fp
        return router_pb2.GetServerInfoResponse(
            model=limits.model,
            max_model_len=limits.max_model_len,
            max_tokens_limit=limits.max_tokens_limit,
            vocab_size=limits.vocab_size,
            engines=sorted(v for v in self.pool.label_values("engine") if v),
            version=__version__,
            chunk_size=fp.chunk_size if fp is not None else 0,
            kv_dtype=fp.kv_dtype if fp is not None else "",
            prefill_workers=len(self.pool.candidates(PREFILL)),
            decode_workers=len(self.pool.candidates(DECODE)),
            active_requests=len(self.orchestrator.running),
            uptime_seconds=time.monotonic() - self.started,
            server_type="pdserve-router",
            max_logprobs=MAX_LOGPROBS,
        )

    # --- gRPC -------------------------------------------------------------------------------

    def generate_n(
        self, reqs: list[rq.GenRequest], n: int, *, timeout_s: float | None = None
    ) -> AsyncIterator[tuple[int, StreamChunk]]:
        """``(choice index, chunk)`` of the ``n`` generations of each of ``reqs`` (a batch of
        prompts, :func:`fan_out` each), in arrival order; prompt ``k``'s generation ``j`` is
        choice ``k * n + j``, as vLLM indexes them: what the OpenAI API's ``n`` and batched
        prompts and ``GenerateRequest.n`` run."""
        gens = [g for req in reqs for g in fan_out(req, n)]
        return merged([self.orchestrator.generate(g, timeout_s=timeout_s) for g in gens])

    def from_proto(self, req: router_pb2.GenerateRequest) -> rq.GenRequest:
        limits = self.current_limits()
        rq.check_model(req.model, limits)
        proto_n(req)
        rid = rq.check_request_id(req.request_id)
        salt = rq.tenant_salt(req.cache_salt if req.HasField("cache_salt") else None)
        given = [
            name
            for name, present in (
                ("prompt", bool(req.prompt)),
                ("prompt_token_ids", len(req.prompt_token_ids) > 0),
                ("messages", len(req.messages) > 0),
            )
            if present
        ]
        if len(given) != 1:
            raise InvalidArgument(
                "exactly one of prompt, prompt_token_ids and messages must be set"
                + (f"; got {', '.join(given)}" if given else "; got none (or an empty prompt)"),
                param="prompt",
            )
        if req.prompt:
            rq.check_text_size(len(req.prompt), limits, "prompt")
            ids = rq.check_token_ids(self.tokenizer.encode(req.prompt), limits, "prompt")
        elif req.prompt_token_ids:
            ids = rq.check_token_ids(list(req.prompt_token_ids), limits, "prompt_token_ids")
        else:
            ids = self.chat_ids(
                [{"role": m.role, "content": m.content} for m in req.messages], limits, {}
            )
        s = req.sampling
        sampling = rq.make_sampling(
            limits,
            len(ids),
            max_tokens=s.max_tokens or None,
            temperature=s.temperature if s.HasField("temperature") else None,
            top_p=s.top_p if s.HasField("top_p") else None,
            top_k=s.top_k,
            seed=s.seed if s.HasField("seed") else None,
            stop=list(s.stop),
            ignore_eos=s.ignore_eos,
            prompt_field=given[0],
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=(s.repetition_penalty if s.HasField("repetition_penalty") else None),
            logit_bias=dict(s.logit_bias),
            stop_token_ids=list(s.stop_token_ids),
            logprobs=s.logprobs if s.HasField("logprobs") else None,
            json_object=s.json_object,
            json_schema=s.json_schema,
            min_tokens=s.min_tokens,
            skip_special_tokens=(
                s.skip_special_tokens if s.HasField("skip_special_tokens") else True
            ),
        )
        mode = DISAGG_MODE.names.get(req.mode) if req.mode else ""  # "": the router's default
        if mode is None:
            raise InvalidArgument(f"mode: unknown value {req.mode}", param="mode")
        tenant = tenants.current.get()
        return rq.GenRequest(rid, ids, sampling, mode, salt, tenant=tenant, priority=req.priority)

    # --- OpenAI -----------------------------------------------------------------------------

    def from_openai(self, body: Any, *, chat: bool) -> list[rq.GenRequest]:
        """Validates an OpenAI completions / chat completions body: every field is honoured or
        refused (:mod:`~pdserve.services.router.openai_fields`). One request per prompt:
        completions take a batch of prompts (strings or token-id lists), as vLLM does; the
        first keeps the request's id, prompt ``k`` gets ``<id>-p<k>``, all abort under it."""
        return self.from_openai_parsed(body, chat=chat)[0]

    def from_openai_parsed(
        self, body: Any, *, chat: bool
    ) -> tuple[list[rq.GenRequest], ChatParse | None]:
        """:meth:`from_openai` and the chat body's parse (tools, reasoning:
        :meth:`Parsers.for_chat`; None when its answer is plain text). A parsed chat request
        takes ``n`` 1 only (the parser keeps one generation's state)."""
        if not isinstance(body, dict):
            raise InvalidArgument("request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidArgument("model is required (a string)", param="model")
        limits = self.current_limits()
        rq.check_model(model, limits)
        n = openai_n(body)
        check_fields(body, chat=chat)
        extra = _openai_sampling(body, chat=chat)
        salt = rq.tenant_salt(body.get("cache_salt"))
        parse = self._chat_parse(body) if chat else None
        if parse is not None:
            parse.constrain(extra, n)
        if chat:
            tools = parse.template_tools if parse is not None else None
            prompts = [self.chat_ids(body.get("messages"), limits, body, tools=tools)]
        else:
            special = flag(body, "add_special_tokens", True)
            prompts = self._openai_prompts(body.get("prompt"), limits, special)
            if len(prompts) * n > MAX_BATCH:
                raise InvalidArgument(
                    f"{len(prompts)} prompts x n={n} is {len(prompts) * n} generations; one "
                    f"request may ask at most {MAX_BATCH}",
                    param="prompt",
                )
        max_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = body.get(max_field)
        if max_tokens is None and not chat:
            max_tokens = 16  # the OpenAI completions default
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list):
            raise InvalidArgument("stop must be a string or a list of strings", param="stop")
        rid = body.get("request_id", "")
        if not isinstance(rid, str):
            raise InvalidArgument("request_id must be a string", param="request_id")
        rid = rq.check_request_id(rid)
        priority = rq.check_priority(body.get("priority"))
        out = []
        for k, prompt in enumerate(prompts):
            ids = truncate(prompt, body.get("truncate_prompt_tokens"), limits.max_model_len)
            sampling = rq.make_sampling(
                limits,
                len(ids),
                max_tokens=max_tokens,
                temperature=body.get("temperature"),
                top_p=body.get("top_p"),
                top_k=body.get("top_k") if body.get("top_k", -1) != -1 else None,
                seed=body.get("seed"),
                stop=stop,
                ignore_eos=bool(body.get("ignore_eos", False)),
                max_tokens_field=max_field,
                prompt_field="messages" if chat else "prompt",
                **extra,
            )
            own = rid if k == 0 else f"{rid[:112]}-p{k}"
            tenant = tenants.current.get()
            out.append(
                rq.GenRequest(
                    own, ids, sampling, "", salt, abort_id=rid, tenant=tenant, priority=priority
                )
            )
        return out, parse

    def _chat_parse(self, body: dict[str, Any]) -> ChatParse | None:
        if self.parsers is not None:
            return self.parsers.for_chat(body)
        if body.get("tools") or body.get("tool_choice") not in (None, "none"):
            raise InvalidArgument("tools: this router has no tool parsers", param="tools")
        return None

    def chat_ids(
        self,
        messages: Any,
        limits: rq.Limits,
        body: dict[str, Any],
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The prompt of validated chat ``messages`` (chat completions, /tokenize), refused
        before templating when their text cannot fit the context; templated with vLLM's chat
        options of ``body`` (``add_generation_prompt``, ``continue_final_message``,
        ``chat_template_kwargs``, ``add_special_tokens``) and the request's ``tools`` (the
        template's ``tools`` variable, as vLLM renders them)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidArgument(
                "messages must be a list of {role, content} objects", param="messages"
            )
        msgs = rq.check_messages(messages)
        rq.check_text_size(sum(len(m["content"]) for m in msgs), limits, "messages")
        options = chat_options(body, msgs)
        if tools:
            options["template_kwargs"] = {**options["template_kwargs"], "tools": tools}
        return self.tokenizer.apply_chat_template(msgs, **options)

    def _openai_prompts(self, prompt: Any, limits: rq.Limits, special: bool) -> list[list[int]]:
        """The token ids of each prompt of a completions ``prompt``: a string, a list of token
        ids, or a batch (a list of either)."""
        if isinstance(prompt, list) and any(isinstance(p, str | list) for p in prompt):
            return [
                self._one_prompt(p, limits, special, f"prompt[{k}]") for k, p in enumerate(prompt)
            ]
        return [self._one_prompt(prompt, limits, special, "prompt")]

    def _one_prompt(self, prompt: Any, limits: rq.Limits, special: bool, what: str) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgument(f"{what} must not be empty", param="prompt")
            rq.check_text_size(len(prompt), limits, what)
            ids = self.tokenizer.encode(prompt, add_special_tokens=special)
            return rq.check_token_ids(ids, limits, what)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return rq.check_token_ids(prompt, limits, what)
        raise InvalidArgument(
            f"{what} must be a non-empty string or a list of token ids (prompt may also be a "
            "list of those: a batch)",
            param="prompt",
        )


#: Most generations one OpenAI request may ask (``n``).
MAX_N = 16
#: Most generations (prompts x ``n``) one batched completions request may ask.
MAX_BATCH = 256


def check_n(n: Any) -> int:
    """``n`` (generations of one request) validated: an integer in [1, MAX_N]."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise InvalidArgument(f"n must be an integer in [1, {MAX_N}], got {n!r:.40}", param="n")
    return n


def openai_n(body: dict) -> int:
    """The request's validated ``n`` (1 when unset)."""
    n = body.get("n", 1)
    return 1 if n is None else check_n(n)


def proto_n(req: router_pb2.GenerateRequest) -> int:
    """``GenerateRequest.n`` validated (unset = 0 = 1)."""
    return check_n(req.n or 1)


def fan_out(req: rq.GenRequest, n: int) -> list[rq.GenRequest]:
    """The ``n`` generations of one request: the first keeps the request's id, the others get
    ``<id>-<i>``; all abort under the request's id; a seed ``s`` becomes ``s + i`` (distinct,
    reproducible samples), no seed stays random per generation."""
    if n == 1:
        return [req]
    out = []
    for i in range(n):
        seed = req.sampling.seed
        sampling = replace(req.sampling, seed=None if seed is None else (seed + i) % 2**64)
        rid = req.request_id if i == 0 else f"{req.request_id[:120]}-{i}"
        abort_id = req.abort_id or req.request_id
        out.append(replace(req, request_id=rid, sampling=sampling, abort_id=abort_id))
    return out


async def merged(gens: list) -> AsyncIterator[tuple[int, StreamChunk]]:
    """``(generation index, chunk)`` of every generation, in arrival order; the first error of
    any generation is raised (the others are cancelled)."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as gen:
            async for c in gen:
                yield 0, c
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen) -> None:
        try:
            async with contextlib.aclosing(gen):
                async for c in gen:
                    queue.put_nowait((i, c))
            queue.put_nowait((i, None))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _number(body: dict, name: str) -> Any:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise InvalidArgument(f"{name} must be a number, got {value!r:.100}", param=name)
    return value


def _openai_sampling(body: dict, *, chat: bool) -> dict[str, Any]:
    """The :func:`rq.make_sampling` keywords of the OpenAI parameters beyond the basic ones:
    penalties, logit_bias, stop_token_ids (vLLM's), logprobs and response_format; echo is
    checked here (it changes only the answer's text)."""
    out: dict[str, Any] = {
        name: _number(body, name)
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")
    }
    out["min_tokens"] = body.get("min_tokens")
    out["skip_special_tokens"] = flag(body, "skip_special_tokens", True)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise InvalidArgument(
                "logit_bias must be an object {token id: bias}", param="logit_bias"
            )
        parsed = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise InvalidArgument(
                    f"logit_bias: key {key!r:.50} is not a token id", param="logit_bias"
                ) from None
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidArgument(
                    f"logit_bias[{key}] must be a number, got {value!r:.50}", param="logit_bias"
                )
            parsed[token] = value
        out["logit_bias"] = parsed
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in stop_ids
        ):
            raise InvalidArgument(
                "stop_token_ids must be a list of token ids", param="stop_token_ids"
            )
        out["stop_token_ids"] = stop_ids
    logprobs = body.get("logprobs")
    top = body.get("top_logprobs")
    if chat:
        if logprobs not in (None, True, False):
            raise InvalidArgument(
                f"logprobs must be a boolean (chat), got {logprobs!r:.50}", param="logprobs"
            )
        if top is not None and not logprobs:
            raise InvalidArgument("top_logprobs needs logprobs set to true", param="top_logprobs")
        if logprobs:
            out["logprobs"] = 0 if top is None else top
            out["logprobs_field"] = "top_logprobs"
    else:
        if top is not None:
            raise InvalidArgument(
                "top_logprobs is a chat completions parameter; completions take logprobs: N",
                param="top_logprobs",
            )
        if logprobs is not None and logprobs is not False:
            out["logprobs"] = logprobs
    echo = body.get("echo")
    if echo not in (None, False, True):
        raise InvalidArgument(f"echo must be a boolean, got {echo!r:.50}", param="echo")
    if echo and chat:
        raise InvalidArgument(
            "echo: not supported for chat completions by this server; leave it unset",
            param="echo",
        )
    if echo and out.get("logprobs") is not None:
        raise InvalidArgument(
            "echo with logprobs needs the prompt's logprobs, which this server does not "
            "compute; use one or the other",
            param="echo",
        )
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            out["json_object"] = True
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InvalidArgument(
                    'response_format: json_schema needs {"json_schema": {"name", "schema": {...}}}',
                    param="response_format",
                )
            out["json_schema"] = json.dumps(schema)
        elif kind != "text":
            raise InvalidArgument(
                f"response_format: type must be text, json_object or json_schema, got {kind!r:.50}",
                param="response_format",
            )
    opts = body.get("stream_options")
    if isinstance(opts, dict):
        for key, value in opts.items():
            if key != "include_usage" and value not in (None, False):
                raise InvalidArgument(
                    f"stream_options.{key}: not supported by this server; leave it unset",
                    param="stream_options",
                )
    return out
