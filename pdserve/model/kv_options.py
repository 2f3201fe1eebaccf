"""Runtime options that change a model's KV, as the fingerprint's ``options`` field.

The same weights give other KV for the same tokens when vLLM quantizes them at load
(``quantization``), overrides their config (``hf_overrides``: rope scaling, ...), loads random
weights (``load_format: dummy``), attends without the sliding window
(``disable_sliding_window``) or stores the cache in another dtype (``kv_cache_dtype`` and its
``kv_cache_dtype_skip_layers``). Each of these, when set to something else than vLLM's default,
enters :attr:`pdserve.hashing.ModelFingerprint.options` as ``name=value``; the pairs are sorted
by name and joined by ``;``. Scalars read as JSON (``quantization="fp8"``,
``disable_sliding_window=true``); dicts, lists and values over 40 characters as ``b3:`` and 32
hex digits of a BLAKE3 over their canonical JSON (keys sorted), so the string stays short
enough for a registration label (256 bytes).

A separate field, rather than a part of the revision, because the revision belongs to the
model folder (the router computes it from its own copy) while options belong to each engine:
the router takes them from what the workers registered, as it takes the TP size.

A checkpoint's own quantization (a ``quantization_config`` in its ``config.json``) is already
in the revision, and vLLM names the method it picked for it in its config (``gptq_marlin`` for
``gptq``): ``quantization`` counts only for a model without one, so a pdserve engine and a
stock ``vllm serve`` of the same folder agree.

Pipeline parallelism is refused (:func:`refuse_pipeline_parallel`): each stage holds only its
own layers' KV, and stages have no keys of their own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import blake3

#: The options that change the KV -> whether a value is vLLM's default (then it is left out).
KV_OPTIONS: dict[str, Callable[[Any], bool]] = {
    "quantization": lambda v: v is None,
    "hf_overrides": lambda v: not v,
    "kv_cache_dtype": lambda v: v in (None, "auto"),
    "kv_cache_dtype_skip_layers": lambda v: not v,
    "load_format": lambda v: v != "dummy",
    "disable_sliding_window": lambda v: not v,
}


#: Longest value (JSON characters) written as it is; longer ones are hashed.
_LONGEST_PLAIN = 40


def _value(name: str, value: Any) -> str:
    if callable(value):
        raise ValueError(
            f"{name} is a function: its effect on the KV cannot be fingerprinted; give it as a "
            "dict (JSON) to use the KV store"
        )
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    except TypeError:
        raise ValueError(f"{name} {value!r} is not JSON: it cannot be fingerprinted") from None
    if isinstance(value, dict | list | tuple) or len(text) > _LONGEST_PLAIN:
        return "b3:" + blake3.blake3(text.encode()).hexdigest()[:32]
    return text


def _checkpoint_quantized(model_dir: str | Path) -> bool:
    config = Path(model_dir) / "config.json"
    try:
        return "quantization_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def kv_options(values: Mapping[str, Any], model_dir: str | Path) -> str:
    """The canonical options string of engine settings ``values`` (``AsyncEngineArgs`` names;
    others are ignored) for the model in ``model_dir``: ``""`` when every one is at its
    default. Raises ValueError for a value that cannot be fingerprinted (a function)."""
    pairs = []
    for name, is_default in KV_OPTIONS.items():
        value = values.get(name)
        if is_default(value):
            continue
        if name == "quantization" and _checkpoint_quantized(model_dir):
            continue
        pairs.append(f"{name}={_value(name, value)}")
    return ";".join(sorted(pairs))


def vllm_config_options(vllm_config: Any, model_dir: str | Path) -> str:
    """:func:`kv_options` of a running vLLM's ``VllmConfig`` (the stock connector's view)."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    load = getattr(vllm_config, "load_config", None)
    values = {
        "quantization": getattr(model, "quantization", None),
        "hf_overrides": getattr(model, "hf_overrides", None),
        "kv_cache_dtype": getattr(cache, "cache_dtype", None),
        "kv_cache_dtype_skip_layers": getattr(cache, "kv_cache_dtype_skip_layers", None),
        "load_format": str(getattr(load, "load_format", "auto")),
        "disable_sliding_window": getattr(model, "disable_sliding_window", False),
    }
    return kv_options(values, model_dir)


def refuse_pipeline_parallel(size: int, where: str) -> None:
    """Raises ValueError when ``size`` (``pipeline_parallel_size``, as ``where`` names it) is
    above 1: a stage holds only its own layers' KV, and the store keys whole-model chunks."""
    if int(size) > 1:
        raise ValueError(
            f"{where} {size}: pipeline parallelism cannot use the KV store (each stage holds "
            "only its own layers' KV, and chunks are keyed for the whole model); use "
            "tensor_parallel_size, or run without the store"
        )
