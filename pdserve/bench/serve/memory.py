"""The engines' KV cache of both systems (``--engine-kv-cache-gib``, ``--engine-kv-blocks``):
memory shaped like a GPU server's.

On a GPU server each engine's own KV cache (HBM) is small next to the host's DRAM and disk,
where a pool lives. These flags give every engine of both systems the same small cache: the
baseline's ``vllm serve`` engines (``VLLM_CPU_KVCACHE_SPACE``, ``--num-gpu-blocks-override``)
and the vLLM workers of the ``pdserve up`` the benchmark starts (``vllm_kv_cache_gib`` and
``vllm_args.num_gpu_blocks_override`` of the prefill and decode sections, through
``PDSERVE_PREFILL_*`` / ``PDSERVE_DECODE_*`` in its environment), while pdserve's pool (its
storage nodes' memory and disk tier) stays as shipped. Without them each system runs as
shipped: the baseline's engines 2 GiB each (``--baseline-kv-cache-gib``), pdserve's workers
their ``vllm_kv_cache_gib`` (2 GiB). vLLM on CPU takes whole GiB.

Imports only the standard library (the command line is built from it)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

#: The config sections of pdserve's workers.
WORKER_SECTIONS = ("PREFILL", "DECODE")
#: The baseline's engine cache when nothing says otherwise (GiB).
BASELINE_DEFAULT_GIB = 2.0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def add_memory_arguments(group: argparse._ArgumentGroup) -> None:
    """The flags that size every engine's own KV cache, both systems alike."""
    group.add_argument(
        "--engine-kv-cache-gib",
        type=_positive_int,
        metavar="GIB",
        help="GPU-shaped memory: each engine's own KV cache in whole GiB, the same for both "
        "systems: the baseline's engines (VLLM_CPU_KVCACHE_SPACE, unless "
        "--baseline-kv-cache-gib) and the vLLM workers of --start-pdserve's pdserve up "
        "(vllm_kv_cache_gib); pdserve's pool stays as shipped (default: each system as "
        "shipped, 2 GiB per engine)",
    )
    group.add_argument(
        "--engine-kv-blocks",
        type=_positive_int,
        metavar="N",
        help="GPU-shaped memory in blocks: each engine's own KV cache holds N vLLM blocks "
        "(32 tokens with the default flags), both systems: --num-gpu-blocks-override N on the "
        "baseline, vllm_args {num_gpu_blocks_override: N} on pdserve's workers (replacing "
        "vllm_args of a --config file) (default: none)",
    )


def resolve_memory(args: argparse.Namespace) -> None:
    """Settles ``args.baseline_kv_cache_gib`` (``--engine-kv-cache-gib``, else 2) and adds
    ``--engine-kv-blocks`` to the baseline's flags."""
    gib = getattr(args, "engine_kv_cache_gib", None)
    if getattr(args, "baseline_kv_cache_gib", None) is None:
        args.baseline_kv_cache_gib = float(gib) if gib else BASELINE_DEFAULT_GIB
    blocks = getattr(args, "engine_kv_blocks", None)
    if blocks and "--num-gpu-blocks-override" not in args.baseline_args:
        args.baseline_args = f"{args.baseline_args} --num-gpu-blocks-override {blocks}"


def pdserve_env(args: argparse.Namespace, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment additions for the ``pdserve up`` the benchmark starts: the workers'
    engine cache of ``--engine-kv-cache-gib`` / ``--engine-kv-blocks`` (a ``vllm_args``
    already in ``environ`` is kept, the override added)."""
    environ = dict(os.environ) if environ is None else environ
    env: dict[str, str] = {}
    gib = getattr(args, "engine_kv_cache_gib", None)
    blocks = getattr(args, "engine_kv_blocks", None)
    for section in WORKER_SECTIONS:
        if gib:
            env[f"PDSERVE_{section}_VLLM_KV_CACHE_GIB"] = str(gib)
        if blocks:
            name = f"PDSERVE_{section}_VLLM_ARGS"
            try:
                extra = json.loads(environ.get(name) or "{}")
            except ValueError:
                extra = {}
            extra = extra if isinstance(extra, dict) else {}
            env[name] = json.dumps({**extra, "num_gpu_blocks_override": blocks})
    return env


def memory_shape(args: argparse.Namespace) -> dict[str, Any]:
    """What the run's memory looks like, for the report and the JSON."""
    gib = getattr(args, "engine_kv_cache_gib", None)
    blocks = getattr(args, "engine_kv_blocks", None)
    shaped = bool(gib or blocks)
    return {
        "shape": "gpu-shaped" if shaped else "as shipped",
        "engine_kv_cache_gib": gib,
        "engine_kv_blocks": blocks,
        "baseline_kv_cache_gib": getattr(args, "baseline_kv_cache_gib", None),
        "pdserve_pool": "as shipped (pdserve up's segment_size and disk_size, unless "
        "--start-pdserve ARGS set them)",
    }


def describe_shape(args: argparse.Namespace) -> str:
    """One line: the memory shape of the run."""
    shape = memory_shape(args)
    if shape["shape"] == "as shipped":
        return (
            "memory as shipped: baseline engines "
            f"{shape['baseline_kv_cache_gib']:g} GiB KV cache each, pdserve's workers their "
            "vllm_kv_cache_gib, pdserve's pool as shipped"
        )
    size = " and ".join(
        x
        for x in (
            f"{shape['engine_kv_cache_gib']} GiB" if shape["engine_kv_cache_gib"] else "",
            f"{shape['engine_kv_blocks']} blocks" if shape["engine_kv_blocks"] else "",
        )
        if x
    )
    text = (
        f"memory GPU-shaped: every engine's own KV cache {size} (both systems; baseline "
        f"VLLM_CPU_KVCACHE_SPACE {shape['baseline_kv_cache_gib']:g}), pdserve's pool as shipped"
    )
    if getattr(args, "start_pdserve", None) is None:
        text += "; note: --target's engines stay as they were started (use --start-pdserve)"
    return text
