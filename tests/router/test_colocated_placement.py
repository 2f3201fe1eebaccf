"""Placement of locally prefilled requests (colocated serving) and the prefix-affinity map,
as plain classes."""

from __future__ import annotations

from pdserve.services.router.policies import ColocatedPlacement, PrefixAffinity, RouteContext
from pdserve.services.router.workers import Worker

KEYS = [f"k{i}" for i in range(8)]  # a 8-chunk prompt, chunk 32 -> 256 tokens
CHUNK = 32


def workers(n: int) -> list[Worker]:
    return [Worker(f"w{i}", f"127.0.0.1:{9000 + i}", "decode") for i in range(n)]


def test_affinity_counts_leading_keys_per_worker_and_is_bounded():
    aff = PrefixAffinity(max_keys=10)
    aff.record("a", KEYS[:5])
    aff.record("b", KEYS[:2])
    assert aff.longest("a", KEYS) == 5
    assert aff.longest("b", KEYS) == 2
    assert aff.longest("c", KEYS) == 0
    assert aff.longest("a", ["x", *KEYS]) == 0  # a prefix, not a set
    aff.record("a", [f"y{i}" for i in range(8)])  # evicts the oldest keys
    assert len(aff) == 10
    # b's record refreshed k0 and k1, so k2..k4 were the oldest: the chain now stops at 2
    assert aff.longest("a", KEYS) == 2
    aff.forget("a")
    assert aff.longest("a", [f"y{i}" for i in range(8)]) == 0


def test_idle_cluster_prefers_the_worker_holding_the_prefix():
    ws = workers(2)
    place = ColocatedPlacement()
    place.affinity.record("w1", KEYS[:6])
    ctx = RouteContext(prompt_tokens=256, cached_tokens=0)
    assert place.choose(ws, ctx, KEYS, CHUNK).id == "w1"
    # w1 computes 256 - 192 = 64 tokens, w0 all 256
    assert place.own_tokens(ws[1], ctx, KEYS, CHUNK) == 64
    assert place.own_tokens(ws[0], ctx, KEYS, CHUNK) == 256


def test_store_hits_are_cheap_everywhere_so_load_decides():
    ws = workers(2)
    place = ColocatedPlacement(store_load_weight=0.05)
    place.affinity.record("w1", KEYS)
    ws[1].inflight_tokens = 200  # w1 is prefilling another prompt
    ctx = RouteContext(prompt_tokens=256, cached_tokens=224)  # the store holds 7 chunks
    # w0 loads 224 from the store (cost 11.2) and computes 32; w1 computes 32 but waits 200
    assert place.choose(ws, ctx, KEYS, CHUNK).id == "w0"


def test_busy_owner_loses_to_an_idle_worker_only_when_the_prefix_is_worth_less():
    ws = workers(2)
    place = ColocatedPlacement()
    place.affinity.record("w0", KEYS)
    ctx = RouteContext(prompt_tokens=256, cached_tokens=0)
    ws[0].inflight_tokens = 100  # less than the 224 tokens its cache saves
    assert place.choose(ws, ctx, KEYS, CHUNK).id == "w0"
    ws[0].inflight_tokens = 400
    assert place.choose(ws, ctx, KEYS, CHUNK).id == "w1"


def test_reported_queue_and_streams_count_when_the_router_has_no_own_view():
    ws = workers(2)
    place = ColocatedPlacement(request_tokens=256, stream_tokens=8)
    ctx = RouteContext(prompt_tokens=64, cached_tokens=0)
    ws[0].queue_length = 1  # another router's request waits there
    assert place.choose(ws, ctx, [], CHUNK).id == "w1"
    ws[0].queue_length = 0
    ws[1].inflight = 3  # three streams decoding on w1
    assert place.choose(ws, ctx, [], CHUNK).id == "w0"
