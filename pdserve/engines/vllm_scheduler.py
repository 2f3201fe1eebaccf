"""vLLM's scheduler with a step budget sized to the streams' time-per-output-token target.

On a CPU core a step costs about ``fixed + per_token * prompt tokens`` (SmolLM2 bf16 on one
core: ~30 ms to stream the weights once, ~1.7 ms per prompt token), and every running stream
waits for the whole step. vLLM's CPU default of 2048 tokens per step lets one prompt's prefill
stretch a step beside running streams to half a second; a small static budget instead slows
every prefill, even when the streams are far ahead of their target.

So each step gets the largest prompt budget that keeps every decoding stream's time per
output token (vLLM's TPOT: first to last token, over the tokens after the first) projected
within ``tpot_target_ms``: its time so far, plus this step, plus the tokens it is expected to
produce next (as many again as so far, at least 4, at most its ``max_tokens``) at a
decode-only step each:

    allowed step = min over streams (target * (tokens + future) - time since first
                                     - future * fixed)
    prompt tokens = (allowed - fixed) / per_token        (at least one block, for progress)

A young stream with tokens to come absorbs one long prefill step over all of them, as vLLM's
prefill-first default does; a stream that is behind, or about to end, gets short steps until
it is done. With no stream decoding, prompts prefill in full ``max_num_batched_tokens`` steps.
``fixed`` and ``per_token`` are learnt from the engine's own step times (EWMA), so the budget
follows the model and the machine.

Prompts are not starved for it: one that has waited ``ttft_urgent_ms`` since it arrived gets
its whole remaining prompt into the next step, streams or not (a stream absorbs one long step
over all its tokens; a first token that misses its target is lost for good).

While every request the engine holds is waiting for its KV to arrive (write mode's
asynchronous load, :mod:`pdserve.engines.vllm_connector`) and nothing else is runnable, each
step waits ``REMOTE_KV_IDLE_S`` first. vLLM's own loop would run about a thousand empty steps a
second to learn when the load is done, measured here at more than a whole core (engine core
plus worker process) taken from the prefill computing those very chunks. The price: a request
arriving meanwhile starts up to that much later, and a finished load is noticed that much later.

Loaded inside vLLM's engine core through ``scheduler_cls``; the targets come from
``additional_config`` (``pdserve_tpot_target_ms``, ``pdserve_ttft_urgent_ms``; 0 = off).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from pdserve.engines.step_budget import (
    TPOT_TARGET_KEY,
    TTFT_URGENT_KEY,
    StepCost,
    Stream,
    prompt_budget,
)

#: Pause before a step while the engine only waits for asynchronous KV loads (seconds).
REMOTE_KV_IDLE_S = 0.01


class StreamFirstScheduler(Scheduler):
    """vLLM's scheduler with the step budget of the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = getattr(self.vllm_config, "additional_config", None) or {}
        self.tpot_target_s = float(extra.get(TPOT_TARGET_KEY, 0)) / 1000.0
        self.ttft_urgent_s = float(extra.get(TTFT_URGENT_KEY, 0)) / 1000.0
        self.full_step_tokens = self.max_num_scheduled_tokens
        self.cost = StepCost()
        self._first_token_at: dict[str, float] = {}
        self._step_started = 0.0
        self._step_prompt_tokens = 0

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self._only_waiting_for_kv():
            time.sleep(REMOTE_KV_IDLE_S)
        now = time.monotonic()
        streams = []
        if self.tpot_target_s > 0:
            seen = self._first_token_at
            live = {}
            for r in self.running:
                if r.num_computed_tokens >= r.num_prompt_tokens and r.num_output_tokens > 0:
                    first = live[r.request_id] = seen.get(r.request_id, now)
                    streams.append(Stream(first, r.num_output_tokens, r.max_tokens))
            self._first_token_at = live
        if streams:
            budget = prompt_budget(
                streams, now, self.tpot_target_s, self.cost, self.cache_config.block_size
            )
            budget = max(budget, self._urgent_prompt_tokens())
            self.max_num_scheduled_tokens = min(self.full_step_tokens, len(streams) + budget)
        else:
            self.max_num_scheduled_tokens = self.full_step_tokens
        out = super().schedule(*args, **kwargs)
        if self.tpot_target_s > 0:
            total = sum(out.num_scheduled_tokens.values())
            prompts = max(0, total - len(streams))
            self._step_started, self._step_prompt_tokens = time.monotonic(), prompts
        return out

    def _only_waiting_for_kv(self) -> bool:
        """Nothing to compute or clean up: every request waits for an asynchronous KV load
        that has not finished."""
        return (
            not self.running
            and not self.waiting
            and not self.finished_req_ids
            and not self.finished_recving_kv_req_ids
            and len(self.kv_holding_waiting) > 0
            and all(
                r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.kv_holding_waiting
            )
        )

    def _urgent_prompt_tokens(self) -> int:
        """Prompt tokens still to compute of the prompts waiting longer than ttft_urgent_ms
        (arrival times are wall-clock, stamped by vLLM's front end on this host)."""
        if self.ttft_urgent_s <= 0:
            return 0
        late = time.time() - self.ttft_urgent_s
        return sum(
            r.num_prompt_tokens - r.num_computed_tokens
            for r in itertools.chain(self.running, self.waiting)
            if r.num_computed_tokens < r.num_prompt_tokens and r.arrival_time < late
        )

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if self._step_started and scheduler_output.total_num_scheduled_tokens:
            self.cost.observe(time.monotonic() - self._step_started, self._step_prompt_tokens)
        self._step_started = 0.0
        return super().update_from_output(scheduler_output, model_runner_output)
