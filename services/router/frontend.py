"""Turns the public request forms (gRPC GenerateRequest, OpenAI JSON) into a validated
:class:`GenRequest`, and holds what both front ends share (tokenizer, limits, orchestrator)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from pdserve.errors import InvalidArgument
from pdserve.services.router import request as rq
from pdserve.services.router.orchestrator import Orchestrator
from pdserve.services.router.workers import DECODE, PREFILL, WorkerPool
from pdserve.v1 import router_pb2

_MODES = {
    router_pb2.DISAGG_MODE_UNSPECIFIED: "",
    router_pb2.DISAGG_MODE_READ: "read",
    router_pb2.DISAGG_MODE_WRITE: "write",
    router_pb2.DISAGG_MODE_COLOCATED: "colocated",
}


class TokenizerLike(Protocol):
    vocab_size: int

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: Sequence[int]) -> str: ...
    def token_strings(self, token_ids: Sequence[int]) -> list[str]: ...
    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]: ...


@dataclass
class Frontend:
    tokenizer: TokenizerLike
    limits: rq.Limits
    orchestrator: Orchestrator
    pool: WorkerPool

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

    # --- gRPC -------------------------------------------------------------------------------

    def from_proto(self, req: router_pb2.GenerateRequest) -> rq.GenRequest:
        limits = self.current_limits()
        rq.check_model(req.model, limits)
        rid = rq.check_request_id(req.request_id)
        salt = rq.check_cache_salt(req.cache_salt if req.HasField("cache_salt") else None)
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
            ids = self._chat_ids(
                [{"role": m.role, "content": m.content} for m in req.messages], limits
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
        )
        mode = _MODES.get(req.mode)
        if mode is None:
            raise InvalidArgument(f"mode: unknown value {req.mode}", param="mode")
        return rq.GenRequest(rid, ids, sampling, mode, salt)

    # --- OpenAI -----------------------------------------------------------------------------

    def from_openai(self, body: Any, *, chat: bool) -> rq.GenRequest:
        """Validates an OpenAI completions / chat completions body (unknown fields ignored)."""
        if not isinstance(body, dict):
            raise InvalidArgument("request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidArgument("model is required (a string)", param="model")
        limits = self.current_limits()
        rq.check_model(model, limits)
        n = body.get("n", 1)
        if n not in (1, None):
            raise InvalidArgument("n: only n=1 is supported", param="n")
        _refuse_unsupported(body)
        salt = rq.check_cache_salt(body.get("cache_salt"))
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
                raise InvalidArgument(
                    "messages must be a list of {role, content} objects", param="messages"
                )
            ids = self._chat_ids(msgs, limits)
        else:
            ids = self._openai_prompt(body.get("prompt"), limits)
        max_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = body.get(max_field)
        if max_tokens is None and not chat:
            max_tokens = 16  # the OpenAI completions default
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list):
            raise InvalidArgument("stop must be a string or a list of strings", param="stop")
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
        )
        rid = body.get("request_id", "")
        if not isinstance(rid, str):
            raise InvalidArgument("request_id must be a string", param="request_id")
        return rq.GenRequest(rq.check_request_id(rid), ids, sampling, "", salt)

    def _chat_ids(self, messages: list[dict[str, Any]], limits: rq.Limits) -> list[int]:
        """The prompt of validated chat ``messages``, refused before templating when their
        text cannot fit the context."""
        msgs = rq.check_messages(messages)
        rq.check_text_size(sum(len(m["content"]) for m in msgs), limits, "messages")
        return self.tokenizer.apply_chat_template(msgs)

    def _openai_prompt(self, prompt: Any, limits: rq.Limits) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgument("prompt must not be empty", param="prompt")
            rq.check_text_size(len(prompt), limits, "prompt")
            return rq.check_token_ids(self.tokenizer.encode(prompt), limits, "prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return rq.check_token_ids(prompt, limits, "prompt")
        if isinstance(prompt, list) and len(prompt) > 1:
            raise InvalidArgument(
                "prompt: batches of several prompts are not supported", param="prompt"
            )
        raise InvalidArgument(
            "prompt must be a non-empty string or a list of token ids", param="prompt"
        )


#: OpenAI parameters pdserve does not implement yet, with the values that mean "off". A request
#: that sets one to anything else gets 400 naming it, never an answer that ignores it.
UNSUPPORTED_OPENAI: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}


def _refuse_unsupported(body: dict) -> None:
    for name, off in UNSUPPORTED_OPENAI.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) for v in off):
            raise InvalidArgument(
                f"{name}: not supported by this server (got {body[name]!r}); leave it unset",
                param=name,
            )
