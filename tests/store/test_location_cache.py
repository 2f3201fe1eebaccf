"""The store client's :class:`LocationCache` without a network: its bound, the margin before
a lease ends, drops while a read uses an entry, and one cache per master per process."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.store.client import StoreClient, locations
from pdserve.store.client.locations import LocationCache, margin_s
from pdserve.v1 import kvstore_pb2 as pb


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _found(key: str, lease_ms: int = 1000) -> pb.ReplicaListResult:
    return pb.ReplicaListResult(
        key=key, code=pb.KV_OK, lease_ms=lease_ms, replicas=[pb.Replica(node_id="n", size=8)]
    )


def test_margin_is_a_quarter_of_the_lease_or_250ms() -> None:
    assert margin_s(5.0) == 1.25
    assert margin_s(1.0) == 0.25
    assert margin_s(0.4) == 0.25


def test_an_entry_is_used_until_its_lease_less_the_margin() -> None:
    clock = Clock()
    cache = LocationCache(clock=clock)
    sent = clock.t
    clock.t += 0.05  # the lookup's round trip: the lease counts from before it
    assert cache.put([_found("a", 1000)], sent) == 1
    (loc,) = cache.take(["a"])
    assert loc is not None and loc.result.key == "a"
    assert loc.usable_until == pytest.approx(sent + 0.75)
    assert loc.lease_end == pytest.approx(sent + 1.0)
    cache.done(["a"])
    clock.t = sent + 0.749
    assert cache.take(["a"])[0] is not None
    cache.done(["a"])
    clock.t = sent + 0.75  # within the lease still, but too close to its end: not used
    assert cache.take(["a"]) == [None]
    assert "a" not in cache  # and forgotten


def test_what_is_not_kept() -> None:
    clock = Clock()
    cache = LocationCache(clock=clock)
    missing = pb.ReplicaListResult(key="m", code=pb.KV_NOT_FOUND)
    no_lease = pb.ReplicaListResult(key="z", code=pb.KV_OK)
    # A lease of 200 ms leaves nothing once 250 ms are kept back.
    assert cache.put([missing, no_lease, _found("short", 200)], clock.t) == 0
    # A lookup whose answer came back after its usable part ended.
    assert cache.put([_found("late", 1000)], clock.t - 0.8) == 0
    assert len(cache) == 0
    assert cache.take(["m", "z", "short", "late", "never"]) == [None] * 5


def test_bounded_least_recently_used_first() -> None:
    cache = LocationCache(capacity=3, clock=Clock())
    cache.put([_found(k) for k in "abc"], 100.0)
    cache.take(["a"])  # used: now the most recent
    cache.done(["a"])
    cache.put([_found("d"), _found("e")], 100.0)
    assert len(cache) == 3
    assert [k in cache for k in "abcde"] == [True, False, False, True, True]
    with pytest.raises(ValueError):
        LocationCache(capacity=0)


class Releaser:
    """Records the releases the cache sends; ``end()`` reports them ended."""

    def __init__(self, cache: LocationCache) -> None:
        self.cache = cache
        self.sent: list[str] = []
        self.pending: list[str] = []
        cache.attach(self)  # type: ignore[arg-type]

    def release(self, keys: list[str]) -> None:
        self.sent += keys
        self.pending += keys

    def flush(self) -> None:
        self.end()

    def end(self) -> None:
        keys, self.pending = self.pending, []
        if keys:
            self.cache.released(keys)


def test_drop_releases_the_lease_unless_a_read_uses_it() -> None:
    clock = Clock()
    cache = LocationCache(clock=clock)
    rel = Releaser(cache)
    cache.put([_found(k) for k in "abc"], clock.t)
    cache.drop(["a", "never"])  # leased, not in use: released now
    assert rel.sent == ["a"] and "a" not in cache
    (loc,) = cache.take(["b"])
    assert loc is not None
    cache.drop(["b"])  # a read uses it: its lease must outlive that read
    assert rel.sent == ["a"]
    assert cache.take(["b"]) == [None]  # but no new read takes it
    cache.done(["b"])  # the last read ends: released now
    assert rel.sent == ["a", "b"]
    # A drop while in use, then a new lookup of the key (a new lease): nothing released.
    cache.take(["c"])
    cache.drop(["c"])
    clock.t += 0.01
    cache.put([_found("c")], clock.t)
    cache.done(["c"])
    assert rel.sent == ["a", "b"] and "c" in cache
    # Two reads of one entry: released after the second.
    cache.take(["c", "c"])
    cache.drop(["c"])
    cache.done(["c"])
    assert rel.sent == ["a", "b"]
    cache.done(["c"])
    assert rel.sent == ["a", "b", "c"]
    # Past its lease there is nothing to release.
    cache.put([_found("d")], clock.t)
    clock.t += 1.0
    cache.drop(["d"])
    assert rel.sent == ["a", "b", "c"]
    rel.end()
    assert not cache._releasing and not cache._inflight and not cache._release_after


def test_entries_out_of_use_release_their_leases() -> None:
    clock = Clock()
    cache = LocationCache(capacity=2, clock=clock)
    rel = Releaser(cache)
    cache.put([_found(k) for k in "abc"], clock.t)  # "a" falls off the bound, still leased
    assert rel.sent == ["a"]
    clock.t += 0.8  # past use, within the lease: released as the next read finds it so
    assert cache.take(["b"]) == [None]
    assert rel.sent == ["a", "b"]


def test_no_release_under_a_lookup_in_flight() -> None:
    """A lookup in flight may be answered with the holder's lease and keep an entry that
    relies on it: a release waits for the lookup to end, and is not sent when the lookup
    kept the key again."""
    clock = Clock()
    cache = LocationCache(clock=clock)
    rel = Releaser(cache)
    cache.put([_found("a"), _found("b")], clock.t)
    cache.begin_lookup(["a", "b"])
    sent = clock.t
    cache.drop(["a", "b"])
    assert rel.sent == []
    assert cache.end_lookup(["a", "b"], [_found("a")], sent) == 1  # found "a" only
    assert rel.sent == ["b"] and "a" in cache


def test_a_lookup_that_may_predate_a_release_is_not_kept() -> None:
    clock = Clock()
    cache = LocationCache(clock=clock)
    rel = Releaser(cache)
    cache.put([_found("a")], clock.t)
    cache.drop(["a"])
    assert rel.sent == ["a"]
    # Sent while the release is on its way: the release may end the lease it granted.
    clock.t += 0.01
    assert cache.put([_found("a")], clock.t) == 0
    early = clock.t
    clock.t += 0.01
    rel.end()  # the release ended: a lookup sent before may still have been granted first
    clock.t += 0.01
    assert cache.put([_found("a")], early) == 0
    assert cache.put([_found("a")], clock.t) == 1  # sent after it ended: kept


def test_the_last_client_to_close_releases_every_lease() -> None:
    clock = Clock()
    cache = LocationCache(clock=clock)
    rel = Releaser(cache)
    cache.open()
    cache.open()
    cache.put([_found(k) for k in "ab"], clock.t)
    cache.close()
    assert rel.sent == [] and len(cache) == 2
    cache.close()  # the last one: no lease outlives the process's clients
    assert sorted(rel.sent) == ["a", "b"] and len(cache) == 0 and not cache._releasing


def test_without_a_releaser_a_release_ends_at_once() -> None:
    clock = Clock()
    cache = LocationCache(clock=clock)
    cache.put([_found("a")], clock.t)
    cache.drop(["a"])
    assert not cache._releasing and cache._fence["a"] == clock.t


def test_thread_safe_under_concurrent_use() -> None:
    cache = LocationCache(capacity=64)
    keys = [f"k{i}" for i in range(256)]

    def work(seed: int) -> None:
        for i in range(2000):
            k = keys[(i * 7 + seed) % len(keys)]
            cache.begin_lookup([k])
            cache.end_lookup([k], [_found(k)], time.monotonic())
            taken = [x for x, loc in zip([k], cache.take([k]), strict=True) if loc]
            if i % 5 == 0:
                cache.drop([k])
            cache.done(taken)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) <= 64
    assert not cache._inflight and not cache._looking and not cache._release_after
    assert not cache._releasing  # no releaser: each release ended at once


def test_one_cache_per_master_per_process() -> None:
    a = locations.shared("master-a:1")
    assert locations.shared("master-a:1") is a
    assert locations.shared("master-b:1") is not a
    # Two clients of one master in one process (vLLM's scheduler and worker sides) share it,
    # leases held by the cache's own holder, not by either client.
    one = StoreClient("master-a:1", client_id="scheduler")
    two = StoreClient("master-a:1", client_id="worker")
    try:
        assert one.locations is two.locations is a
        assert one.reads.locations is a
        assert a.holder not in ("scheduler", "worker")
        # Its releases go over a link of its own (it outlives either client).
        assert a.releaser is not None and a.releaser.client_id == a.holder
    finally:
        one.close()
        two.close()
