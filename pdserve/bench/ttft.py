"""First-token time of the vLLM engine, cold versus fully cached in the KV store, in one run.

``pdserve bench ttft [--model smollm2] [--prompt-tokens 2048] [--chunk-size 32] [--transport tcp]``

Starts a KV store (master + one node), then two vLLM engine processes one after the other,
each with a fresh vLLM (so its local prefix cache is empty: any speedup comes from the store):

1. cold: first-token time of a random prompt nobody has seen (the engine computes it all and
   writes its chunks to the store);
2. cached: a new engine process asks for the first token of the same prompt; the connector
   loads the stored chunks from the store up to ``prompt - 1`` tokens (the last prompt token
   is always computed: a chunk-multiple prompt computes one token, any other its partial tail).

Each engine first serves an unrelated warm-up prompt; vLLM's local prefix cache is reset
before every timed request. Last, the cached engine repeats the prompt with its local prefix
cache kept: vLLM's own local-cache repeat, the figure users compare a store hit against.
Prints the three times, the ratios and the loaded/computed tokens.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.bench.enginephase import run_phase, worker_main

MODULE = "pdserve.bench.ttft"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2", help="prepared model name or folder (default: smollm2)"
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=2048, help="prompt length in tokens (default: 2048)"
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=32,
        help="KV chunk size in tokens, a multiple of 32 (default: 32, the system default)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed cached requests, best reported (default: 3)"
    )
    parser.add_argument(
        "--kv-cache-gib", type=float, default=2.0, help="vLLM KV cache in GiB (default: 2)"
    )
    parser.add_argument(
        "--transport",
        choices=["auto", "shm", "tcp"],
        default="auto",
        help="how the engines reach the store's data: auto (shm when the node is on this "
        "host, as here), shm, or tcp (as a worker on another host would) (default: auto)",
    )


async def _engine_phase(spec: dict[str, Any]) -> dict[str, Any]:
    from pdserve.engines.config import EngineConfig
    from pdserve.engines.vllm_engine import VllmEngine
    from pdserve.requests import Sampling

    engine = VllmEngine(EngineConfig(engine="vllm", **spec["config"]))
    await engine.start()
    try:
        one = Sampling(max_tokens=1, temperature=0.0, ignore_eos=True)
        await engine.prefill("warmup", spec["warmup"], one)
        times, cached, computed = [], [], []
        for i in range(spec["repeats"]):
            # the vLLM local prefix cache would serve repeats: reset it so every timed request
            # goes through the store (or computes) like the first one
            await engine._llm.reset_prefix_cache()
            t0 = time.perf_counter()
            out = await engine.prefill(f"{spec['name']}-{i}", spec["prompt"], one)
            times.append((time.perf_counter() - t0) * 1e3)
            cached.append(out.cached_tokens)
            computed.append(out.computed_tokens)
            if spec["name"] == "cold":
                break  # after the first request its chunks are in the store
        # vLLM's own local-cache repeat, the figure users compare against: same engine, prefix
        # cache kept, so the whole prompt is a local hit
        await engine.prefill(f"{spec['name']}-local-warm", spec["prompt"], one)
        t0 = time.perf_counter()
        await engine.prefill(f"{spec['name']}-local", spec["prompt"], one)
        local_ms = (time.perf_counter() - t0) * 1e3
        return {
            "ttft_ms": times,
            "cached_tokens": cached,
            "computed_tokens": computed,
            "local_repeat_ms": local_ms,
        }
    finally:
        await engine.close()


def run(args: argparse.Namespace) -> int:
    from pdserve.model.prepare import resolve_model
    from pdserve.procs import local_store

    resolve_model(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-ttft-"))
    with local_store(tmp / "logs", segment_size="512MiB") as (master, _node):
        rng = random.Random(7)
        prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
        warmup = [rng.randrange(1000, 40000) for _ in range(64)]
        config = {
            "model": args.model,
            "chunk_size": args.chunk_size,
            "vllm_block_size": 32,
            "max_model_len": args.prompt_tokens + 64,
            "max_num_seqs": 4,
            "vllm_kv_cache_gib": args.kv_cache_gib,
            "store_master": master.info["grpc"],
            "store_transport": args.transport,
        }
        base = {"config": config, "prompt": prompt, "warmup": warmup, "repeats": args.repeats}
        cold = run_phase(MODULE, tmp, "cold", {**base, "name": "cold"})
        cached = run_phase(MODULE, tmp, "cached", {**base, "name": "cached"})
    cold_ms = cold["ttft_ms"][0]
    cached_ms = min(cached["ttft_ms"])
    print(
        f"model {args.model}, prompt {args.prompt_tokens} tokens, chunk {args.chunk_size}, "
        f"store transport {args.transport}"
    )
    print(
        f"cold   first token: {cold_ms:9.1f} ms (loaded {cold['cached_tokens'][0]}, "
        f"computed {cold['computed_tokens'][0]} tokens)"
    )
    rounded = [round(t, 1) for t in cached["ttft_ms"]]
    print(
        f"cached first token: {cached_ms:9.1f} ms (best of {rounded}; fresh engine process, "
        f"loaded {cached['cached_tokens']}, computed {cached['computed_tokens']} tokens)"
    )
    local_ms = cached["local_repeat_ms"]
    print(f"local-cache repeat (vLLM's own prefix cache, no store): {local_ms:9.1f} ms")
    print(f"ratio cached/cold: {cached_ms / cold_ms:.3f} (target <= 0.100)")
    print(f"ratio store-cached/local-repeat: {cached_ms / local_ms:.2f} (target <= 2)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(_engine_phase, argv[1], argv[2])
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.ttft", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
