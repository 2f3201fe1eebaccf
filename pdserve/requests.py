"""The request and result types the router and the engines share: what a request asks
(:class:`Sampling`), where its prompt KV lives (:class:`KVRef`), and what comes back per token
(:class:`TokenLogprob`, :class:`Finish`). Plain frozen values with no engine or service
behind them; their proto forms, both directions, are in :mod:`pdserve.requests_codec`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.enums import FINISH_REASON
from pdserve.errors import InvalidArgument

#: Why a generation ended: an IntEnum (LENGTH, EOS, STOP, CANCELLED) whose values are
#: pdserve.v1.FinishReason's, taken from its table (:data:`pdserve.enums.FINISH_REASON`).
Finish = enum.IntEnum(
    "Finish", {FINISH_REASON.names[v].upper(): v for v in FINISH_REASON.specified}
)


@dataclass(frozen=True)
class Sampling:
    """Validated sampling controls (see SamplingParams in common.proto)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    #: OpenAI/vLLM penalties over the generated tokens (presence: once per distinct token,
    #: frequency: per occurrence), and vLLM's multiplicative repetition penalty over prompt and
    #: generated tokens (1 = off).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: ``(token id, bias)`` pairs added to the logits before the penalties.
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: Token ids that end the generation (finish STOP, no text).
    stop_token_ids: tuple[int, ...] = ()
    #: Logprobs of each generated token plus this many alternatives; None = none.
    logprobs: int | None = None
    #: Guided decoding (vLLM structured outputs): a JSON object, or this JSON schema's text.
    json_object: bool = False
    json_schema: str = ""
    #: vLLM's min_tokens: no EOS, stop token id or stop string ends the output before this many.
    min_tokens: int = 0
    #: False keeps special tokens in the text (vLLM's skip_special_tokens).
    skip_special_tokens: bool = True

    @property
    def penalized(self) -> bool:
        """Any logit processing beyond temperature/top-k/top-p (bias or a penalty)."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    @property
    def constrained(self) -> bool:
        """Guided decoding asked (``json_object`` or ``json_schema``)."""
        return self.json_object or bool(self.json_schema)

    def validate(self, max_tokens_limit: int) -> None:
        if self.max_tokens <= 0:
            raise InvalidArgument(
                f"max_tokens must be positive, got {self.max_tokens}", param="max_tokens"
            )
        if self.max_tokens > max_tokens_limit:
            raise InvalidArgument(
                f"max_tokens {self.max_tokens} exceeds the limit of {max_tokens_limit}",
                param="max_tokens",
            )
        if not self.temperature >= 0.0:
            raise InvalidArgument(
                f"temperature must be >= 0, got {self.temperature}", param="temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}", param="top_k")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop strings must not be empty", param="stop")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidArgument(f"{name} must be in [-2, 2], got {value}", param=name)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidArgument(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
                param="repetition_penalty",
            )
        for token, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise InvalidArgument(
                    f"logit_bias[{token}] must be in [-100, 100], got {bias}", param="logit_bias"
                )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", param="logprobs"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgument(
                f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}",
                param="min_tokens",
            )
        if self.json_object and self.json_schema:
            raise InvalidArgument(
                "json_object and json_schema are exclusive", param="response_format"
            )

    def check_vocab(self, vocab_size: int) -> None:
        """The token ids of ``logit_bias`` and ``stop_token_ids`` are in the vocabulary."""
        for name, ids in (
            ("logit_bias", [t for t, _ in self.logit_bias]),
            ("stop_token_ids", list(self.stop_token_ids)),
        ):
            for t in ids:
                if not 0 <= t < vocab_size:
                    raise InvalidArgument(
                        f"{name}: token id {t} is outside the vocabulary [0, {vocab_size})",
                        param=name,
                    )

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_BELOW sample greedily, as in vLLM: dividing the logits by
        a tinier one overflows float32 math."""
        return self.temperature < GREEDY_BELOW


#: See :attr:`Sampling.greedy`.
GREEDY_BELOW = 1e-5
#: Most alternatives per token :attr:`Sampling.logprobs` may ask (OpenAI's and vLLM's 20).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability and the ``top`` most likely ``(token id,
    logprob)`` at its position, most likely first (common.proto OutputLogProbs)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class KVRef:
    """Where a request's prompt KV lives in the store (pdserve.v1.KVHandle)."""

    chunk_keys: tuple[str, ...]
    tail_key: str
    num_tokens: int
    chunk_size: int
    fingerprint: bytes
