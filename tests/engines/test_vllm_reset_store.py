"""vLLM's ``reset_prefix_cache(reset_connector=True)`` reaches the KV store: the connector's
``reset_cache`` drops every chunk of the engine's fingerprint (a plaintext master: any
identity may), and a prompt the engine stored before is no longer found there."""

from __future__ import annotations

import random
from pathlib import Path

from vllm_runner import VLLM_ENGINE_MARKS, run_engine

pytestmark = VLLM_ENGINE_MARKS


def test_reset_with_the_connector_drops_the_engines_chunks(tmp_path: Path) -> None:
    from pdserve.model.prepare import build_tiny_model
    from pdserve.procs import local_store
    from pdserve.store.client import StoreClient

    build_tiny_model()
    prompt = [random.Random(11).randrange(3, 500) for _ in range(200)]  # 3 full 64-token chunks
    single = {"mode": "single", "id": "cold", "prompt": prompt, "max_tokens": 2}
    with local_store(tmp_path / "logs", segment_size="64MiB") as (master, _node):
        config = {
            "model": "tiny",
            "chunk_size": 64,
            "vllm_block_size": 32,
            "max_model_len": 512,
            "max_num_seqs": 4,
            "vllm_kv_cache_gib": 1,
            "store_master": master.info["grpc"],
        }
        with StoreClient(master.info["grpc"], control="grpc") as client:
            run_engine(tmp_path, "store", config, [single])
            (fp,) = [f for f in client.list_namespaces() if f.fingerprint]
            assert fp.objects >= 3 and fp.labels["model_id"]
            (reset,) = run_engine(tmp_path, "reset", config, [{"mode": "reset_store", "id": "r"}])
            assert reset["reset"] is True
            assert [f.fingerprint for f in client.list_namespaces()] == []
            assert client.stats().dropped_objects == fp.objects
