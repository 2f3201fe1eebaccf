"""The disk tier in the master's state (no network, an injected clock): copies move down
before memory evicts, a memory eviction keeps an object that has a disk copy, a read of a
disk-only object brings it back up, a full disk evicts its own least recently used copies,
and a node's two tiers revive together after a restart."""

from __future__ import annotations

from pdserve.services.kvstore.master.state import MasterState
from pdserve.v1 import kvstore_pb2 as pb

KB = 1024
DISK = pb.STORAGE_TIER_DISK
MEMORY = pb.STORAGE_TIER_MEMORY


def _state(make_state, disk_kb: int = 256, **cfg) -> MasterState:
    """Node n1: a 64 KiB memory segment and a ``disk_kb`` disk segment; no inlining."""
    s = make_state(inline_max_bytes=0, **cfg)
    s.mount("n1-seg0", "n1", 64 * KB, [], address="n1:7000")
    s.mount("n1-disk0", "n1", disk_kb * KB, [], address="n1:7000", tier=DISK)
    return s


def _put(s: MasterState, key: str, size: int = 8 * KB) -> None:
    (r,) = s.put_start("c", [(key, size)])
    assert r.code == pb.KV_OK and r.replicas[0].tier == MEMORY  # puts land in memory only
    assert s.put_end("c", [key])[0].code == pb.KV_OK


def _run_moves(s: MasterState, ok: bool = True) -> list:
    """Takes this pass's jobs and reports each as the node would (copied, or failed)."""
    jobs = s.repair_jobs(16)
    for job in jobs:
        s.repair_done(job, ok)
    return jobs


def _tiers(s: MasterState, key: str) -> list[int]:
    return sorted(r.tier for r in s.objects[key].replicas)


def test_nothing_moves_below_the_demote_watermark(make_state) -> None:
    s = _state(make_state, demote_watermark=0.5)
    for i in range(3):  # 24 of 64 KiB
        _put(s, f"k{i}")
    assert _run_moves(s) == []


def test_lru_objects_get_a_disk_copy_above_the_demote_watermark(make_state) -> None:
    s = _state(make_state, demote_watermark=0.5, max_tier_moves_per_tick=2)
    for i in range(5):  # 40 of 64 KiB
        _put(s, f"k{i}")
    s.get_replicas("c", ["k0"])  # k0 is now the most recently used
    jobs = _run_moves(s)
    assert [j.key for j in jobs] == ["k1", "k2"]  # least recently used first, 2 per pass
    assert all(j.move and j.source.tier == MEMORY and j.target.tier == DISK for j in jobs)
    assert all(j.source.node_id == j.target.node_id == "n1" for j in jobs)
    assert _tiers(s, "k1") == [MEMORY, DISK] and _tiers(s, "k0") == [MEMORY]
    assert s.stats().demotions == 2 and s.stats().disk_used_bytes == 16 * KB
    # the node counts once against the replica count: nothing to repair
    assert s.under_replicated() == 0


def test_a_failed_move_frees_the_disk_range_and_the_object_keeps_its_memory_copy(
    make_state,
) -> None:
    s = _state(make_state, demote_watermark=0.5, max_tier_moves_per_tick=1)
    for i in range(5):
        _put(s, f"k{i}")
    (job,) = _run_moves(s, ok=False)
    assert _tiers(s, job.key) == [MEMORY] and s.stats().disk_used_bytes == 0
    assert not s.objects[job.key].leases  # the move's lease ended with it


def test_memory_eviction_keeps_an_object_with_a_disk_copy_and_reads_come_from_disk(
    make_state, events
) -> None:
    s = _state(make_state, demote_watermark=0.0, max_tier_moves_per_tick=16)
    for i in range(7):  # 56 of 64 KiB, below the high watermark
        _put(s, f"k{i}")
    _run_moves(s)  # every object gets its disk copy
    _put(s, "new")  # memory is full: the LRU objects lose their memory copies only
    assert _tiers(s, "k0") == [DISK]
    assert s.stats().memory_evictions >= 1 and s.stats().evictions == 0
    # the object stayed: no removal, only the memory copy's tier event
    tier_events = [e for e in events.events if e[3] == pb.KV_EVENT_REASON_TIER]
    assert (pb.KV_EVENT_STORED, "k0", 8 * KB, pb.KV_EVENT_REASON_TIER, DISK) in tier_events
    assert (pb.KV_EVENT_REMOVED, "k0", 8 * KB, pb.KV_EVENT_REASON_TIER, MEMORY) in tier_events
    assert not [e for e in events.events if e[0] == pb.KV_EVENT_REMOVED and e not in tier_events]
    (g,) = s.get_replicas("c", ["k0"])
    assert g.code == pb.KV_OK and [r.tier for r in g.replicas] == [DISK]
    assert s.longest_prefix(["k0", "k1"]) == 2


def test_a_read_of_a_disk_only_object_brings_it_back_to_memory(make_state) -> None:
    s = _state(make_state, demote_watermark=0.0, high_watermark=0.9, low_watermark=0.5)
    for i in range(4):
        _put(s, f"k{i}")
    _run_moves(s)
    s._evict(s.objects["k0"], MEMORY)  # as memory pressure would
    assert _tiers(s, "k0") == [DISK]
    (g,) = s.get_replicas("c", ["k0"])
    s.release("c", ["k0"])
    jobs = _run_moves(s)
    assert [(j.key, j.target.tier) for j in jobs if j.target.tier == MEMORY] == [("k0", MEMORY)]
    assert _tiers(s, "k0") == [MEMORY, DISK] and s.stats().promotions == 1
    (g,) = s.get_replicas("c", ["k0"])
    assert g.replicas[0].tier == MEMORY  # readers get the memory copy first


def test_a_full_disk_evicts_its_least_recently_used_copies(make_state, events) -> None:
    s = _state(make_state, disk_kb=16, demote_watermark=0.0)
    for i in range(4):
        _put(s, f"k{i}")
    _run_moves(s)  # 16 KiB of disk: only two copies fit at once
    assert s.stats().disk_used_bytes <= 16 * KB
    on_disk = [k for k in ("k0", "k1", "k2", "k3") if DISK in _tiers(s, k)]
    assert len(on_disk) == 2
    # an object with only its disk copy leaves the store when the disk evicts it
    for key in on_disk:
        s._evict(s.objects[key], MEMORY)
    _run_moves(s)  # the others move down and take the disk's room
    removed = [
        e[1]
        for e in events.events
        if e[0] == pb.KV_EVENT_REMOVED and e[3] != pb.KV_EVENT_REASON_TIER
    ]
    assert removed and set(removed) <= set(on_disk)
    assert s.stats().evictions == len(removed) and s.stats().disk_used_bytes <= 16 * KB


def test_a_restarted_node_gets_both_tiers_back(make_state, clock) -> None:
    s = _state(make_state, demote_watermark=0.0)
    for i in range(3):
        _put(s, f"k{i}")
    _run_moves(s)
    s._evict(s.objects["k0"], MEMORY)
    for _ in range(30):  # the node stops heartbeating: declared dead, its replicas dormant
        clock.advance(0.1)
        s.tick()
    assert "k0" not in s.objects and "k1" not in s.objects
    # it restarts with its segment files intact (shm for memory, a file for disk)
    s.mount("n1-seg0", "n1", 64 * KB, [], address="n1:7000", keeps_bytes=True)
    s.mount("n1-disk0", "n1", 256 * KB, [], address="n1:7000", keeps_bytes=True, tier=DISK)
    assert _tiers(s, "k0") == [DISK]
    assert _tiers(s, "k1") == [MEMORY, DISK]


def test_no_disk_tier_no_moves_and_eviction_as_before(make_state, events) -> None:
    s = make_state(inline_max_bytes=0, demote_watermark=0.0)
    s.mount("n1-seg0", "n1", 64 * KB, [], address="n1:7000")
    for i in range(9):
        _put(s, f"k{i}")
    assert _run_moves(s) == []
    assert "k0" not in s.objects and s.stats().evictions >= 1
    assert s.stats().memory_evictions == 0
