"""MasterState driven directly with an injected clock (no network)."""

from __future__ import annotations

import itertools

import pytest

from pdserve import errors
from pdserve.services.kvstore.master.persistence import MetadataStore
from pdserve.services.kvstore.master.state import MasterState
from pdserve.v1 import kvstore_pb2 as pb

KB = 1024


def put(state: MasterState, key: str, size: int = KB, client: str = "c", **opts) -> int:
    """put start + put end; returns the put-start code (or the put-end code if start was OK)."""
    (r,) = state.put_start(client, [(key, size)], **opts)
    if r.code != pb.KV_OK or r.already_exists:
        return r.code
    (e,) = state.put_end(client, [key])
    return e.code


def mount(state: MasterState, seg: str, node: str, size: int = 64 * KB, held=()) -> int:
    """Mounts ``seg`` of ``node``, which gives its KVNodeService address as nodes do."""
    return state.mount(seg, node, size, [], held, address=f"{node}.nodes:7000")


def test_put_get_and_idempotent_put(make_state, events) -> None:
    s = make_state()
    mount(s, "s1", "n1")
    assert put(s, "a") == pb.KV_OK
    (again,) = s.put_start("c", [("a", KB)])
    assert again.code == pb.KV_OK and again.already_exists and not again.replicas
    (g,) = s.get_replicas("c", ["a"])
    assert g.code == pb.KV_OK and g.replicas[0].segment_id == "s1"
    assert events.events == [(pb.KV_EVENT_STORED, "a", KB, pb.KV_EVENT_REASON_UNSPECIFIED)]
    assert s.stats().puts == 1


def test_pending_put_is_invisible_and_exclusive(make_state) -> None:
    s = make_state()
    mount(s, "s1", "n1")
    (r,) = s.put_start("w1", [("k", KB)])
    assert r.code == pb.KV_OK
    assert s.exists(["k"]) == [False]
    assert s.longest_prefix(["k"]) == 0
    (r2,) = s.put_start("w2", [("k", KB)])
    assert r2.code == pb.KV_PUT_IN_PROGRESS
    assert s.remove(["k"])[0].code == pb.KV_PUT_IN_PROGRESS
    s.put_end("w1", ["k"])
    assert s.exists(["k"]) == [True]


def test_longest_prefix_and_exists(make_state) -> None:
    s = make_state()
    mount(s, "s1", "n1")
    for k in ("h0", "h1", "h3"):
        put(s, k)
    assert s.longest_prefix(["h0", "h1", "h2", "h3"]) == 2
    assert s.longest_prefix(["x", "h0"]) == 0
    assert s.exists(["h0", "h2", "h3"]) == [True, False, True]
    st = s.stats()
    assert st.prefix_queries == 2 and st.prefix_hit_keys == 2


def test_replication_on_distinct_nodes(make_state) -> None:
    s = make_state()
    # Node n1 has two segments: two replicas must never both land on n1.
    mount(s, "s1a", "n1", 1024 * KB)
    mount(s, "s1b", "n1", 1024 * KB)
    mount(s, "s2", "n2", 64 * KB)
    for i in range(20):
        (r,) = s.put_start("c", [(f"k{i}", KB)], replicas=2)
        assert r.code == pb.KV_OK
        assert len({loc.node_id for loc in r.replicas}) == 2
    (r,) = s.put_start("c", [("three", KB)], replicas=3)
    assert r.code == pb.KV_NOT_ENOUGH_NODES


def test_put_no_space_without_evictable(make_state) -> None:
    s = make_state()
    mount(s, "s1", "n1", 4 * KB)
    (r,) = s.put_start("c", [("big", 8 * KB)])
    assert r.code == pb.KV_NO_SPACE
    (r,) = s.put_start("c", [("a", 4 * KB)])
    assert r.code == pb.KV_OK
    (r,) = s.put_start("c", [("b", KB)])  # pending puts are never evicted
    assert r.code == pb.KV_NO_SPACE


def test_bad_input(make_state) -> None:
    s = make_state(max_key_bytes=8, max_object_bytes=10 * KB, max_batch_keys=3)
    mount(s, "s1", "n1")
    # Too many items is a whole-call error.
    with pytest.raises(errors.ResourceExhausted, match="max_batch_keys=3"):
        s.put_start("c", [("a", 1)] * 4)
    res = s.put_start("c", [("", 1), ("x" * 9, 1), ("ok", 0)])
    assert [r.code for r in res] == [pb.KV_INVALID] * 3
    assert "empty" in res[0].message and "max_key_bytes=8" in res[1].message
    assert "> 0" in res[2].message
    (r,) = s.put_start("c", [("ok2", 11 * KB)])
    assert r.code == pb.KV_INVALID and "max_object_bytes" in r.message
    with pytest.raises(errors.InvalidArgument, match="no items"):
        s.put_start("c", [])
    with pytest.raises(errors.InvalidArgument, match="no keys"):
        s.longest_prefix([])
    with pytest.raises(errors.InvalidArgument, match="max_replicas"):
        s.put_start("c", [("a", 1)], replicas=99)
    (e,) = s.put_end("c", ["never"])
    assert e.code == pb.KV_NO_PENDING_PUT
    (e,) = s.put_revoke("c", ["never"])
    assert e.code == pb.KV_NO_PENDING_PUT
    with pytest.raises(errors.NotFound, match="not mounted"):
        s.unmount("nope")
    with pytest.raises(errors.InvalidArgument, match="size must be > 0"):
        s.mount("s2", "n1", 0, [])
    with pytest.raises(errors.InvalidArgument, match="must not be empty"):
        s.mount("", "n1", KB, [])
    # Duplicate mount: same node + size is idempotent, anything else ALREADY_EXISTS.
    assert put(s, "kept") == pb.KV_OK
    mount(s, "s1", "n1")
    with pytest.raises(errors.AlreadyExists, match="already mounted"):
        mount(s, "s1", "n2")
    with pytest.raises(errors.AlreadyExists):
        mount(s, "s1", "n1", 128 * KB)
    assert s.exists(["kept"]) == [True]  # nothing stored was damaged


def test_revoke_frees_space(make_state) -> None:
    s = make_state()
    mount(s, "s1", "n1", 4 * KB)
    (r,) = s.put_start("c", [("a", 4 * KB)])
    assert r.code == pb.KV_OK
    assert s.put_revoke("c", ["a"])[0].code == pb.KV_OK
    assert s.segments["s1"].used == 0
    assert put(s, "b", 4 * KB) == pb.KV_OK


def test_leases_block_removal_and_eviction(make_state, clock) -> None:
    s = make_state(high_watermark=1.0, low_watermark=1.0)  # on-demand eviction only
    mount(s, "s1", "n1", 4 * KB)
    assert put(s, "a", 2 * KB) == pb.KV_OK
    assert put(s, "b", 2 * KB) == pb.KV_OK
    s.get_replicas("reader", ["a", "b"], lease_ms=1000)
    assert s.remove(["a"])[0].code == pb.KV_LEASED
    (r,) = s.put_start("c", [("c", 2 * KB)])
    assert r.code == pb.KV_NO_SPACE  # both leased: nothing evictable
    s.release("reader", ["a"])
    assert s.remove(["a"])[0].code == pb.KV_OK
    clock.advance(1.01)  # lease on b ended by time
    assert put(s, "c", 4 * KB) == pb.KV_OK
    assert s.exists(["b", "c"]) == [False, True]


def test_eviction_under_2x_pressure_keeps_leased_and_is_lru(make_state, clock, events) -> None:
    s = make_state(high_watermark=1.0, low_watermark=1.0)  # on-demand eviction only
    mount(s, "s1", "n1", 32 * KB)  # 32 objects of 1 KiB fill it
    keys = [f"k{i:02d}" for i in range(32)]
    for k in keys:
        assert put(s, k) == pb.KV_OK
        clock.advance(0.001)
    leased = keys[::4]
    s.get_replicas("reader", leased, lease_ms=60_000)
    # Touch k01 so it becomes the most recently used of the unleased ones.
    s.get_replicas("reader2", ["k01"], lease_ms=1)
    clock.advance(0.01)
    more = [f"m{i:02d}" for i in range(32)]  # 2x capacity in total
    for k in more:
        assert put(s, k) == pb.KV_OK
    assert all(s.exists(leased))
    evicted = [e[1] for e in events.events if e[0] == pb.KV_EVENT_REMOVED]
    assert all(
        e[3] == pb.KV_EVENT_REASON_EVICT for e in events.events if e[0] == pb.KV_EVENT_REMOVED
    )
    assert not set(evicted) & set(leased)
    # Unleased originals go first, in put order, and k01 (touched) last among them.
    unleased = [k for k in keys if k not in leased and k != "k01"] + ["k01"]
    assert evicted[: len(unleased)] == unleased
    assert s.stats().evictions == len(evicted)
    assert s.segments["s1"].used <= s.segments["s1"].capacity


def test_prefix_lookups_keep_a_prefix_and_eviction_takes_a_chain_from_its_end(
    make_state, clock, events
) -> None:
    """A worker whose own cache serves a prefix reads nothing from the store, but asks
    LongestPrefix of every prompt: that counts as use, so one-off tails written after the
    prefix are evicted before it. Within a chain the deepest chunks go first, so what is
    left is still a prefix that LongestPrefix finds."""
    s = make_state(high_watermark=1.0, low_watermark=1.0)  # on-demand eviction only
    mount(s, "s1", "n1", 8 * KB)  # 8 objects of 1 KiB
    prefix = ["p0", "p1", "p2", "p3"]
    for k in prefix:
        assert put(s, k) == pb.KV_OK
    for i in range(12):  # 3x the room left: every tail is evicted once room runs out
        assert put(s, f"tail{i}") == pb.KV_OK
        assert s.longest_prefix([*prefix, f"tail{i}"]) == 5
    assert s.exists(prefix) == [True] * 4
    # Without the lookups the prefix is the oldest: the tails push it out, deepest first.
    for i in range(12, 20):
        assert put(s, f"tail{i}") == pb.KV_OK
    evicted = [e[1] for e in events.events if e[0] == pb.KV_EVENT_REMOVED]
    assert [k for k in evicted if k in prefix] == ["p3", "p2", "p1", "p0"]
    # A chain put in one batch, and one read in one batch, leave its head the most recent.
    for keys in (["b0", "b1", "b2"], ["r0", "r1", "r2"]):
        assert all(r.code == pb.KV_OK for r in s.put_start("c", [(k, KB) for k in keys]))
        assert all(r.code == pb.KV_OK for r in s.put_end("c", keys))
    s.get_replicas("reader", ["r0", "r1", "r2"], lease_ms=1)
    clock.advance(0.01)  # the read's 1 ms lease is over: r0-r2 may be evicted
    for i in range(20, 28):
        assert put(s, f"tail{i}") == pb.KV_OK
    evicted = [e[1] for e in events.events if e[0] == pb.KV_EVENT_REMOVED]
    assert [k for k in evicted if k[0] in "br"] == ["b2", "b1", "b0", "r2", "r1", "r0"]


def test_soft_pin_evicted_last(make_state) -> None:
    s = make_state(high_watermark=1.0, low_watermark=1.0)
    mount(s, "s1", "n1", 4 * KB)
    assert put(s, "pinned", KB, soft_pin=True) == pb.KV_OK
    assert put(s, "a", KB) == pb.KV_OK
    assert put(s, "b", KB) == pb.KV_OK
    assert put(s, "c", KB) == pb.KV_OK
    assert put(s, "d", KB) == pb.KV_OK  # evicts a, not the older pinned object
    assert s.exists(["pinned", "a"]) == [True, False]
    assert put(s, "big", 4 * KB) == pb.KV_OK  # now everything must go, pinned too
    assert s.exists(["pinned", "big"]) == [False, True]


def test_watermark_eviction(make_state) -> None:
    s = make_state(high_watermark=0.5, low_watermark=0.25)
    mount(s, "s1", "n1", 16 * KB)
    for i in range(8):
        assert put(s, f"k{i}") == pb.KV_OK
    assert s.segments["s1"].used == 8 * KB
    assert put(s, "k8") == pb.KV_OK  # 9 KiB > 50%: evict down to 25%
    s.tick()
    assert s.segments["s1"].used <= 4 * KB
    assert s.exists(["k0", "k8"]) == [False, True]


def test_ttl_expiry(make_state, clock, events) -> None:
    s = make_state()
    mount(s, "s1", "n1")
    assert put(s, "tail", ttl_ms=500) == pb.KV_OK
    assert put(s, "chunk") == pb.KV_OK
    clock.advance(0.4)
    s.heartbeat("n1", ["s1"])
    assert s.exists(["tail"]) == [True]
    clock.advance(0.2)
    assert s.exists(["tail"]) == [False]  # invisible at the deadline, before the tick
    assert s.get_replicas("c", ["tail"])[0].code == pb.KV_NOT_FOUND
    s.tick()
    assert (pb.KV_EVENT_REMOVED, "tail", KB, pb.KV_EVENT_REASON_TTL) in events.events
    assert "tail" not in s.objects and s.exists(["chunk"]) == [True]
    assert put(s, "tail", ttl_ms=500) == pb.KV_OK  # the key can be written again


def test_put_timeout_reclaims(make_state, clock) -> None:
    s = make_state(put_timeout_s=2.0)
    mount(s, "s1", "n1", 4 * KB)
    (r,) = s.put_start("slow", [("k", 4 * KB)])
    assert r.code == pb.KV_OK
    clock.advance(1.0)
    s.heartbeat("n1", ["s1"])
    s.tick()
    assert s.segments["s1"].used == 4 * KB  # not reclaimed (nor evicted) before the timeout
    clock.advance(1.1)
    s.heartbeat("n1", ["s1"])
    s.tick()
    assert s.segments["s1"].used == 0
    assert s.put_end("slow", ["k"])[0].code == pb.KV_NO_PENDING_PUT


def test_dead_node(make_state, clock, events) -> None:
    s = make_state(heartbeat_interval_ms=500, heartbeat_miss_limit=3)
    mount(s, "s1", "n1")
    mount(s, "s2", "n2")
    assert put(s, "both", replicas=2) == pb.KV_OK
    (r,) = s.put_start("c", [("only1", KB)], placement=pb.PLACEMENT_FREE_RATIO_FIRST)
    only1_seg = r.replicas[0].segment_id
    s.put_end("c", ["only1"])
    alive_node = "n2" if only1_seg == "s1" else "n1"
    dead_node = "n1" if alive_node == "n2" else "n2"
    for _ in range(4):  # only the alive node heartbeats
        clock.advance(0.5)
        assert s.heartbeat(alive_node, [f"s{alive_node[-1]}"]) is False
        s.tick()
    assert s.stats().alive_nodes == 1
    assert (pb.KV_EVENT_REMOVED, "only1", KB, pb.KV_EVENT_REASON_NODE_DEAD) in events.events
    (g,) = s.get_replicas("c", ["both"])
    assert [rep.node_id for rep in g.replicas] == [alive_node]
    for i in range(5):
        (r,) = s.put_start("c", [(f"new{i}", KB)])
        assert [rep.node_id for rep in r.replicas] == [alive_node]
    assert s.heartbeat(dead_node, [f"s{dead_node[-1]}"]) is True  # must remount
    mount(s, f"s{dead_node[-1]}", dead_node)
    assert s.heartbeat(dead_node, [f"s{dead_node[-1]}"]) is False


def test_unmount_removes_replicas(make_state, events) -> None:
    s = make_state()
    mount(s, "s1", "n1")
    assert put(s, "a") == pb.KV_OK
    assert s.unmount("s1") == 1
    assert s.exists(["a"]) == [False]
    assert events.events[-1] == (pb.KV_EVENT_REMOVED, "a", KB, pb.KV_EVENT_REASON_UNMOUNT)
    with pytest.raises(errors.NotFound):
        s.unmount("s1")


def test_restart_from_persisted_metadata(make_state, clock, tmp_path) -> None:
    store = MetadataStore(tmp_path)
    s = make_state(store=store)
    mount(s, "s1", "n1")
    mount(s, "s2", "n2")
    assert put(s, "a", replicas=2, soft_pin=True) == pb.KV_OK
    assert put(s, "b") == pb.KV_OK
    assert put(s, "gone") == pb.KV_OK
    assert s.remove(["gone"])[0].code == pb.KV_OK
    before = {k: sorted((r.segment_id, r.offset) for r in o.replicas) for k, o in s.objects.items()}
    store.close()

    s2 = make_state(store=MetadataStore(tmp_path))
    assert s2.exists(["a", "b"]) == [False, False]  # dormant until the segments come back
    assert mount(s2, "s1", "n1") >= 1
    assert s2.exists(["a"]) == [True]
    mount(s2, "s2", "n2")
    after = {k: sorted((r.segment_id, r.offset) for r in o.replicas) for k, o in s2.objects.items()}
    assert after == before
    assert s2.objects["a"].soft_pin
    assert s2.exists(["gone"]) == [False]
    # New allocations never overlap restored replicas.
    for i in range(10):
        (r,) = s2.put_start("c", [(f"n{i}", KB)])
        assert r.code == pb.KV_OK
    for seg in s2.segments.values():
        spans = seg.allocator.allocated_ranges()
        for (o1, n1), (o2, _) in itertools.pairwise(spans):
            assert o1 + n1 <= o2


def test_restart_dormant_dropped_after_grace(make_state, clock, tmp_path) -> None:
    s = make_state(store=MetadataStore(tmp_path))
    mount(s, "s1", "n1")
    assert put(s, "a") == pb.KV_OK
    s.store.close()
    s2 = make_state(store=MetadataStore(tmp_path), dormant_grace_s=5)
    clock.advance(6)
    s2.tick()
    assert not s2.dormant
    s2.store.close()
    s3 = make_state(store=MetadataStore(tmp_path))
    mount(s3, "s1", "n1")
    assert s3.exists(["a"]) == [False]


def test_held_objects_on_remount(make_state) -> None:
    s = make_state()  # no persistence: the node's report is the only source
    restored = mount(s, "s1", "n1", held=[("a", 0, KB), ("b", 1024, 100), ("bad", 64, 10)])
    assert restored == 2  # "bad" overlaps "a" and is refused
    assert s.exists(["a", "b", "bad"]) == [True, True, False]
    (r,) = s.put_start("c", [("c", KB)])
    assert r.replicas[0].offset >= 1088
    # Re-reporting the same objects on an idempotent remount changes nothing.
    assert mount(s, "s1", "n1", held=[("a", 0, KB)]) == 1
    assert s.stats().objects == 2


def test_heartbeat_drops_segments_the_node_no_longer_reports(make_state, events) -> None:
    s = make_state()
    mount(s, "n1-seg0-boot1", "n1")
    assert put(s, "a") == pb.KV_OK
    # The node process restarted: new segment ids, the old bytes are gone.
    mount(s, "n1-seg0-boot2", "n1")
    assert s.heartbeat("n1", ["n1-seg0-boot2"]) is False
    assert s.exists(["a"]) == [False]
    assert (pb.KV_EVENT_REMOVED, "a", KB, pb.KV_EVENT_REASON_NODE_DEAD) in events.events
    assert [seg.segment_id for seg in s.stats().segments] == ["n1-seg0-boot2"]


def test_restart_keeps_ttl_and_pin(make_state, clock, tmp_path) -> None:
    s = make_state(store=MetadataStore(tmp_path))
    mount(s, "s1", "n1")
    assert put(s, "tail", ttl_ms=2000) == pb.KV_OK
    assert put(s, "hot", soft_pin=True) == pb.KV_OK
    s.store.close()
    clock.advance(1.0)
    s2 = make_state(store=MetadataStore(tmp_path))
    mount(s2, "s1", "n1", held=[("huge", 60 * KB, 8 * KB)])  # beyond the segment: refused
    assert s2.exists(["tail", "hot", "huge"]) == [True, True, False]
    assert s2.objects["hot"].soft_pin
    clock.advance(1.1)
    assert s2.exists(["tail"]) == [False]  # the TTL deadline survived the restart
    s2.heartbeat("n1", ["s1"])
    s2.tick()
    assert "tail" not in s2.objects
    s2.store.close()
    s3 = make_state(store=MetadataStore(tmp_path))
    mount(s3, "s1", "n1")
    assert s3.exists(["tail", "hot"]) == [False, True]


def test_small_objects_are_kept_inline_within_the_cap(make_state) -> None:
    s = make_state(inline_max_bytes=100, inline_capacity_bytes=150)
    mount(s, "s1", "n1")
    for key, data in (("a", b"x" * 100), ("b", b"y" * 60)):
        (r,) = s.put_start("c", [(key, len(data))], inline=[data])
        assert r.code == pb.KV_OK
        s.put_end("c", [key])
    a, b = s.get_replicas("c", ["a", "b"])
    assert a.inline == b"x" * 100 and a.replicas  # the replica exists as well
    assert b.inline == b""  # 160 bytes would pass inline_capacity_bytes: served from replicas
    assert s.objects.inline_bytes == 100
    s.release("c", ["a", "b"])
    assert s.remove(["a"])[0].code == pb.KV_OK
    assert s.objects.inline_bytes == 0
    # The inline copy must be the object and fit the limit; each item is judged alone.
    bad = s.put_start(
        "c", [("short", 10), ("big", 101), ("ok", 3)], inline=[b"x" * 9, b"x" * 101, b"abc"]
    )
    assert [r.code for r in bad] == [pb.KV_INVALID, pb.KV_INVALID, pb.KV_OK]
    assert "inline_data has 9 bytes" in bad[0].message
    assert "inline_max_bytes=100" in bad[1].message
    with pytest.raises(errors.InvalidArgument, match="2 inline payloads for 1 items"):
        s.put_start("c", [("z", 1)], inline=[b"a", b"b"])
    # A revoked or timed-out put never counts.
    s.put_revoke("c", ["ok"])
    assert s.objects.inline_bytes == 0


def _silence(s: MasterState, clock, seconds: float, step: float = 0.1) -> None:
    """Time passes with the master running (ticking) and no node heartbeating."""
    for _ in range(round(seconds / step)):
        clock.advance(step)
        s.tick()


def test_a_stalled_master_does_not_declare_nodes_dead(make_state, clock) -> None:
    """A master that did not run for 3 s (SIGSTOP) heard no heartbeats: that is its own
    stall, not the node's death."""
    s = make_state(heartbeat_interval_ms=500, heartbeat_miss_limit=3)
    mount(s, "s1", "n1")
    assert put(s, "a") == pb.KV_OK
    clock.advance(3.0)  # stopped: no tick ran
    s.tick()
    assert s.stats().alive_nodes == 1 and s.exists(["a"]) == [True]
    assert s.counters.stalls == 1
    # A node that really stays silent while the master runs is still declared dead.
    _silence(s, clock, 2.0)
    assert s.stats().alive_nodes == 0


def test_a_dead_nodes_objects_revive_when_it_remounts_with_its_bytes(make_state, clock, events):
    s = make_state(heartbeat_interval_ms=500, heartbeat_miss_limit=3)
    mount(s, "s1", "n1")
    for k in ("a", "b"):
        assert put(s, k) == pb.KV_OK
    before = {g.key: g.replicas[0].offset for g in s.get_replicas("c", ["a", "b"])}
    _silence(s, clock, 2.0)
    assert s.exists(["a", "b"]) == [False, False]  # invisible while the node is presumed dead
    assert (pb.KV_EVENT_REMOVED, "a", KB, pb.KV_EVENT_REASON_NODE_DEAD) in events.events
    assert s.heartbeat("n1", ["s1"]) is True  # it was only paused: remount
    assert mount(s, "s1", "n1") == 2
    got = s.get_replicas("c", ["a", "b"])
    assert {g.key: g.replicas[0].offset for g in got} == before
    assert events.events[-1][0] == pb.KV_EVENT_STORED
    (r,) = s.put_start("c", [("new", KB)])  # the revived ranges are allocated again
    assert r.replicas[0].offset not in before.values()


def test_a_segment_with_new_memory_forgets_its_dormant_objects(make_state, clock) -> None:
    s = make_state(heartbeat_interval_ms=500, heartbeat_miss_limit=3)
    mount(s, "s1", "n1")
    assert put(s, "a") == pb.KV_OK
    _silence(s, clock, 2.0)
    assert s.mount("s1", "n1", 64 * KB, [], keeps_bytes=False) == 0
    assert s.exists(["a"]) == [False] and not s.dormant
    # The same holds for a live segment whose node restarted with zeroed memory.
    assert put(s, "b") == pb.KV_OK
    assert s.mount("s1", "n1", 64 * KB, [], keeps_bytes=False) == 0
    assert s.exists(["b"]) == [False]


def _persisted_keys(state_dir) -> list[str]:
    """The keys in the master's SQLite file (read beside the master, which holds the lock)."""
    import sqlite3

    with sqlite3.connect(state_dir / "kvstore-master.sqlite3") as db:
        return [k for (k,) in db.execute("SELECT key FROM objects ORDER BY key")]


def test_a_dead_segment_is_dropped_after_its_grace(make_state, clock, tmp_path) -> None:
    s = make_state(
        store=MetadataStore(tmp_path),
        heartbeat_interval_ms=500,
        heartbeat_miss_limit=3,
        dormant_grace_s=10,
    )
    mount(s, "s1", "n1")
    mount(s, "s2", "n2")
    assert put(s, "a", placement=pb.PLACEMENT_FREE_RATIO_FIRST) == pb.KV_OK
    (g,) = s.get_replicas("c", ["a"])
    dead_seg, dead_node = g.replicas[0].segment_id, g.replicas[0].node_id
    alive = "n2" if dead_node == "n1" else "n1"
    for _ in range(20):  # only the other node heartbeats
        clock.advance(0.1)
        s.heartbeat(alive, ["s2" if alive == "n2" else "s1"])
        s.tick()
    assert s.exists(["a"]) == [False] and "a" in s.dormant
    # While dormant, the object's persisted row survives a master restart too.
    assert _persisted_keys(tmp_path) == ["a"]
    for _ in range(100):
        clock.advance(0.1)
        s.heartbeat(alive, ["s2" if alive == "n2" else "s1"])
        s.tick()
    assert dead_seg not in {x.segment_id for x in s.stats().segments}
    assert not s.dormant and _persisted_keys(tmp_path) == []
    assert mount(s, dead_seg, dead_node) == 0


def test_a_large_held_list_is_restored_whole(make_state) -> None:
    """Re-reported objects are reserved in one pass (the old per-object reservation was
    quadratic: one mount of many objects stalled the master for seconds)."""
    n = 50_000
    s = make_state(max_held_objects=n)
    held = [(f"h{i}", i * 128, 100) for i in range(n)]
    assert mount(s, "s1", "n1", size=n * 128, held=held) == n
    assert s.stats().objects == n
    assert s.segments["s1"].allocator.used == n * 128  # every range is taken


def test_an_object_that_lost_a_replica_is_re_replicated(make_state, clock) -> None:
    s = make_state(heartbeat_interval_ms=500, heartbeat_miss_limit=3)
    for i in (1, 2, 3):
        mount(s, f"s{i}", f"n{i}")
    assert put(s, "a", replicas=2) == pb.KV_OK
    (g,) = s.get_replicas("c", ["a"])
    s.release("c", ["a"])
    lost = g.replicas[0].node_id
    alive = [n for n in ("n1", "n2", "n3") if n != lost]
    for _ in range(20):  # the node holding one copy stops heartbeating
        clock.advance(0.1)
        for n in alive:
            s.heartbeat(n, [f"s{n[-1]}"])
        s.tick()
    assert s.under_replicated() == 1
    (job,) = s.repair_jobs(8)
    assert job.source.node_id != lost and job.target.node_id not in (lost, job.source.node_id)
    assert s.remove(["a"])[0].code == pb.KV_LEASED  # the copy's source is protected
    assert s.repair_done(job, ok=True)
    (g,) = s.get_replicas("c", ["a"])
    assert sorted(r.node_id for r in g.replicas) == sorted(alive)
    assert s.under_replicated() == 0 and s.counters.repairs == 1
    # A failed copy frees its target and queues the object again.
    s.release("c", ["a"])
    assert put(s, "b", replicas=2) == pb.KV_OK
    s.objects["b"].replicas.pop()
    s.repairer.want(s.objects["b"])
    (job,) = s.repair_jobs(8)
    used = s.segments[job.target.segment_id].allocator.used
    assert not s.repair_done(job, ok=False)
    assert s.segments[job.target.segment_id].allocator.used < used
    assert s.under_replicated() == 1
