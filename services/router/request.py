"""A validated generation request, built from the gRPC or the OpenAI form.

Every check raises :class:`pdserve.errors.InvalidArgument` (or ``NotFound`` for an unknown
model) with a message that names the offending field.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engines.base import Sampling
from pdserve.errors import InvalidArgument

MODES = ("read", "write", "colocated")
_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")
_ROLES = ("system", "user", "assistant")


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


def check_model(model: str, limits: Limits) -> None:
    if model and model != limits.model:
        raise InvalidArgument(
            f"model: unknown model {model!r}; this cluster serves {limits.model!r}"
        )


def check_request_id(request_id: str) -> str:
    if not request_id:
        return uuid.uuid4().hex
    if not _REQUEST_ID.match(request_id):
        raise InvalidArgument("request_id must be 1-128 printable ASCII characters")
    return request_id


def check_messages(messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    if not messages:
        raise InvalidArgument("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in _ROLES:
            raise InvalidArgument(f"messages[{i}].role must be one of {_ROLES}, got {role!r}")
        if isinstance(content, list):  # OpenAI content parts: only text parts are supported
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise InvalidArgument(f"messages[{i}].content: only text parts are supported")
                if not isinstance(part.get("text"), str):
                    raise InvalidArgument(f"messages[{i}].content: a text part needs 'text'")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content must be a string or text parts")
        out.append({"role": role, "content": content})
    return out


def check_token_ids(ids: Sequence[int], limits: Limits, field: str) -> list[int]:
    if not ids:
        raise InvalidArgument(f"{field} must not be empty")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limits.vocab_size:
            raise InvalidArgument(
                f"{field}: token id {t!r} is outside the vocabulary [0, {limits.vocab_size})"
            )
    return list(ids)


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
) -> Sampling:
    """Validated sampling controls; ``max_tokens`` None = the default, capped by the context."""
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise InvalidArgument(f"{name} must be a finite number, got {value!r}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
        raise InvalidArgument(f"max_tokens must be an integer, got {max_tokens!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise InvalidArgument(f"top_k must be an integer, got {top_k!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise InvalidArgument(f"seed must be a non-negative integer, got {seed!r}")
    if any(not isinstance(s, str) for s in stop):
        raise InvalidArgument("stop must be a string or a list of strings")
    room = limits.max_model_len - prompt_len if limits.max_model_len else limits.max_tokens_limit
    if room <= 0:
        raise InvalidArgument(
            f"prompt: {prompt_len} tokens leave no room in the model context of "
            f"{limits.max_model_len} tokens"
        )
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, room)
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        top_k=top_k or 0,
        seed=seed,
        stop=tuple(stop),
        ignore_eos=bool(ignore_eos),
    )
    sampling.validate(limits.max_tokens_limit)
    if max_tokens > room:
        raise InvalidArgument(
            f"max_tokens {max_tokens} + prompt {prompt_len} tokens exceeds the model context "
            f"of {limits.max_model_len} tokens"
        )
    return sampling
