"""The engine interface every model backend implements (one file per implementation:
``torch_engine/``, ``vllm_engine.py``).

An engine owns one model and its tokenizer, and talks to the KV store itself: prefill loads the
longest cached prefix and writes new chunks; generate loads a request's chunks by handle (or
prefills locally) and streams tokens. Model compute never runs on the event loop.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from pdserve.engines.textstream import TextStream
from pdserve.errors import InvalidArgument
from pdserve.hashing import ModelFingerprint
from pdserve.requests import Finish, KVRef, Sampling, TokenLogprob


@dataclass(frozen=True)
class PrefillOutcome:
    first_token_id: int
    kv: KVRef
    cached_tokens: int
    computed_tokens: int
    first_token_is_eos: bool = False
    #: The first token's logprobs (when :attr:`Sampling.logprobs` is set).
    first_logprob: TokenLogprob | None = None


@dataclass
class TokenEvent:
    """New tokens of a generation; the last event carries ``finish``.

    Contract (every engine; DecodeResponse in engine.proto): the prompt counts
    (``loaded_tokens``, ``recomputed_tokens``, ``prefix_cached_tokens``) are set on the last
    event only, the one with ``finish``, and are 0 on every other. They add up to the prompt's
    length, except when prefill's first token ends the generation before the engine built any
    prompt KV (then all 0)."""

    token_ids: list[int]
    text: str
    times_ms: list[float] = field(default_factory=list)
    finish: Finish | None = None
    #: Prompt tokens whose KV came from the store.
    loaded_tokens: int = 0
    #: Prompt tokens the engine computed itself, failed loads included.
    recomputed_tokens: int = 0
    #: Prompt tokens the engine's own prefix cache held (vLLM's local block cache).
    prefix_cached_tokens: int = 0
    #: Logprobs of the last ``len(logprobs)`` of ``token_ids``: those the engine sampled
    #: (prefill's first token, echoed, has none); empty unless :attr:`Sampling.logprobs`.
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class EngineLoad:
    queue_length: int
    running_requests: int
    #: Fraction of the engine's KV cache capacity in use, 0..1 (Load.kv_usage in
    #: common.proto says how each engine measures it).
    kv_usage: float


class Engine(abc.ABC):
    """One model served by one worker process.

    Contract:
    - ``start`` loads the model (may take seconds); every other method needs it done.
    - ``prefill`` and ``generate`` are safe to call concurrently from one event loop; the
      engine queues or batches internally and never blocks the loop.
    - A KV load failure (missing, corrupt, unreachable store) degrades to recomputation,
      never to an error or a different token.
    - Closing the ``generate`` iterator early (client cancel) frees the request's resources.
    """

    fingerprint: ModelFingerprint
    max_model_len: int
    eos_token_id: int
    vocab_size: int
    #: Why this engine serves without the KV store ("" = it uses it, or has none configured):
    #: set by ``start``, shown in the worker's registration and ``pdserve status``.
    store_off: str = ""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    @abc.abstractmethod
    def decode_text(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    @abc.abstractmethod
    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        *,
        publish_incrementally: bool = False,
        cache_salt: str = "",
        bypass_store: bool = False,
        priority: int = 0,
    ) -> PrefillOutcome:
        """Loads cached prefix chunks, computes the rest, writes new full chunks under their
        chain keys (skipping existing ones) and the partial tail under a request-scoped key
        with a TTL, and returns only after every chunk is committed in the store.

        ``cache_salt`` ("" = none, else validated by the caller) selects the chain
        (:func:`pdserve.hashing.chunk_keys`): keys loaded, saved and returned are the salt's,
        and the engine's own prefix cache, if any, reuses only entries of the same salt.

        ``bypass_store``: this request neither loads from nor saves to the KV store (every
        prompt token is computed, nothing is written); the returned handle still names the
        salt's keys, which a decode then finds missing and recomputes.

        ``priority``: vLLM's, lower first: the vLLM engine's scheduler takes waiting prompts
        in that order (:mod:`pdserve.engines.vllm_scheduler`); the torch reference engine
        runs in arrival order."""

    @abc.abstractmethod
    def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        *,
        kv: KVRef | None = None,
        first_token_id: int | None = None,
        chunk_wait_ms: int = 0,
        cache_salt: str = "",
        bypass_store: bool = False,
        priority: int = 0,
    ) -> AsyncIterator[TokenEvent]:
        """Streams generated tokens. With ``kv`` the prompt KV is loaded from the store and
        ``first_token_id`` (from prefill) is the first output token; without, the engine
        prefills locally (reusing cached prefix chunks when it can). ``cache_salt`` as in
        :meth:`prefill`: ``kv`` must hold that salt's keys. ``bypass_store`` as in
        :meth:`prefill`: nothing is loaded (``kv`` included: the prompt is computed) or saved.
        ``priority`` as in :meth:`prefill`.

        Write mode: ``kv`` without ``first_token_id`` names the prompt's leading full chunks
        (no tail) that a prefill running elsewhere is still publishing. The engine waits up to
        ``chunk_wait_ms`` for each (0: loads what is stored), loading each as it lands, never
        on the thread that runs the model (the other generations keep going), then computes
        the rest of the prompt and samples the first token itself; a chunk that does not land
        is computed. An engine that cannot do this raises
        :class:`pdserve.errors.Unimplemented`; the router then serves the request with the
        read plan. A handle that does not match the prompt is ignored (computed)."""

    @abc.abstractmethod
    def load(self) -> EngineLoad: ...

    def check_prompt(self, prompt_token_ids: Sequence[int], sampling: Sampling) -> None:
        """Shared input validation: INVALID_ARGUMENT naming what is wrong."""
        field = "prompt_token_ids"
        if not prompt_token_ids:
            raise InvalidArgument(f"{field} must contain at least one token", param=field)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(
                f"{field}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                param=field,
            )
        sampling.check_vocab(self.vocab_size)
        if len(prompt_token_ids) + sampling.max_tokens > self.max_model_len:
            raise InvalidArgument(
                f"{field} ({len(prompt_token_ids)} tokens) + max_tokens ({sampling.max_tokens}) "
                f"exceeds the model context of {self.max_model_len} tokens",
                param=field,
            )


def text_stream(decode_text: Callable[..., str], sampling: Sampling) -> TextStream:
    """The :class:`TextStream` of one generation: ``decode_text(ids, skip_special_tokens)``
    as the request asks, its stop strings, its ``min_tokens``."""
    skip = sampling.skip_special_tokens
    return TextStream(
        lambda ids: decode_text(ids, skip_special_tokens=skip),
        sampling.stop,
        min_tokens=sampling.min_tokens,
    )


def next_text(
    stream: TextStream,
    token: int,
    generated: int,
    sampling: Sampling,
    eos_token_id: int,
    *,
    context_full: bool = False,
) -> tuple[str, Finish | None]:
    """The one finish rule for a token an engine produced itself (the torch engine's every
    token, the vLLM engine's first token from prefill): the text it adds to the stream and
    whether it ends the generation. ``generated`` counts tokens so far, this one included.
    EOS (unless ignored) ends it without text, a stop token id likewise (finish STOP); a stop
    string ends it with the text before the stop; ``max_tokens`` or a full context ends it
    with any held-back text flushed."""
    if token == eos_token_id and not sampling.ignore_eos:
        return stream.flush(), Finish.EOS
    if token in sampling.stop_token_ids:
        return stream.flush(), Finish.STOP
    text = stream.add(token)
    if stream.stopped:
        return text, Finish.STOP
    if generated >= sampling.max_tokens or context_full:
        return text + stream.flush(), Finish.LENGTH
    return text, None
