"""Prefill on one process -> KV store (master + node processes) -> decode on another, torch
engine on the tiny model (chunk_size 16), compared with a single-process HF greedy loop."""

from __future__ import annotations

import grpc
import pytest
from cluster_harness import (
    CS,  # the chunk size the workers run with (see conftest.py)
    GREEDY,
    MAX,
    do_decode,
    do_prefill,
    metric,
    prompt,
    stubs,
    tokens_of,
)

from pdserve.store import open_store
from pdserve.v1 import common_pb2, engine_pb2

pytestmark = pytest.mark.slow
#: shorter than one chunk, exact multiples and in between
LENGTHS = [3, 15, 16, 17, 32, 40, 48, 61]


@pytest.fixture(scope="module")
def workers(stack):
    """Two prefill workers and one decode worker (3 model processes)."""
    return stack.worker("prefill"), stack.worker("prefill"), stack.worker("decode")


def test_prefill_store_decode_is_token_exact(workers, hf_greedy) -> None:
    prefill, _, decode = workers
    for n in LENGTHS:
        toks = prompt(n)
        pre = do_prefill(prefill, toks, f"exact-{n}")
        msgs = do_decode(decode, toks, f"exact-{n}", kv=pre.kv, first_token_id=pre.first_token_id)
        expected = hf_greedy(toks, MAX)
        assert tokens_of(msgs) == expected, f"prompt length {n}"
        assert pre.first_token_id == expected[0]
        assert (msgs[-1].loaded_tokens, msgs[-1].recomputed_tokens) == (n, 0), f"length {n}"
        assert len(pre.kv.chunk_keys) == n // CS and bool(pre.kv.tail_key) == bool(n % CS)
        assert msgs[-1].finish_reason in (
            common_pb2.FINISH_REASON_LENGTH,
            common_pb2.FINISH_REASON_EOS,
        )
        assert all(len(m.token_times_ms) == len(m.token_ids) for m in msgs)


def test_reuse_on_another_prefill_worker_loads_exactly_the_shared_chunks(
    stack, workers, hf_greedy
) -> None:
    first_worker, second_worker, decode = workers
    a = prompt(3 * CS + 4, salt=100)
    b = a[: 2 * CS] + prompt(CS + 9, salt=200)
    pa = do_prefill(first_worker, a, "reuse-a")
    assert pa.cached_tokens == 0
    with open_store(stack.store_address) as sc:
        before = sc.stats()
        pb = do_prefill(second_worker, b, "reuse-b")
        after = sc.stats()
    assert list(pb.kv.chunk_keys[:2]) == list(pa.kv.chunk_keys[:2])
    assert (pb.cached_tokens, pb.computed_tokens) == (2 * CS, len(b) - 2 * CS)
    # the master's counters: one prefix lookup that found 2 keys, 2 reads that hit, and the
    # new chunk + tail written
    assert after.prefix_queries - before.prefix_queries == 1
    assert after.prefix_hit_keys - before.prefix_hit_keys == 2
    assert after.gets - before.gets == 2 and after.get_hits - before.get_hits == 2
    assert after.puts - before.puts == 2
    msgs = do_decode(decode, b, "reuse-b", kv=pb.kv, first_token_id=pb.first_token_id)
    assert tokens_of(msgs) == hf_greedy(b, MAX)


def test_corrupt_chunk_is_detected_and_recomputed(stack, workers, hf_greedy) -> None:
    """Corrupt bytes are planted under a chunk's real key before any worker writes it (the
    store holds immutable objects, so prefill skips the existing key); decode must detect the
    corruption, recompute, and stay token-exact."""
    import torch

    from pdserve import hashing, kvformat
    from pdserve.model.fingerprint import model_fingerprint

    prefill, _, decode = workers
    toks = prompt(2 * CS + 7, salt=300)
    fp = model_fingerprint(stack.model_dir, "tiny", "float32", CS)
    keys = hashing.chunk_keys(fp, toks)
    # a well-formed chunk of the right shape whose payload bytes are then flipped
    good = kvformat.encode(torch.ones(2, 2, 2, CS, 32), fp.digest(), keys[1])
    bad = bytearray(good)
    bad[-10] ^= 0xFF
    with open_store(stack.store_address) as sc:
        assert sc.put(keys[1], bytes(bad))
    before = metric(decode, "pdserve_store_corrupt_chunks_total")
    pre = do_prefill(prefill, toks, "corrupt")
    msgs = do_decode(decode, toks, "corrupt", kv=pre.kv, first_token_id=pre.first_token_id)
    assert tokens_of(msgs) == hf_greedy(toks, MAX)
    assert (msgs[-1].loaded_tokens, msgs[-1].recomputed_tokens) == (CS, len(toks) - CS)
    assert metric(decode, "pdserve_store_corrupt_chunks_total") == before + 1
    assert metric(decode, 'pdserve_kv_chunk_misses_total{kind="chunk"}') >= 1


def test_local_prefill_on_decode(workers, hf_greedy) -> None:
    _, _, decode = workers
    toks = prompt(23, salt=400)
    msgs = do_decode(decode, toks, "local")
    assert tokens_of(msgs) == hf_greedy(toks, MAX)


@pytest.mark.parametrize(
    ("toks", "model", "sampling", "code", "words"),
    [
        ([], "tiny", GREEDY, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        ([1, 2, 99999], "tiny", GREEDY, grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
        (prompt(600), "tiny", GREEDY, grpc.StatusCode.INVALID_ARGUMENT, "context"),
        ([1, 2], "other-model", GREEDY, grpc.StatusCode.NOT_FOUND, "other-model"),
        (
            [1, 2],
            "tiny",
            common_pb2.SamplingParams(max_tokens=5000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_tokens",
        ),
        (
            [1, 2],
            "tiny",
            common_pb2.SamplingParams(max_tokens=4, temperature=-1.0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature",
        ),
    ],
)
def test_bad_input_statuses(workers, toks, model, sampling, code, words) -> None:
    prefill, _, decode = workers
    for proc, call in ((prefill, "Prefill"), (decode, "Decode")):
        ch, p, d = stubs(proc)
        with ch, pytest.raises(grpc.RpcError) as info:
            if call == "Prefill":
                p.Prefill(
                    engine_pb2.PrefillRequest(
                        model=model, prompt_token_ids=toks, sampling=sampling
                    ),
                    timeout=30,
                )
            else:
                list(
                    d.Decode(
                        engine_pb2.DecodeRequest(
                            model=model, prompt_token_ids=toks, sampling=sampling
                        ),
                        timeout=30,
                    )
                )
        assert info.value.code() == code, (call, info.value.details())
        assert words in info.value.details()


@pytest.mark.parametrize("salt", ["s" * 129, "tenant@a", "a\\b"])
def test_bad_cache_salt_is_invalid_argument(workers, salt) -> None:
    prefill, _, decode = workers
    with pytest.raises(grpc.RpcError) as info:
        do_prefill(prefill, [1, 2, 3], "bad-salt", cache_salt=salt)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        do_decode(decode, [1, 2, 3], "bad-salt", cache_salt=salt)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt" in info.value.details()


def test_cancel_and_deadline_free_the_slot(workers) -> None:
    _, _, decode = workers
    toks = prompt(12, salt=500)
    long = common_pb2.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    ch, _, d = stubs(decode)
    with ch:
        call = d.Decode(
            engine_pb2.DecodeRequest(model="tiny", prompt_token_ids=toks, sampling=long), timeout=60
        )
        next(call)
        call.cancel()
        # As long a generation as the context allows (512 tokens), with 20 logprobs at each:
        # an idle machine made 400 plain tokens of the tiny model in under 0.3 s.
        longest = common_pb2.SamplingParams(
            max_tokens=512 - len(toks), temperature=0.0, ignore_eos=True, logprobs=20
        )
        with pytest.raises(grpc.RpcError) as info:
            list(
                d.Decode(
                    engine_pb2.DecodeRequest(model="tiny", prompt_token_ids=toks, sampling=longest),
                    timeout=0.15,
                )
            )
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metric(decode, "pdserve_decode_running_requests") > 0:
        time.sleep(0.1)
    assert metric(decode, "pdserve_decode_running_requests") == 0
    assert metric(decode, 'pdserve_decode_requests_total{outcome="cancelled"}') >= 2
