"""What pdserve sets of vLLM's engine arguments, per device (:func:`engine_kwargs`).

On a CPU, pdserve's own serving defaults: eager mode (vLLM's CPU compilation costs minutes at
every start and gains little for small models), ``max_num_seqs`` 128 and a step of
:data:`~pdserve.engines.config.VLLM_STEP_TOKENS` tokens as ``vllm serve`` on CPU, and its
scheduler's step budget (``tpot_target_ms`` 150) and deadline order, which keep decoding
streams on time while prompts prefill beside them on a core that computes one step at a time.

On a GPU, vLLM's own defaults (CUDA graphs on, vLLM's ``max_num_seqs`` and step size, its
batching of waiting prompts), changed only where the store needs it: the KV block size (a
divisor of the chunk size, as on CPU), the dtype that keys the chunks, prefix caching, the
connector. The scheduler class stays for one thing: ordering waiting prompts by the tenant
priority the router sends (a no-op without tenants); its step budget and prefill order are
off unless set. Whatever a user puts in ``vllm_args`` wins over either profile.
"""

from __future__ import annotations

from typing import Any

from pdserve.engines.config import VLLM_STEP_TOKENS, EngineConfig
from pdserve.engines.step_budget import (
    PREFILL_ORDER_KEY,
    TPOT_TARGET_KEY,
    TTFT_TARGET_KEY,
    TTFT_URGENT_KEY,
)

SCHEDULER_CLASS = "pdserve.engines.vllm_scheduler.StreamFirstScheduler"
#: ``tpot_target_ms`` and ``prefill_order`` when auto, per device.
CPU_TPOT_TARGET_MS, CPU_PREFILL_ORDER = 150.0, "deadline"
GPU_TPOT_TARGET_MS, GPU_PREFILL_ORDER = 0.0, "batched"


def on_gpu() -> bool:
    """Whether this process's vLLM runs on a GPU (its platform is not the CPU's)."""
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


#: ``store_save_queue_mib`` when auto (-1) on a GPU; a CPU's is 0 (saves in the step).
GPU_SAVE_QUEUE_MIB = 256


def save_queue_mib(setting: int, gpu: bool) -> int:
    """The save queue's MiB: ``store_save_queue_mib``, or when auto (-1) 256 on a GPU (the
    step would wait on the store's round trips) and 0 on a CPU (the writer would share the
    engine's core)."""
    if setting >= 0:
        return setting
    return GPU_SAVE_QUEUE_MIB if gpu else 0


def load_async(setting: str, gpu: bool) -> bool:
    """Whether the connector loads off the step: ``store_load_async`` on / off, auto = on a
    GPU (a load there waits on the network while the batch could step)."""
    return setting == "on" or (setting == "auto" and gpu)


def engine_kwargs(cfg: EngineConfig, gpu: bool) -> dict[str, Any]:
    """``AsyncEngineArgs`` keywords of the serving profile (the module docstring) for a GPU
    (``gpu``) or a CPU, with ``cfg``'s explicit settings; the store's own (model, dtype,
    block size, connector) are the caller's."""
    tpot = cfg.tpot_target_ms
    if tpot < 0:  # auto
        tpot = GPU_TPOT_TARGET_MS if gpu else CPU_TPOT_TARGET_MS
    order = cfg.prefill_order
    if order == "auto":
        order = GPU_PREFILL_ORDER if gpu else CPU_PREFILL_ORDER
    out: dict[str, Any] = {
        "enable_prefix_caching": True,
        "scheduler_cls": SCHEDULER_CLASS,
        "additional_config": {
            TPOT_TARGET_KEY: tpot,
            TTFT_URGENT_KEY: cfg.ttft_urgent_ms,
            PREFILL_ORDER_KEY: order,
            TTFT_TARGET_KEY: cfg.ttft_target_ms,
        },
    }
    if gpu:  # vLLM's own where the setting is auto (None: vLLM decides)
        out["max_num_seqs"] = cfg.max_num_seqs or None
        out["max_num_batched_tokens"] = cfg.max_num_batched_tokens or None
    else:
        out["enforce_eager"] = True
        out["max_num_seqs"] = cfg.resolved_max_num_seqs()
        out["max_num_batched_tokens"] = cfg.max_num_batched_tokens or VLLM_STEP_TOKENS
    for name in out.keys() & cfg.vllm_args.keys():  # the user's vllm_args win
        out.pop(name)
    return out
