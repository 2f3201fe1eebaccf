"""The vLLM engine's side of two worker contracts, on one engine process without a store:
Load.kv_usage is vLLM's own KV cache usage (the scheduler's share of KV blocks in use), and the
prompt counts of a generation come with its last event only (DecodeResponse in engine.proto),
adding up to the prompt's length, vLLM's own prefix cache hits included."""

from __future__ import annotations

import math
import random
from pathlib import Path

from vllm_runner import VLLM_ENGINE_MARKS, run_engine

pytestmark = VLLM_ENGINE_MARKS

BLOCK = 32
N = 100  # 3 full blocks + 4 tokens
MAX_TOKENS = 8


def test_vllm_kv_usage_and_prompt_counts(tmp_path: Path) -> None:
    from pdserve.model.prepare import build_tiny_model

    build_tiny_model()
    config = {
        "model": "tiny",
        "chunk_size": 64,
        "vllm_block_size": BLOCK,
        "max_model_len": 512,
        "max_num_seqs": 4,
        "vllm_kv_cache_gib": 1,
    }
    prompt = [random.Random(7).randrange(3, 500) for _ in range(N)]
    jobs = [
        {"mode": "single", "id": name, "prompt": prompt, "max_tokens": MAX_TOKENS}
        for name in ("cold", "again")
    ]
    cold, again = run_engine(tmp_path, "load", config, jobs)
    # counts: on the last event only, adding up to the prompt
    assert cold["early_counts"] == again["early_counts"] == 0
    assert (cold["loaded"], cold["prefix_cached"], cold["recomputed"]) == (0, 0, N), cold
    # the second time vLLM's prefix cache holds the prompt's full blocks
    full = (N // BLOCK) * BLOCK
    assert (again["loaded"], again["prefix_cached"], again["recomputed"]) == (0, full, N - full)
    # KV usage: the blocks the request holds over vLLM's blocks (less its null block) while
    # it runs, none once it ended (its blocks stay cached, but free)
    for run in (cold, again):
        blocks = run["kv_blocks"] - 1
        held = math.ceil((N + MAX_TOKENS) / BLOCK)
        # one event per token, or fewer when a busy engine hands over two tokens at once
        assert len(run["tokens"]) == MAX_TOKENS and 1 <= len(run["kv_usage"]) <= MAX_TOKENS
        for usage in run["kv_usage"][:-1]:
            assert round(usage * blocks) == held, (usage, blocks)
        assert run["kv_usage_after"] == 0.0, run
