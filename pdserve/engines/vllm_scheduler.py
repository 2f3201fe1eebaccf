"""vLLM's scheduler with a step budget that protects streams: while any request is decoding,
a step schedules every decode plus at most ``decode_step_tokens`` prompt tokens; with no
stream decoding, prompts prefill in full ``max_num_batched_tokens`` steps.

Why: on a CPU core a step costs about its scheduled tokens (SmolLM2 bf16, one core: ~1.7 ms
per prompt token plus ~25 ms fixed), and every running stream waits for the whole step. vLLM's
CPU default of 2048 tokens per step makes a stream's time per output token jump to seconds
whenever another prompt prefills beside it; a small static budget instead slows every prefill,
even on an idle worker. Bounding the budget only while streams decode keeps TPOT near
``25 ms + decode_step_tokens * 1.7 ms`` and leaves idle-time prefill at full speed.

Loaded inside vLLM's engine core through ``scheduler_cls``; the budget comes from
``additional_config["pdserve_decode_step_tokens"]`` (0 = vLLM's behaviour).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

CONFIG_KEY = "pdserve_decode_step_tokens"


class StreamFirstScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = getattr(self.vllm_config, "additional_config", None) or {}
        self.decode_step_tokens = int(extra.get(CONFIG_KEY, 0))
        self.full_step_tokens = self.max_num_scheduled_tokens

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self.decode_step_tokens > 0:
            decoding = sum(1 for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens)
            self.max_num_scheduled_tokens = (
                min(self.full_step_tokens, decoding + self.decode_step_tokens)
                if decoding
                else self.full_step_tokens
            )
        return super().schedule(*args, **kwargs)
