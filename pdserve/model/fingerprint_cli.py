"""``pdserve model fingerprint``: a model's KV fingerprint and everything that went into it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pdserve.hashing import KV_COMPRESSIONS, KV_DTYPES, ModelFingerprint

DESCRIPTION = """\
Print the KV fingerprint a worker serving MODEL derives: the digest (hex) that roots every
chunk key in the store, and what went into it. Workers share KV chunks exactly when their
digests are equal. The model revision covers config.json (canonicalised), the bytes of every
weight file (.safetensors, .bin, .gguf, .pt, .pth; BLAKE3, cached beside the model in
.pdserve-fingerprint.json, so only the first run reads them) and, for a Hugging Face cache
snapshot, its commit; tokenizer and generation files do not change the KV of given token ids
and are left out. The other fields are the served name, KV dtype, chunk size, chunk
encoding, tensor-parallel size and the runtime options that change the KV (vLLM's
quantization, hf_overrides, kv_cache_dtype, kv_cache_dtype_skip_layers, load_format dummy,
disable_sliding_window). Give the same values the worker runs with (its engine config, or a
stock vLLM's flags); defaults are pdserve's."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers ``pdserve model fingerprint`` under ``pdserve model``'s subcommands."""
    p = sub.add_parser(
        "fingerprint",
        help="print a model's KV fingerprint and what went into it",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="model folder, named model (smollm2, tiny) or Hugging Face id (from the local "
        "Hugging Face cache; never downloaded)",
    )
    p.add_argument("--revision", default=None, help="Hugging Face branch, tag or commit")
    p.add_argument(
        "--served-name", default="", help="the name workers serve it as (default: MODEL)"
    )
    p.add_argument(
        "--kv-dtype",
        default="float32",
        choices=KV_DTYPES,
        help="the KV dtype workers store (default float32)",
    )
    p.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk (default 256)")
    p.add_argument(
        "--kv-compression",
        default="none",
        choices=KV_COMPRESSIONS,
        help="the chunk encoding (default none)",
    )
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="a vLLM engine argument the worker sets (as in vllm_args), the value as JSON: "
        "quantization='\"fp8\"', hf_overrides='{\"rope_scaling\": ...}'; repeatable",
    )
    p.add_argument("--cache-dir", type=Path, default=None, help="pdserve's cache folder")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_fingerprint)


def _vllm_args(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--vllm-arg {pair!r}: expected NAME=JSON")
        try:
            out[name] = json.loads(value)
        except ValueError:
            raise ValueError(f"--vllm-arg {name}: {value!r} is not JSON (quote strings)") from None
    return out


def _folder(args: argparse.Namespace) -> Path:
    from pdserve.model.fingerprint import model_source
    from pdserve.model.prepare import known_model_dir

    if args.revision:
        return model_source(args.model, args.revision)
    return known_model_dir(args.model, args.cache_dir)


def _fingerprint(args: argparse.Namespace) -> int:
    from pdserve.model.fingerprint import describe_revision
    from pdserve.model.kv_options import kv_options

    try:
        folder = _folder(args)
        described = describe_revision(folder)
        fp = ModelFingerprint(
            model_id=args.served_name or args.model,
            revision=described.revision,
            kv_dtype=args.kv_dtype,
            chunk_size=args.chunk_size,
            kv_compression=args.kv_compression,
            tp_size=args.tp_size,
            options=kv_options(_vllm_args(args.vllm_arg), folder),
        )
    except (ValueError, OSError) as exc:
        print(f"pdserve model fingerprint: {exc}", file=sys.stderr)
        return 2
    report = {
        "fingerprint": fp.digest().hex(),
        "folder": str(folder),
        "served_name": fp.model_id,
        "revision": fp.revision,
        "config_blake3": described.config,
        "weights": {name: digest for name, digest in described.weights},
        "hub_commit": described.hub_commit,
        "kv_dtype": fp.kv_dtype,
        "chunk_size": fp.chunk_size,
        "kv_compression": fp.kv_compression,
        "tp_size": fp.tp_size,
        "kv_layout": fp.layout_version,
        "options": fp.options,
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    width = max(len(k) for k in report)
    for key, value in report.items():
        if key == "weights":
            for name, digest in described.weights:
                print(f"{'weight':<{width}}  {digest}  {name}")
            continue
        print(f"{key:<{width}}  {value if value != '' else '-'}")
    return 0
