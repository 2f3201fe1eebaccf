"""services/router/worker_requests.py: the requests the router builds for its workers."""

from __future__ import annotations

from pdserve.hashing import ModelFingerprint
from pdserve.requests import Sampling
from pdserve.requests_codec import sampling_from_proto
from pdserve.services.router.request import GenRequest
from pdserve.services.router.worker_requests import (
    decode_request,
    prefill_request,
    resumed_request,
    write_handle,
)

FP = ModelFingerprint(model_id="tiny", revision="r", chunk_size=4)
REQ = GenRequest(
    "r1", [5, 6, 7, 8, 9, 10, 11, 12, 13], Sampling(max_tokens=6, seed=3), cache_salt="t"
)


def test_both_requests_carry_the_generation_as_asked() -> None:
    p = prefill_request(REQ, "tiny", publish=True)
    d = decode_request(REQ, "tiny", chunk_wait_ms=5)
    for r in (p, d):
        assert (r.request_id, r.model, r.cache_salt) == ("r1", "tiny", "t")
        assert list(r.prompt_token_ids) == REQ.prompt_token_ids
        assert sampling_from_proto(r.sampling, default_max_tokens=1) == REQ.sampling
    assert p.publish_incrementally and d.chunk_wait_ms == 5 and not d.HasField("kv")


def test_the_write_handle_names_the_full_chunks_before_the_last_token() -> None:
    keys = ["k0", "k1", "k2"]
    h = write_handle(keys, 9, FP)  # (9 - 1) // 4 = 2 chunks; the 9th token stays to compute
    assert (list(h.chunk_keys), h.num_tokens, h.chunk_size) == (["k0", "k1"], 8, 4)
    assert h.fingerprint == FP.digest()
    assert list(write_handle(keys, 8, FP).chunk_keys) == ["k0"]


def test_a_resumed_decode_continues_after_the_streamed_tokens() -> None:
    first = decode_request(REQ, "tiny", first_token_id=42)
    r = resumed_request(first, [42, 43])
    assert r is not None and not r.HasField("first_token_id") and not r.HasField("kv")
    assert list(r.prompt_token_ids) == [*REQ.prompt_token_ids, 42, 43]
    assert r.sampling.max_tokens == 4 and r.sampling.seed == 3 and r.cache_salt == "t"
    assert resumed_request(first, []) is None  # nothing streamed: a plain retry
    assert resumed_request(first, [1] * 6) is None  # nothing left
