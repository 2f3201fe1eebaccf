"""The vLLM engine arguments per device (pdserve/engines/vllm_profile.py): pdserve's serving
profile on a CPU, vLLM's own defaults on a GPU but for what the store needs; the user's
settings win on both."""

from __future__ import annotations

import pytest

from pdserve.config import ConfigError
from pdserve.engines.config import VLLM_STEP_TOKENS, EngineConfig
from pdserve.engines.step_budget import PREFILL_ORDER_KEY, TPOT_TARGET_KEY
from pdserve.engines.vllm_profile import SCHEDULER_CLASS, engine_kwargs, load_async


def _cfg(**kw) -> EngineConfig:
    cfg = EngineConfig(engine="vllm", **kw)
    cfg.validate()
    return cfg


def test_a_cpu_gets_pdserves_serving_profile():
    out = engine_kwargs(_cfg(), gpu=False)
    assert out["enforce_eager"] is True and out["enable_prefix_caching"] is True
    assert (out["max_num_seqs"], out["max_num_batched_tokens"]) == (128, VLLM_STEP_TOKENS)
    assert out["scheduler_cls"] == SCHEDULER_CLASS
    extra = out["additional_config"]
    assert (extra[TPOT_TARGET_KEY], extra[PREFILL_ORDER_KEY]) == (150.0, "deadline")


def test_a_gpu_starts_from_vllms_defaults_with_the_budget_off():
    out = engine_kwargs(_cfg(), gpu=True)
    assert "enforce_eager" not in out  # CUDA graphs: vLLM's default
    assert (out["max_num_seqs"], out["max_num_batched_tokens"]) == (None, None)
    assert out["enable_prefix_caching"] is True  # the store's reuse starts from vLLM's own
    extra = out["additional_config"]
    assert (extra[TPOT_TARGET_KEY], extra[PREFILL_ORDER_KEY]) == (0.0, "batched")


@pytest.mark.parametrize("gpu", [False, True])
def test_what_the_user_sets_wins_on_either_device(gpu):
    cfg = _cfg(
        tpot_target_ms=80.0,
        prefill_order="shortest",
        max_num_seqs=16,
        max_num_batched_tokens=512,
        vllm_args={"enforce_eager": False, "enable_prefix_caching": False},
    )
    out = engine_kwargs(cfg, gpu=gpu)
    assert (out["max_num_seqs"], out["max_num_batched_tokens"]) == (16, 512)
    extra = out["additional_config"]
    assert (extra[TPOT_TARGET_KEY], extra[PREFILL_ORDER_KEY]) == (80.0, "shortest")
    assert "enforce_eager" not in out and "enable_prefix_caching" not in out  # vllm_args'


def test_auto_is_minus_one_and_nothing_else_below_zero():
    with pytest.raises(ConfigError, match=r"tpot_target_ms must be >= 0 \(0 = off\) or -1"):
        _cfg(tpot_target_ms=-5.0)
    with pytest.raises(ConfigError, match="prefill_order must be auto or one of"):
        _cfg(prefill_order="fastest")


@pytest.mark.parametrize(
    ("setting", "cpu", "gpu"),
    [("auto", False, True), ("on", True, True), ("off", False, False), ("true", True, True),
     ("False", False, False)],
)  # fmt: skip
def test_loads_go_off_the_step_on_a_gpu_unless_set(setting: str, cpu: bool, gpu: bool):
    cfg = _cfg(store_load_async=setting)
    assert cfg.store_load_async in ("auto", "on", "off")
    assert (load_async(cfg.store_load_async, False), load_async(cfg.store_load_async, True)) == (
        cpu,
        gpu,
    )
    with pytest.raises(ConfigError, match=r"store_load_async must be one of auto, on, off"):
        _cfg(store_load_async="sometimes")


def test_saves_go_off_the_step_on_a_gpu_unless_set():
    from pdserve.engines.vllm_profile import GPU_SAVE_QUEUE_MIB, save_queue_mib

    assert _cfg().store_save_queue_mib == -1  # auto
    assert (save_queue_mib(-1, False), save_queue_mib(-1, True)) == (0, GPU_SAVE_QUEUE_MIB)
    assert (save_queue_mib(0, True), save_queue_mib(64, False)) == (0, 64)
    with pytest.raises(ConfigError, match=r"store_save_queue_mib must be >= 0 .* or -1"):
        _cfg(store_save_queue_mib=-2)
