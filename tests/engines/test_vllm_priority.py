"""vLLM's ``priority`` on a real engine (pdserve's scheduler, vLLM's default ``fcfs`` policy):
of a burst that arrives while the engine is busy, a prompt of a better (lower) priority
prefills first though it came last; prompts of one priority keep their arrival order; and
the tokens are those of the same burst without priorities."""

from __future__ import annotations

import random
from pathlib import Path

from vllm_runner import FORGET, VLLM_ENGINE_MARKS, run_engine

pytestmark = VLLM_ENGINE_MARKS


def test_a_better_priority_prefills_first_with_the_same_tokens(tmp_path: Path) -> None:
    rng = random.Random(11)
    blocker = [rng.randrange(100, 40000) for _ in range(1500)]
    prompts = [[rng.randrange(100, 40000) for _ in range(60)] for _ in range(3)]
    burst = {"mode": "burst", "prompt": blocker, "prompts": prompts, "max_tokens": 4}
    # one prompt a step, oldest first: arrival order unless priority says otherwise
    config = {"model": "smollm2", "chunk_size": 32, "prefill_order": "arrival", "ttft_urgent_ms": 0}
    jobs = [
        {**burst, "id": "prio", "priorities": [0, 3, -1]},
        FORGET,
        {**burst, "id": "plain"},
    ]
    prio, _, plain = run_engine(tmp_path, "priority", config, jobs)
    assert prio["first_order"] == [2, 0, 1]
    assert plain["first_order"] == [0, 1, 2]
    assert prio["tokens"] == plain["tokens"] and all(len(t) == 4 for t in prio["tokens"])
    assert prio["blocker_tokens"] == plain["blocker_tokens"]
