"""The flags of the vLLM workers the tests here share (``cluster`` in conftest.py): the tiny
model with KV in float32, chunk 64 = two vLLM blocks of 32, and a long store timeout (on 2
busy cores a TLS handshake with the master can take seconds, and a timed-out store call is
skipped, recomputed, which would change the counts the tests check)."""

CHUNK = 64
VLLM = {"engine": "vllm", "kv_dtype": "float32", "chunk_size": CHUNK, "vllm_kv_cache_gib": 0.25,
        "store_timeout_s": 30}  # fmt: skip
