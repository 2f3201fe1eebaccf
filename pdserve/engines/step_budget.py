"""The step-budget arithmetic of :mod:`pdserve.engines.vllm_scheduler`, kept free of vLLM so
unit tests drive it directly: a learnt step-cost model and the prompt budget that keeps every
decoding stream within its time-per-output-token target."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

#: ``additional_config`` keys that carry the scheduler's targets (milliseconds; 0 = off).
TPOT_TARGET_KEY = "pdserve_tpot_target_ms"
TTFT_URGENT_KEY = "pdserve_ttft_urgent_ms"
TTFT_TARGET_KEY = "pdserve_ttft_target_ms"
PREFILL_ORDER_KEY = "pdserve_prefill_order"

#: How waiting prompts share the engine (``prefill_order``): grouped by first-token deadline
#: (:func:`deadline_group`), one at a time (fewest tokens to compute first, or oldest first), or
#: vLLM's own way (every waiting prompt in the next step).
PREFILL_ORDERS = ("deadline", "shortest", "arrival", "batched")

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

    def step_s(self, tokens: int) -> float:
        """Projected time of one step that computes ``tokens`` prompt tokens."""
        return self.fixed_s + self.per_token_s * tokens


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
    future tokens at a decode-only step each. At least ``block``, so prompts always progress
    (the scheduler passes 0 where the prompts waiting may wait: ones past their deadline, whose
    first token is lost to its target whatever this step does; a floor above 0 would make the
    future steps longer than the decode-only steps the projection counts on)."""

    step = min(allowed_step_s(s, now, target_s, cost) for s in streams)
    return max(block, cost.tokens_within(step))


def allowed_step_s(stream: Stream, now: float, target_s: float, cost: StepCost) -> float:
    """The longest next step that keeps ``stream`` projected within ``target_s`` (its time so
    far, this step, its expected future tokens at a decode-only step each)."""
    future = future_tokens(stream)
    spent = now - stream.first_token_at
    return target_s * (stream.tokens + future) - spent - future * cost.fixed_s


def streams_overrun(
    streams: Sequence[Stream], now: float, target_s: float, cost: StepCost, tokens: int
) -> int:
    """How many of ``streams`` a step of ``tokens`` prompt tokens takes past ``target_s``."""
    step = cost.step_s(tokens)
    return sum(1 for s in streams if allowed_step_s(s, now, target_s, cost) < step)


@dataclass(frozen=True)
class Prompt:
    """A prompt waiting for its prefill, as the scheduler sees it."""

    arrival: float  # seconds, wall clock
    tokens: int  # prompt tokens still to compute (local prefix-cache hits taken off)
    #: hashes of the full blocks it would compute, in order (chained: equal at i, equal before)
    blocks: tuple[Hashable, ...] = ()


def _tokens_beside(p: Prompt, claimed: set[Hashable], block_tokens: int) -> int:
    """Tokens ``p`` computes in a step whose earlier prompts schedule the blocks ``claimed``
    (at least one: the last prompt token is always computed)."""
    shared = 0
    for h in p.blocks:
        if h not in claimed:
            break
        shared += 1
    return max(1, p.tokens - shared * block_tokens)


def group_tokens(prompts: Sequence[Prompt], group: Sequence[int], block_tokens: int) -> int:
    """Prompt tokens a step computes for ``group`` together. vLLM caches a prompt's blocks
    when it schedules them, so a later prompt in the same step that starts with those blocks
    hits them: a shared prefix is computed once."""
    claimed: set[Hashable] = set()
    total = 0
    for i in group:
        total += _tokens_beside(prompts[i], claimed, block_tokens)
        claimed.update(prompts[i].blocks)
    return total


def next_prompt(prompts: Sequence[Prompt], now: float, urgent_s: float, order: str) -> int:
    """Index of the prompt to prefill next, alone in its step (``shortest``, ``arrival``).

    On a CPU a step's time grows with its prompt tokens and every prompt in it gets its first
    token only at the end, so prefilling a burst of prompts together makes each wait for all
    of them; one at a time, the first waits for itself only, and the sum of the waits is
    smallest with the shortest first. A prompt waiting ``urgent_s`` or longer goes before the
    others (oldest first), so a long one is not passed over for ever (``urgent_s`` 0: never).
    Contract: ``prompts`` is non-empty; ties go to the oldest, then to the earlier index."""

    def key(i: int) -> tuple[bool, float, float]:
        p = prompts[i]
        urgent = urgent_s > 0 and now - p.arrival >= urgent_s
        size = 0 if urgent or order == "arrival" else p.tokens
        return (not urgent, size, p.arrival)

    return min(range(len(prompts)), key=key)


#: ``deadline``: a late prompt that has waited this many times ``target_s`` is overdue.
OVERDUE_TARGETS = 2.0
#: ``deadline``: with no prompt on time, late prompts share a step of at most this many times
#: ``target_s`` (the scheduler's ``late_s``).
LATE_STEP_TARGETS = 0.25


def deadline_group(
    prompts: Sequence[Prompt],
    now: float,
    target_s: float,
    cost: StepCost,
    block_tokens: int = 0,
    late_s: float = 0.0,
) -> tuple[list[int], bool]:
    """The prompts to prefill together in the next step (``deadline``), and whether they can
    all still get their first token within ``target_s`` of their arrival (their deadline).

    A prompt is live while one step of its own would end by its deadline. Live prompts go
    together, oldest first, as long as the step that holds them all is projected to end by
    every one's deadline: a burst that fits in time shares one step, as vLLM batches it (the
    fewest steps, so the most tokens per second), and one too large for the time left
    prefills what can still be on time first instead of making every prompt late. A step's
    tokens count a prefix the group shares once (:func:`group_tokens`). With no live
    prompt, late ones go together, oldest first, in a step projected to take at most
    ``late_s`` (at least the oldest, alone when ``late_s`` is 0): their first tokens are late
    whatever the order, and a backlog drains fastest in steps that pay the fixed cost once for
    many prompts, while a bounded step keeps the next live prompt's wait short. So that a load
    that keeps live prompts coming does not starve the late ones for ever, the oldest late
    prompt once overdue (waiting ``OVERDUE_TARGETS`` times ``target_s``) heads the step, and
    live prompts join it while they still fit: late prompts drain one per step at least, and
    the longest wait stays bounded at the price of some live prompts' deadlines.
    Contract: ``prompts`` is non-empty; returns a non-empty list of indices."""

    def oldest(indices: Iterable[int]) -> list[int]:
        return sorted(indices, key=lambda i: (prompts[i].arrival, i))

    live = oldest(
        i for i, p in enumerate(prompts) if now + cost.step_s(p.tokens) <= p.arrival + target_s
    )
    overdue = oldest(
        i
        for i, p in enumerate(prompts)
        if target_s > 0 and now - p.arrival >= OVERDUE_TARGETS * target_s
    )
    group = overdue[:1]
    tokens = group_tokens(prompts, group, block_tokens)
    claimed: set[Hashable] = {h for i in group for h in prompts[i].blocks}
    deadline = float("inf")
    for i in live:
        p = prompts[i]
        more = _tokens_beside(p, claimed, block_tokens)
        if now + cost.step_s(tokens + more) <= min(deadline, p.arrival + target_s):
            group.append(i)
            tokens += more
            claimed.update(p.blocks)
            deadline = min(deadline, p.arrival + target_s)
    if len(group) > len(overdue[:1]):
        return group, not overdue
    group, tokens, claimed = [], 0, set()
    for i in oldest(range(len(prompts))):
        more = _tokens_beside(prompts[i], claimed, block_tokens)
        if group and cost.step_s(tokens + more) > late_s:
            break
        group.append(i)
        tokens += more
        claimed.update(prompts[i].blocks)
    return group, False


def chunked_on_time(tokens: int, budget: int, time_left_s: float, cost: StepCost) -> bool:
    """Whether ``tokens`` of prompt, ``budget`` per step, are computed within ``time_left_s``
    (each step pays the fixed cost once)."""
    steps = -(-tokens // max(1, budget))
    return steps * cost.fixed_s + tokens * cost.per_token_s <= time_left_s


#: :func:`on_time_budget` plans to finish within this share of the time left (the cost model
#: is an average: a step can take longer than projected).
ON_TIME_MARGIN = 0.8


def on_time_budget(tokens: int, time_left_s: float, cost: StepCost) -> int:
    """The smallest prompt budget per step with which ``tokens`` are computed within
    ``ON_TIME_MARGIN`` of ``time_left_s`` (:func:`chunked_on_time`), so that a group that must
    be on time stretches the streams' steps as little as it can: a 1 s group with 2 s left
    goes in many short steps, not one long one. ``tokens`` (in full, one step) when no split
    fits."""
    spare = ON_TIME_MARGIN * time_left_s - tokens * cost.per_token_s
    steps = int(spare / cost.fixed_s) if spare > 0 else 0
    if steps <= 1:
        return tokens
    return -(-tokens // steps)
