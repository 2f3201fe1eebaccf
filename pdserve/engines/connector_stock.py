"""The pdserve KV connector in a stock ``vllm serve``: its settings from the one flag users
change, ``--kv-transfer-config`` (docs/vllm-connector.md)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PdserveConnector",
      "kv_connector_module_path": "pdserve.engines.vllm_connector", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"master_address": "10.0.0.5:50051"}}'

``kv_connector_extra_config`` names the store (and optionally the chunk size, transport,
replicas, timeouts, chunk encoding, TLS files); everything else is vLLM's own config: the model
and its served name, the KV dtype, the block size, the tensor-parallel size. Keys are strict: a
missing or unknown one stops the engine at start, named. Engines that derive the same
fingerprint (the same model bytes and served name, KV dtype, chunk size, TP size and KV
options: :mod:`pdserve.model.kv_options`) share chunks, a pdserve worker's included. A Hugging
Face id is read from the local Hugging Face cache (:func:`pdserve.model.fingerprint.model_source`);
pipeline parallelism is refused.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from pdserve import hashing
from pdserve.config_fields import auto_on_off
from pdserve.engines.connector_data import ConnectorSettings
from pdserve.engines.vllm_profile import load_async, on_gpu, save_queue_mib
from pdserve.errors import did_you_mean
from pdserve.model.fingerprint import model_fingerprint, model_source
from pdserve.model.kv_options import refuse_pipeline_parallel, vllm_config_options

#: The keys of ``kv_connector_extra_config`` in a stock engine: name -> what it is.
STOCK_KEYS = {
    "master_address": "HOST:PORT of the pdserve KV store master (of every master, "
    "comma-separated, in an HA setup; required)",
    "chunk_size": "tokens per stored chunk, a multiple of vLLM's block size (default: the "
    "block size)",
    "transport": "data plane: auto (shm on the same host, else tcp), shm, tcp (default auto)",
    "replicas": "replicas per chunk (default 1)",
    "timeout_s": "seconds one store operation may take (default 5)",
    "tail_ttl_ms": "lifetime of a prompt's last partial chunk (default 30000)",
    "save_queue_mib": "MiB of chunk saves written off the engine step, by a background thread "
    "(saves a P/D decode awaits are always written in the step; 0 = all in it; default -1, "
    "auto: 256 on a GPU, 0 on a CPU)",
    "load_async": "load stored chunks off the engine step, the request parked in "
    "WAITING_FOR_REMOTE_KVS meanwhile: on, off, auto (default auto: on on a GPU)",
    "kv_compression": "chunk encoding: none, bf16, fp8 (default none)",
    "tls_ca": "CA file of the store's mutual TLS (default: $PDSERVE_TLS_CA; none = plaintext)",
    "tls_cert": "this engine's certificate (default: $PDSERVE_TLS_CERT)",
    "tls_key": "its key (default: $PDSERVE_TLS_KEY)",
}
_WHAT = "kv_connector_extra_config"


def settings_from_vllm(vllm_config: Any) -> ConnectorSettings:
    """The settings of the engine ``vllm_config`` describes: a pdserve worker's
    (:func:`pdserve.engines.connector_data.extra_config` wrote them) or a stock ``vllm serve``'s
    (:func:`stock_settings`: the store's address in ``kv_connector_extra_config``, the rest
    derived from vLLM's config); ValueError names a wrong key or ``kv_role``."""
    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {})
    role = ktc.kv_role or "kv_both"
    if role not in ("kv_both", "kv_producer", "kv_consumer"):
        raise ValueError(f"kv_role {role!r}: the pdserve connector takes kv_both, "
                         "kv_producer or kv_consumer")  # fmt: skip
    if "fingerprint" in extra:
        return replace(ConnectorSettings.from_extra(extra), kv_role=role)
    return replace(stock_settings(extra, vllm_config), kv_role=role)


def stock_settings(extra: dict[str, Any], vllm_config: Any) -> ConnectorSettings:
    """:class:`ConnectorSettings` of a stock engine: ``extra`` checked (ValueError naming the
    key), the fingerprint derived from ``vllm_config``."""
    for key in extra:
        if key not in STOCK_KEYS:
            raise ValueError(
                f"{_WHAT}: unknown key {key!r}{did_you_mean(key, STOCK_KEYS)}; the pdserve "
                "connector takes " + "; ".join(f"{k}: {v}" for k, v in STOCK_KEYS.items())
            )
    master = str(extra.get("master_address") or "")
    if not master or ":" not in master:
        raise ValueError(
            f"{_WHAT}.master_address is required: {STOCK_KEYS['master_address']} (got {master!r})"
        )
    block_size = int(vllm_config.cache_config.block_size)
    chunk_size = _int(extra, "chunk_size", block_size)
    if chunk_size <= 0 or chunk_size % block_size:
        raise ValueError(
            f"{_WHAT}.chunk_size {chunk_size} must be a positive multiple of vLLM's block size "
            f"{block_size} (--block-size)"
        )
    parallel = vllm_config.parallel_config
    refuse_pipeline_parallel(
        getattr(parallel, "pipeline_parallel_size", 1), "--pipeline-parallel-size"
    )
    model_config = vllm_config.model_config
    model_dir = model_source(str(model_config.model), getattr(model_config, "revision", None))
    fingerprint = model_fingerprint(
        model_dir,
        _served_name(model_config),
        _kv_dtype(vllm_config),
        chunk_size,
        str(extra.get("kv_compression", "none")),
        tp_size=int(parallel.tensor_parallel_size),
        options=vllm_config_options(vllm_config, model_dir),
    )
    gpu = on_gpu()  # auto settings: off the step on a GPU
    tls = tuple(
        str(extra.get(f"tls_{part}") or os.environ.get(f"PDSERVE_TLS_{part.upper()}", ""))
        for part in ("ca", "cert", "key")
    )
    return ConnectorSettings(
        master_address=master,
        fingerprint=fingerprint,
        tail_ttl_ms=_int(extra, "tail_ttl_ms", 30_000),
        transport=str(extra.get("transport", "auto")),
        replicas=_int(extra, "replicas", 1),
        timeout_s=float(extra.get("timeout_s", 5.0)),
        tls_paths=(tls[0], tls[1], tls[2]),
        save_queue_mib=save_queue_mib(_int(extra, "save_queue_mib", -1, low=-1), gpu),
        load_async=load_async(
            auto_on_off(f"{_WHAT}.load_async", extra.get("load_async", "auto"), "on a GPU"), gpu
        ),
    )


def _int(extra: dict[str, Any], key: str, default: int, low: int | None = None) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{_WHAT}.{key} must be an integer, got {value!r}")
    try:
        out = int(value)
    except ValueError:
        raise ValueError(f"{_WHAT}.{key} must be an integer, got {value!r}") from None
    if low is not None and out < low:
        raise ValueError(f"{_WHAT}.{key} must be >= {low}, got {out}")
    return out


def _served_name(model_config: Any) -> str:
    """The name the engine serves (vLLM's ``--served-model-name``, first one; else the model)."""
    name = getattr(model_config, "served_model_name", None) or model_config.model
    return str(name[0] if isinstance(name, list | tuple) else name)


def _kv_dtype(vllm_config: Any) -> str:
    """The KV cache's dtype name: vLLM's ``--kv-cache-dtype``, or the model's (``auto``)."""
    dtype = str(vllm_config.cache_config.cache_dtype)
    if dtype == "auto":
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    if dtype not in hashing.KV_DTYPES:
        raise ValueError(
            f"the KV cache dtype {dtype!r} (--kv-cache-dtype, or --dtype): the pdserve "
            f"connector stores {', '.join(hashing.KV_DTYPES)}"
        )
    return dtype
