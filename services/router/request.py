"""A validated generation request, built from the gRPC or the OpenAI form.

Every check raises :class:`pdserve.errors.InvalidArgument` (or ``ModelNotFound`` for an
unknown model) with a message that names the offending field, and the field as ``param``.
The request id, cache salt and model checks are :mod:`pdserve.validation`'s, shared with the
workers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve import tenants, validation
from pdserve.enums import CHAT_ROLE
from pdserve.errors import InvalidArgument
from pdserve.requests import MAX_LOGPROBS, Sampling
from pdserve.tenants import Tenants

# Re-exported: the front ends call rq.check_request_id and rq.check_cache_salt, the rules
# shared with the workers.
from pdserve.validation import check_cache_salt as check_cache_salt
from pdserve.validation import check_request_id as check_request_id


@dataclass(frozen=True)
class Limits:
    """What the router accepts (from RouterConfig and the model)."""

    model: str
    vocab_size: int
    max_model_len: int
    max_tokens_limit: int
    default_max_tokens: int


@dataclass
class GenRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    #: "" = the router's default mode.
    mode: str = ""
    #: The tenant's cache salt ("" = none): keys the prompt's chunks (:mod:`pdserve.hashing`).
    cache_salt: str = ""
    #: The id RouterService.Abort finds the request by ("" = ``request_id``): the caller's id
    #: for every one of an OpenAI request's ``n`` generations.
    abort_id: str = ""
    #: The tenant whose key sent it ("" = the anonymous tenant; :mod:`pdserve.tenants`).
    tenant: str = ""
    #: vLLM's scheduling priority, lower first: orders the tenant's queue in the router
    #: (:mod:`~pdserve.services.router.fair_queue`) and the engine's waiting prompts.
    priority: int = 0


I32 = 2**31


def check_priority(value: object) -> int:
    """The request's ``priority`` (unset = 0): an integer that fits int32, as vLLM's."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not -I32 <= value < I32:
        raise InvalidArgument(
            f"priority must be an integer in [{-I32}, {I32 - 1}] (lower first), got {value!r:.40}",
            param="priority",
        )
    return value


def tenant_salt(cache_salt: object) -> str:
    """The checked ``cache_salt`` of the request being handled, in its tenant's namespace
    (:meth:`pdserve.tenants.Tenants.salt`)."""
    return Tenants.salt(tenants.current.get(), check_cache_salt(cache_salt))


def check_model(model: str, limits: Limits) -> None:
    """NOT_FOUND unless ``model`` is empty or the served one (:func:`validation.check_model`)."""
    validation.check_model(model, limits.model)


def check_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validated ``{role, content}`` dicts with role names; a role may be the OpenAI string
    or the gRPC ``ChatRole`` enum value. An assistant message may carry ``tool_calls`` (then
    its content may be null) and a tool message its ``tool_call_id``, passed to the chat
    template as vLLM passes them."""
    if not messages:
        raise InvalidArgument("messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if isinstance(role, int) and not isinstance(role, bool):
            if role not in CHAT_ROLE.specified:
                raise InvalidArgument(
                    f"messages[{i}].role must be one of "
                    f"{[CHAT_ROLE.proto_names[r] for r in CHAT_ROLE.specified]}, got "
                    f"{CHAT_ROLE.proto_names.get(role, role)}",
                    param=f"messages[{i}].role",
                )
            role = CHAT_ROLE.names[role]
        if role not in CHAT_ROLE.choices:
            raise InvalidArgument(
                f"messages[{i}].role must be one of {CHAT_ROLE.choices}, got {role!r}",
                param=f"messages[{i}].role",
            )
        if isinstance(content, list):  # OpenAI content parts: only text parts are supported
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise InvalidArgument(
                        f"messages[{i}].content: only text parts are supported",
                        param=f"messages[{i}].content",
                    )
                if not isinstance(part.get("text"), str):
                    raise InvalidArgument(
                        f"messages[{i}].content: a text part needs 'text'",
                        param=f"messages[{i}].content",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        calls = _tool_calls(m.get("tool_calls"), role, i)
        if content is None and calls:
            content = ""  # an assistant turn that only called tools
        if not isinstance(content, str):
            raise InvalidArgument(
                f"messages[{i}].content must be a string or text parts",
                param=f"messages[{i}].content",
            )
        msg: dict[str, Any] = {"role": role, "content": content}
        if calls:
            msg["tool_calls"] = calls
        call_id = m.get("tool_call_id")
        if call_id is not None:
            if role != "tool" or not isinstance(call_id, str):
                raise InvalidArgument(
                    f"messages[{i}].tool_call_id must be a string, on a tool message only",
                    param=f"messages[{i}].tool_call_id",
                )
            msg["tool_call_id"] = call_id
        out.append(msg)
    return out


def _tool_calls(calls: Any, role: str, i: int) -> list[dict[str, Any]]:
    """An assistant message's validated ``tool_calls`` as chat templates take them (vLLM's
    way: each call's JSON ``arguments`` string parsed into an object)."""
    if calls is None:
        return []
    where = f"messages[{i}].tool_calls"
    if role != "assistant" or not isinstance(calls, list):
        raise InvalidArgument(f"{where} must be a list, on an assistant message only", param=where)
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name or not isinstance(args, str):
            raise InvalidArgument(
                f"{where}[{k}] must be {{id, type: function, function: {{name, arguments}}}} "
                "with arguments a JSON string",
                param=where,
            )
        try:
            parsed = json.loads(args) if args.strip() else {}
        except ValueError:
            raise InvalidArgument(
                f"{where}[{k}].function.arguments is not valid JSON: {args!r:.80}", param=where
            ) from None
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise InvalidArgument(f"{where}[{k}].id must be a string", param=where)
        out.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}
        )
    return out


#: Characters one token can stand for at most, for the size check before tokenizing.
MAX_CHARS_PER_TOKEN = 64


def check_text_size(chars: int, limits: Limits, field: str) -> None:
    """Refuses, before tokenizing it, text too long to fit the context whatever its tokens:
    tokenizing megabytes would hold a worker thread for seconds only to be refused."""
    cap = limits.max_model_len * MAX_CHARS_PER_TOKEN
    if chars > cap:
        raise InvalidArgument(
            f"{field} has {chars} characters; no more than {cap} can fit the model's "
            f"{limits.max_model_len}-token context",
            param=field,
        )


def check_token_ids(ids: Sequence[int], limits: Limits, field: str) -> list[int]:
    if not ids:
        raise InvalidArgument(f"{field} must not be empty", param=field)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limits.vocab_size:
            raise InvalidArgument(
                f"{field}: token id {t!r} is outside the vocabulary [0, {limits.vocab_size})",
                param=field,
            )
    return list(ids)


U32 = 2**32 - 1
U64 = 2**64 - 1


def _finite(value: object) -> bool:
    """A real number that is finite as a float (a huge integer is not: it overflows)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _int_in(value: object, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def make_sampling(
    limits: Limits,
    prompt_len: int,
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    stop: Sequence[str],
    ignore_eos: bool,
    max_tokens_field: str = "max_tokens",
    prompt_field: str = "prompt",
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    stop_token_ids: Sequence[int] = (),
    logprobs: int | None = None,
    logprobs_field: str = "logprobs",
    json_object: bool = False,
    json_schema: str = "",
    min_tokens: int | None = None,
    skip_special_tokens: bool = True,
) -> Sampling:
    """Validated sampling controls; ``max_tokens`` None = the default, capped by the context
    and the limit. Errors name the fields as the request spelled them: ``max_tokens_field``
    (OpenAI also takes ``max_completion_tokens``) and ``prompt_field`` (``prompt``,
    ``prompt_token_ids`` or ``messages``)."""
    for name, value in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty),
        ("repetition_penalty", repetition_penalty),
    ):
        if value is not None and not _finite(value):
            raise InvalidArgument(f"{name} must be a finite number, got {value!r}", param=name)
    # Integers must fit their proto fields (uint32 max_tokens and top_k, uint64 seed).
    if max_tokens is not None and not _int_in(max_tokens, 0, U32):
        raise InvalidArgument(
            f"{max_tokens_field} must be an integer in [0, {U32}], got {max_tokens!r}",
            param=max_tokens_field,
        )
    if top_k is not None and not _int_in(top_k, 0, U32):
        raise InvalidArgument(
            f"top_k must be an integer in [0, {U32}] (or -1 for off), got {top_k!r}",
            param="top_k",
        )
    if min_tokens is not None and not _int_in(min_tokens, 0, U32):
        raise InvalidArgument(
            f"min_tokens must be an integer in [0, {U32}], got {min_tokens!r}", param="min_tokens"
        )
    if seed is not None and not _int_in(seed, 0, U64):
        raise InvalidArgument(f"seed must be an integer in [0, {U64}], got {seed!r}", param="seed")
    if any(not isinstance(s, str) for s in stop):
        raise InvalidArgument("stop must be a string or a list of strings", param="stop")
    if logprobs is not None and not _int_in(logprobs, 0, MAX_LOGPROBS):
        raise InvalidArgument(
            f"{logprobs_field} must be an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}",
            param=logprobs_field,
        )
    bias = []
    for token, value in (logit_bias or {}).items():
        if not _int_in(token, 0, limits.vocab_size - 1):
            raise InvalidArgument(
                f"logit_bias: token id {token!r} is outside the vocabulary "
                f"[0, {limits.vocab_size})",
                param="logit_bias",
            )
        if not _finite(value) or not -100 <= value <= 100:
            raise InvalidArgument(
                f"logit_bias[{token}] must be a number in [-100, 100], got {value!r}",
                param="logit_bias",
            )
        bias.append((token, float(value)))
    for t in stop_token_ids:
        if not _int_in(t, 0, limits.vocab_size - 1):
            raise InvalidArgument(
                f"stop_token_ids: token id {t!r} is outside the vocabulary "
                f"[0, {limits.vocab_size})",
                param="stop_token_ids",
            )
    room = limits.max_model_len - prompt_len if limits.max_model_len else limits.max_tokens_limit
    if room <= 0:
        raise InvalidArgument(
            f"{prompt_field}: {prompt_len} tokens leave no room in the model context of "
            f"{limits.max_model_len} tokens",
            param=prompt_field,
        )
    if max_tokens is None:  # a default above the limit must not refuse what the caller left out
        max_tokens = min(limits.default_max_tokens, room, limits.max_tokens_limit)
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        top_k=top_k or 0,
        seed=seed,
        stop=tuple(stop),
        ignore_eos=bool(ignore_eos),
        presence_penalty=float(presence_penalty or 0.0),
        frequency_penalty=float(frequency_penalty or 0.0),
        repetition_penalty=1.0 if repetition_penalty is None else float(repetition_penalty),
        logit_bias=tuple(sorted(bias)),
        stop_token_ids=tuple(stop_token_ids),
        logprobs=logprobs,
        json_object=json_object,
        json_schema=json_schema,
        min_tokens=min_tokens or 0,
        skip_special_tokens=bool(skip_special_tokens),
    )
    try:
        sampling.validate(limits.max_tokens_limit)
    except InvalidArgument as exc:
        if exc.param != "max_tokens" or max_tokens_field == "max_tokens":
            raise
        message = str(exc).replace("max_tokens", max_tokens_field, 1)
        raise InvalidArgument(message, param=max_tokens_field) from None
    if max_tokens > room:
        raise InvalidArgument(
            f"{max_tokens_field} {max_tokens} + prompt {prompt_len} tokens exceeds the model "
            f"context of {limits.max_model_len} tokens",
            param=max_tokens_field,
        )
    return sampling
