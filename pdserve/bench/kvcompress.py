"""KV chunk compression (``kv_compression``): bytes moved, first-token time and output drift,
side by side in one run.

``pdserve bench kvcompress [--engine vllm|torch] [--model smollm2] [--kv-dtype auto]``

For each encoding (``none``, ``bf16``, ``fp8``; ``bf16`` of bfloat16 KV is ``none`` and is
reported as such, not run twice), on a fresh KV store (master + one node):

1. writer: a fresh engine process computes a long random prompt cold (its first-token time
   is the cold figure) and the drift prompts, storing their chunks in that encoding;
2. the chunk bytes: one full chunk of the long prompt read back from the store (and all of
   them, summed);
3. reader: a fresh engine process (its local prefix cache empty, and reset before each
   request) asks for the first token of the long prompt, whose chunks it loads from the store
   (best of ``--repeats``), then greedily generates ``--max-tokens`` tokens for each drift
   prompt, loading its stored chunks: the numerics of the encoding.

Drift prompts are real text: the first 1,000 characters of the docstrings of 50 standard
library modules (read from their sources, so they depend only on the Python version), each
asking the model to summarize it, in the model's chat template (about 270-330 tokens). Drift
is measured against the ``none`` run's outputs: the fraction of tokens before each prompt's
first divergence (over all prompts' tokens) and the rate of prompts whose outputs are
identical.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.bench.enginephase import run_phase, worker_main

MODULE = "pdserve.bench.kvcompress"

ENCODINGS = ("none", "bf16", "fp8")
#: Standard-library modules whose docstrings are the drift prompts (the first that have one
#: of at least 800 characters in their source are taken).
DOC_MODULES = [
    "aifc",
    "argparse",
    "ast",
    "asynchat",
    "asyncore",
    "cgitb",
    "chunk",
    "cmd",
    "codeop",
    "collections",
    "configparser",
    "copy",
    "csv",
    "dbm",
    "difflib",
    "doctest",
    "encodings",
    "fileinput",
    "ftplib",
    "hashlib",
    "heapq",
    "inspect",
    "io",
    "json",
    "nntplib",
    "os",
    "pdb",
    "pipes",
    "plistlib",
    "pyclbr",
    "pydoc",
    "random",
    "re",
    "rlcompleter",
    "sched",
    "shelve",
    "site",
    "smtpd",
    "smtplib",
    "sndhdr",
    "socket",
    "socketserver",
    "sqlite3",
    "ssl",
    "statistics",
    "subprocess",
    "sunau",
    "telnetlib",
    "tempfile",
    "timeit",
    "tokenize",
    "typing",
    "unittest",
    "uuid",
    "wave",
    "zipfile",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine", default="vllm", choices=["vllm", "torch"], help="engine (default: vllm)"
    )
    parser.add_argument(
        "--model", default="smollm2", help="prepared model name or folder (default: smollm2)"
    )
    parser.add_argument(
        "--kv-dtype",
        default="auto",
        help="the engine's KV dtype (default: auto = on vllm bfloat16, or float32 on CPUs "
        "without native bfloat16; float32 on torch)",
    )
    parser.add_argument(
        "--encodings",
        default=",".join(ENCODINGS),
        help="encodings to compare, the first is the drift reference (default: none,bf16,fp8)",
    )
    parser.add_argument(
        "--prompts", type=int, default=50, help="drift prompts (at most 50; default: 50)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="greedy tokens per drift prompt (default: 32)"
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=2048,
        help="length of the first-token-time prompt (default: 2048)",
    )
    parser.add_argument(
        "--chunk-size", type=int, default=32, help="KV chunk size in tokens (default: 32)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed cached requests, best reported (default: 3)"
    )
    parser.add_argument(
        "--vllm-fp8-cache",
        action="store_true",
        help="also measure the drift of vLLM's own fp8 KV cache (kv_cache_dtype=fp8, no store: "
        "every prompt computed), the reference for what an fp8 KV costs in output",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")


def drift_texts(n: int) -> list[str]:
    """The first 1,000 characters (whole lines) of the docstrings of ``n`` stdlib modules."""
    out: list[str] = []
    for name in DOC_MODULES:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if not origin or not origin.endswith(".py"):
            continue
        doc = ast.get_docstring(ast.parse(Path(origin).read_text(encoding="utf-8"))) or ""
        if len(doc) < 800:
            continue
        cut = doc[:1000]
        out.append(cut[: cut.rfind("\n")] if "\n" in cut else cut)
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} standard-library docstrings found, asked for {n}")


# ------------------------------------------------------------------ engine process


async def _engine_phase(spec: dict[str, Any]) -> dict[str, Any]:
    from pdserve.engines import create_engine
    from pdserve.engines.config import EngineConfig
    from pdserve.requests import Sampling

    engine = create_engine(EngineConfig(**spec["config"]))
    await engine.start()
    llm = getattr(engine, "_llm", None)  # vLLM: its local prefix cache is reset before each

    async def reset() -> None:
        if llm is not None:
            await llm.reset_prefix_cache()

    try:
        one = Sampling(max_tokens=1, temperature=0.0, ignore_eos=True)
        await engine.prefill("warmup", spec["warmup"], one)
        out: dict[str, Any] = {}
        if spec["role"] == "write":
            await reset()
            t0 = time.perf_counter()
            await engine.prefill("long", spec["long"], one)
            out["cold_ms"] = (time.perf_counter() - t0) * 1e3
            for i, prompt in enumerate(spec["prompts"]):
                await engine.prefill(f"w{i}", prompt, one)
            return out
        if spec["role"] == "read":
            out.update(ttft_ms=[], cached_tokens=[])
            for i in range(spec["repeats"]):
                await reset()
                t0 = time.perf_counter()
                res = await engine.prefill(f"long-{i}", spec["long"], one)
                out["ttft_ms"].append((time.perf_counter() - t0) * 1e3)
                out["cached_tokens"].append(res.cached_tokens)
        greedy = Sampling(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
        outputs, loaded = [], []
        for i, prompt in enumerate(spec["prompts"]):
            await reset()
            tokens: list[int] = []
            first_loaded = -1
            async for ev in engine.generate(f"r{i}", prompt, greedy):
                tokens.extend(ev.token_ids)
                if first_loaded < 0:
                    first_loaded = ev.loaded_tokens
                if ev.finish is not None:
                    first_loaded = max(first_loaded, ev.loaded_tokens)
            outputs.append(tokens)
            loaded.append(first_loaded)
        return {**out, "outputs": outputs, "loaded": loaded}
    finally:
        await engine.close()


# ------------------------------------------------------------------ the run


def _stored_bytes(master: str, fp: Any, tokens: list[int]) -> tuple[int, int, str]:
    """(bytes of the first chunk, bytes of all full chunks, encoding in their header) of
    ``tokens`` as stored under ``fp``."""
    from pdserve import hashing, kvformat
    from pdserve.store import open_store

    keys = hashing.chunk_keys(fp, tokens)
    with open_store(master) as client:
        blobs = client.batch_get(keys)
    if not blobs or any(b is None for b in blobs):
        raise SystemExit(f"the writer did not store every chunk ({fp.kv_compression})")
    assert blobs[0] is not None
    return (
        len(blobs[0]),
        sum(len(b or b"") for b in blobs),
        kvformat.parse_header(blobs[0]).encoding,
    )


def _agreement(out: list[int], ref: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), len(ref))


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.serve.workloads import TOKEN_LOW
    from pdserve.engines.config import EngineConfig
    from pdserve.model.fingerprint import model_fingerprint
    from pdserve.model.prepare import resolve_model
    from pdserve.procs import local_store
    from pdserve.services.router.tokenizer import Tokenizer

    encodings = [e for e in args.encodings.split(",") if e]
    if not encodings or any(e not in ENCODINGS for e in encodings):
        raise SystemExit(f"--encodings: a comma-separated subset of {ENCODINGS}")
    model_dir = resolve_model(args.model)
    tok = Tokenizer(model_dir)
    question = "Summarize this Python module documentation in a few sentences.\n\n"
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": question + text}])
        for text in drift_texts(args.prompts)
    ]
    rng = random.Random(7)
    long = [rng.randrange(TOKEN_LOW, tok.vocab_size) for _ in range(args.prompt_tokens)]
    warmup = [rng.randrange(TOKEN_LOW, tok.vocab_size) for _ in range(64)]
    base = EngineConfig(engine=args.engine, model=args.model, kv_dtype=args.kv_dtype)
    kv_dtype = base.resolved_kv_dtype()
    longest = max(len(p) for p in prompts) + args.max_tokens
    config = {
        "engine": args.engine,
        "model": args.model,
        "kv_dtype": args.kv_dtype,
        "chunk_size": args.chunk_size,
        "max_model_len": max(args.prompt_tokens, longest) + 64,
        "max_num_seqs": 4,
    }
    if args.engine == "vllm":
        config.update(vllm_block_size=32, vllm_cpu_cores="0")
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-kvcompress-"))
    results: dict[str, dict[str, Any]] = {}
    for enc in encodings:
        stored = EngineConfig(**{**config, "kv_compression": enc}).resolved_kv_compression()
        if stored in results:  # bf16 of bfloat16 KV: the same bytes as none
            results[enc] = {**results[stored], "stored_as": stored}
            continue
        cfg = {**config, "kv_compression": enc}
        common = {"long": long, "warmup": warmup, "prompts": prompts}
        with local_store(tmp / f"logs-{enc}", segment_size="2GiB") as (master, _node):
            cfg["store_master"] = master.info["grpc"]
            write = run_phase(
                MODULE, tmp, f"{enc}-write", {**common, "role": "write", "config": cfg}
            )
            fp = model_fingerprint(model_dir, args.model, kv_dtype, args.chunk_size, stored)
            chunk_bytes, long_bytes, header_enc = _stored_bytes(cfg["store_master"], fp, long)
            read = run_phase(
                MODULE,
                tmp,
                f"{enc}-read",
                {**common, "role": "read", "config": cfg, "repeats": args.repeats,
                 "max_tokens": args.max_tokens},
            )  # fmt: skip
        results[enc] = {
            "stored_as": stored,
            "header_encoding": header_enc,
            "chunk_bytes": chunk_bytes,
            "long_prompt_bytes": long_bytes,
            "cold_ms": write["cold_ms"],
            **read,
        }
    if args.vllm_fp8_cache:
        if args.engine != "vllm":
            raise SystemExit("--vllm-fp8-cache needs --engine vllm")
        spec = {"role": "generate", "warmup": warmup, "prompts": prompts,
                "max_tokens": args.max_tokens,
                "config": {**config, "vllm_args": {"kv_cache_dtype": "fp8"}}}  # fmt: skip
        results["vllm-fp8-cache"] = run_phase(MODULE, tmp, "vllm-fp8-cache", spec)
    _report(args, kv_dtype, prompts, encodings, results)
    if args.json:
        flags = {k: v for k, v in vars(args).items() if k != "func"}
        Path(args.json).write_text(json.dumps({"args": flags, "results": results}, indent=1))
    return 0


def _report(
    args: argparse.Namespace,
    kv_dtype: str,
    prompts: list[list[int]],
    encodings: list[str],
    results: dict[str, dict[str, Any]],
) -> None:
    ref = results[encodings[0]]

    def drift(r: dict[str, Any]) -> str:
        total = agree = exact = 0
        for out, want in zip(r["outputs"], ref["outputs"], strict=True):
            k = _agreement(out, want)
            total, agree, exact = total + len(want), agree + k, exact + (k == len(want))
        r["agreement"], r["exact_match"] = agree / total, exact / len(prompts)
        return f"{r['agreement']:>7.1%} {r['exact_match']:>7.1%}"

    lengths = sorted(len(p) for p in prompts)
    print(
        f"{args.engine} engine, {args.model}, KV {kv_dtype}, chunk {args.chunk_size} tokens; "
        f"first-token prompt {args.prompt_tokens} tokens (fresh engine, best of {args.repeats}); "
        f"drift: {len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens, "
        f"{args.max_tokens} greedy tokens each, against {encodings[0]}"
    )
    head = (
        f"{'encoding':<9} {'stored as':<10} {'bytes/chunk':>12} {'ratio':>6} "
        f"{'cold TTFT':>10} {'cached TTFT':>12} {'loaded':>7} {'agree':>7} {'exact':>7}"
    )
    print(head)
    for enc in encodings:
        r = results[enc]
        loaded = sum(r["loaded"]) / sum(len(p) for p in prompts)
        print(
            f"{enc:<9} {r['stored_as']:<10} {r['chunk_bytes']:>12,} "
            f"{r['chunk_bytes'] / ref['chunk_bytes']:>6.3f} {r['cold_ms']:>8.0f}ms "
            f"{min(r['ttft_ms']):>10.0f}ms {loaded:>7.1%} {drift(r)}"
        )
    if "vllm-fp8-cache" in results:
        print(
            f"{'vLLM fp8 KV cache (no store, kv_cache_dtype=fp8)':<72} "
            f"{drift(results['vllm-fp8-cache'])}"
        )
    print(
        "bytes/chunk: one full chunk as stored (128-byte header included); loaded: prompt "
        "tokens the reader loaded from the store; agree: tokens before each prompt's first "
        "divergence from the reference, over all its tokens; exact: prompts with identical output"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(_engine_phase, argv[1], argv[2])
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.kvcompress", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
