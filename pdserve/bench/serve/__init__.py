"""``pdserve bench serve``: an online serving benchmark like ``vllm bench serve``, optionally
side by side with a colocated vLLM baseline.

A streaming OpenAI client (``POST /v1/completions``, prompts as token ids, ``temperature 0``,
``ignore_eos``) sends a seeded workload open loop at its arrival times (multi-round
conversations send each round when the previous one finished) and reports TTFT, TPOT, ITL and
end-to-end latency, throughput and goodput with vLLM's definitions (see
:mod:`pdserve.bench.serve.metrics`). Against pdserve it also reports the router's prompt
tokens by source and mean time per request phase from its ``/metrics``.

Systems: ``--target URL`` (a running ``pdserve up``, or any OpenAI-compatible server; its API
key from ``$PDSERVE_API_KEY`` or ``--api-key``), or ``--start-pdserve "ARGS"`` (the benchmark
starts ``pdserve up ARGS`` on free ports, sends the key that ``up`` writes to its run dir, and
stops it). ``--compare colocated`` then runs the same workload against two plain ``vllm serve``
engines, one per core, behind a round-robin proxy, and prints both side by side
(``colocated-router``: behind vLLM's own router; ``both``: each in turn). For every system the
run started, the report says where the cores went during the measured window, by process role,
and the control plane's CPU per request (:mod:`~pdserve.bench.serve.cpu`).

``pdserve bench serve gen-trace --out FILE`` writes a conversation-like Mooncake trace for
``--workload trace --trace FILE`` (:mod:`~pdserve.bench.serve.gentrace`; ``--reuse sessions``:
long-lived sessions). ``--history-rows N`` replays the trace's first N rows, unmeasured, on
every system before the measured window and reports the window's ideal prefix reuse given
that history beside each system's achieved reuse (:mod:`~pdserve.bench.serve.history`,
:mod:`~pdserve.bench.serve.reuse`); ``--engine-kv-cache-gib`` / ``--engine-kv-blocks`` give
both systems' engines the same small KV cache, GPU-shaped (:mod:`~pdserve.bench.serve.memory`).

``vllm bench serve``'s spellings work as aliases: ``--base-url``, ``--dataset-name random |
prefix_repetition``, ``--random-input-len``, ``--random-output-len``, ``--random-range-ratio``,
``--prefix-repetition-{num-prefixes,prefix-len,suffix-len,output-len}``, ``--save-result
[--result-dir DIR] [--result-filename NAME]``; ``--num-prompts``, ``--request-rate``,
``--max-concurrency``, ``--seed``, ``--goodput`` and ``--disable-tqdm`` are the same flags.
"""
