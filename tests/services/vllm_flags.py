"""The flags of the vLLM workers the vLLM service tests share (``vllm_stack`` in conftest.py):
the tiny model in fp32, chunk 64 = two vLLM blocks of 32, and a long store timeout (a store
call timed out on 2 busy cores is skipped, which would change the counts the tests check)."""

CHUNK = 64
VLLM = ["--engine", "vllm", "--kv-dtype", "float32", "--chunk-size", str(CHUNK),
        "--vllm-kv-cache-gib", "0.25", "--store-timeout-s", "30"]  # fmt: skip
