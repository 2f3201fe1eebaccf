"""The two engines share one cache: chunks the torch engine writes, the vLLM engine reads, and
the reverse, token-exact against Hugging Face greedy (same model, same KV dtype, same chunk
size: the same fingerprint, so the same keys). Real store processes; vLLM in its own process
(tests/engines/vllm_runner.py), loading asynchronously, the torch engine in this one.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
from pathlib import Path

import pytest
from vllm_runner import run_engine

from pdserve.engines import create_engine
from pdserve.engines.config import EngineConfig
from pdserve.requests import Sampling

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]
CHUNK = 32
MAX_TOKENS = 8


def _config(master: str) -> dict:
    return {
        "model": "tiny",
        "chunk_size": CHUNK,
        "kv_dtype": "float32",
        "max_model_len": 512,
        "store_master": master,
        "tail_ttl_ms": 900_000,
    }


async def _torch(config: dict, prompt: list[int], prefill: bool) -> tuple[list[int], int]:
    """(tokens, tokens loaded from the store) of the torch engine on ``prompt``."""
    engine = create_engine(EngineConfig(engine="torch", **config))  # with its store client
    await engine.start()
    sampling = Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        if prefill:
            res = await engine.prefill("t-prefill", prompt, sampling)
            return [res.first_token_id], res.cached_tokens
        tokens, loaded = [], 0
        async for ev in engine.generate("t-gen", prompt, sampling):
            tokens.extend(ev.token_ids)
            loaded = max(loaded, ev.loaded_tokens)  # which message carries it: see base.py
        return tokens, loaded
    finally:
        await engine.close()


def test_torch_writes_what_vllm_reads_and_the_reverse(tmp_path: Path, hf_greedy):
    from pdserve.procs import local_store

    rng = random.Random(11)
    by_torch = [rng.randrange(3, 500) for _ in range(100)]  # 3 full chunks + a tail
    by_vllm = [rng.randrange(3, 500) for _ in range(130)]  # 4 full chunks + a tail
    with local_store(tmp_path / "logs", segment_size="64MiB") as (master, _node):
        config = _config(master.info["grpc"])
        # the vLLM engine loads off the step (store_load_async, a GPU's default): the request
        # parks in WAITING_FOR_REMOTE_KVS while a connector thread loads its chunks; the
        # synchronous loads (a CPU's default) are every other vLLM test's
        vllm_config = {**config, "vllm_block_size": 32, "vllm_kv_cache_gib": 1,
                       "max_num_seqs": 4, "store_load_async": "on"}  # fmt: skip
        asyncio.run(_torch(config, by_torch, prefill=True))
        jobs = [
            {"mode": "single", "id": "read-torch", "prompt": by_torch, "max_tokens": MAX_TOKENS},
            {"mode": "prefill", "id": "write", "prompt": by_vllm, "max_tokens": MAX_TOKENS},
        ]
        read, _write = run_engine(tmp_path, "vllm", vllm_config, jobs)
        tokens, loaded = asyncio.run(_torch(config, by_vllm, prefill=False))
    # vLLM loads the torch engine's 3 full chunks (its last prompt token is always computed)
    assert read["loaded"] == 3 * CHUNK, read
    assert read["tokens"] == hf_greedy(by_torch, MAX_TOKENS)
    # and the torch engine loads vLLM's 4 full chunks
    assert loaded == 4 * CHUNK
    assert tokens == hf_greedy(by_vllm, MAX_TOKENS)
