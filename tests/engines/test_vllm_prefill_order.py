"""The vLLM scheduler's prefill order (``prefill_order``), on real engines: a burst of prompts
that arrives while the engine is busy prefills one prompt per step, fewest tokens first (and
``deadline``, once the burst can no longer be on time, oldest first), each first token coming as soon as
its own prefill is done (vLLM's own order, ``batched``, would give every prompt its first token
at the end of the whole burst). Tokens are the same in either order and as each prompt's alone.
(Which prompts ``deadline`` groups is unit-tested in test_step_budget.py.)"""

from __future__ import annotations

import random
from pathlib import Path

from vllm_runner import FORGET, VLLM_ENGINE_MARKS, run_engine

pytestmark = VLLM_ENGINE_MARKS

#: The burst, not in order of length. Its shortest prompt arrives first: the prompts reach the
#: engine one after another, and a first one the scheduler sees alone goes first in any order
#: (CI once found 150 tokens going before 40 that way), so the shortest-first order must not
#: depend on it; the arrival order still differs from it.
LENGTHS = [40, 150, 260, 90, 200]
#: The order the burst's prompts are drawn in (of :data:`LENGTHS`): random token ids give flat
#: next-token distributions, and these draws are known free of near ties, where a stream
#: decoded beside others could take another token than alone (float32 sums in another order).
DRAWN = [1, 0, 2, 3, 4]


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_burst_prefills_shortest_first_with_the_same_tokens(tmp_path: Path) -> None:
    rng = random.Random(5)
    blocker = _prompt(rng, 1500)  # keeps the engine busy while the burst arrives
    drawn = [_prompt(rng, LENGTHS[i]) for i in DRAWN]
    job = {
        "mode": "burst",
        "id": "b",
        "prompt": blocker,
        "prompts": [drawn[DRAWN.index(i)] for i in range(len(LENGTHS))],
        "max_tokens": 4,
    }
    config = {"model": "smollm2", "chunk_size": 32}
    # after the burst, each prompt alone (vLLM's prefix cache emptied first: each computes again)
    alone = [
        {"mode": "single", "id": f"alone-{i}", "prompt": p, "max_tokens": 4}
        for i, p in enumerate([job["prompt"], *job["prompts"]])
    ]
    # the burst waits longer than ttft_urgent_ms behind the blocker: urgency off, or it would
    # go oldest first
    shortest = run_engine(
        tmp_path,
        "shortest",
        {**config, "prefill_order": "shortest", "ttft_urgent_ms": 0},
        [job, FORGET, *alone],
    )
    # a 1 ms target no prompt can meet: every prompt is late on arrival, and late prompts go
    # one at a time, oldest first (with 500 ms, a prompt of the burst that came late enough on
    # a loaded machine was still live, and went before an older one: CI)
    late = {**config, "prefill_order": "deadline", "ttft_target_ms": 1}
    deadline = run_engine(tmp_path, "deadline", late, [job])

    by_length = sorted(range(len(LENGTHS)), key=LENGTHS.__getitem__)
    assert shortest[0]["first_order"] == by_length
    assert deadline[0]["first_order"] == list(range(len(LENGTHS)))  # late: oldest first
    assert deadline[0]["tokens"] == shortest[0]["tokens"]
    assert deadline[0]["blocker_tokens"] == shortest[0]["blocker_tokens"]
    assert [r["tokens"] for r in shortest[2:]] == [
        shortest[0]["blocker_tokens"],
        *shortest[0]["tokens"],
    ]
    assert all(r["prefix_cached"] == 0 for r in shortest[2:])
    assert all(len(t) == 4 for t in shortest[0]["tokens"])
