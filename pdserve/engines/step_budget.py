"""The step-budget arithmetic of :mod:`pdserve.engines.vllm_scheduler`, kept free of vLLM so
unit tests drive it directly: a learnt step-cost model and the prompt budget that keeps every
decoding stream within its time-per-output-token target."""

from __future__ import annotations

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


def prompt_budget(
    streams: list[tuple[float, int]], now: float, target_s: float, cost: StepCost, block: int
) -> int:
    """Prompt tokens the next step may take beside ``streams`` ((first-token time, output
    tokens so far) of each decoding stream) so that every stream's time per output token stays
    within ``target_s`` after the step; at least ``block``."""
    allowed = min(target_s * n - (now - first) for first, n in streams)
    return max(block, cost.tokens_within(allowed))
