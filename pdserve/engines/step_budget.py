"""The step-budget arithmetic of :mod:`pdserve.engines.vllm_scheduler`, kept free of vLLM so
unit tests drive it directly: a learnt step-cost model and the prompt budget that keeps every
decoding stream within its time-per-output-token target."""

from __future__ import annotations

from dataclasses import dataclass

#: ``additional_config`` keys that carry the scheduler's targets (milliseconds; 0 = off).
TPOT_TARGET_KEY = "pdserve_tpot_target_ms"
TTFT_URGENT_KEY = "pdserve_ttft_urgent_ms"

#: Starting cost model (seconds): SmolLM2-135M bf16 on one AVX-512 core.
FIXED_S = 0.030
PER_TOKEN_S = 0.0017
_ALPHA = 0.2


class StepCost:
    """Step time = fixed + per_token * prompt tokens, learnt from measured steps."""

    def __init__(self, fixed_s: float = FIXED_S, per_token_s: float = PER_TOKEN_S) -> None:
        self.fixed_s = fixed_s
        self.per_token_s = per_token_s

    def observe(self, seconds: float, prompt_tokens: int) -> None:
        if prompt_tokens == 0:
            self.fixed_s += _ALPHA * (seconds - self.fixed_s)
        elif prompt_tokens >= 16:
            per = max(1e-5, (seconds - self.fixed_s) / prompt_tokens)
            self.per_token_s += _ALPHA * (per - self.per_token_s)

    def tokens_within(self, seconds: float) -> int:
        return int(max(0.0, seconds - self.fixed_s) / self.per_token_s)


#: A stream is expected to last as long again as it has so far, and at least this many more
#: tokens (capped by its max_tokens): the future short steps a long step is averaged over.
MIN_FUTURE_TOKENS = 4


@dataclass(frozen=True)
class Stream:
    """A decoding stream as the scheduler sees it."""

    first_token_at: float  # seconds, the scheduler's clock
    tokens: int  # output tokens so far (>= 1)
    max_tokens: int


def future_tokens(stream: Stream) -> int:
    """Tokens the stream is expected to produce after the next one."""
    left = max(0, stream.max_tokens - stream.tokens - 1)
    return min(left, max(MIN_FUTURE_TOKENS, stream.tokens))


def prompt_budget(
    streams: list[Stream], now: float, target_s: float, cost: StepCost, block: int
) -> int:
    """Prompt tokens the next step may take beside ``streams`` so that every stream's time
    per output token (vLLM's TPOT: from its first token to its last, over the tokens after the
    first) is projected within ``target_s``: its time so far, plus this step, plus its expected
    future tokens at a decode-only step each. At least ``block``, so prompts always progress."""

    def allowed(s: Stream) -> float:
        future = future_tokens(s)
        return target_s * (s.tokens + future) - (now - s.first_token_at) - future * cost.fixed_s

    return max(block, cost.tokens_within(min(allowed(s) for s in streams)))
