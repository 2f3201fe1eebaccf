"""The evictor on its own: LRU order, soft pins last, leased objects never, watermarks."""

from __future__ import annotations

from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.services.kvstore.master.eviction import Evictor
from pdserve.services.kvstore.master.objects import ObjectTable
from pdserve.services.kvstore.master.segments import SegmentTable
from pdserve.services.kvstore.master.types import Counters, ObjectState
from pdserve.v1 import kvstore_pb2 as pb


def _parts(**overrides):
    cfg = MasterConfig(**overrides)
    objects, segments = ObjectTable(cfg, Counters()), SegmentTable(placement_seed=1)
    evicted: list[str] = []

    def evict(obj: ObjectState, _tier: int = 0) -> None:
        segments.free(obj.replicas)
        objects.drop(obj)
        evicted.append(obj.key)

    segments.add("s1", "n1", 64 * 1024, [])
    segments.join("n1", "s1", 0.0)
    return cfg, objects, segments, Evictor(cfg, objects, segments, evict), evicted


def _commit(objects, segments, key: str, size: int = 4096, **kw) -> ObjectState:
    strategy = segments.strategy(pb.PLACEMENT_UNSPECIFIED)
    obj = ObjectState(key, size, segments.try_place(strategy, size, 1), **kw)
    objects.commit(obj, now=0.0)
    return obj


def test_candidates_are_lru_first_soft_pins_last_and_never_leased() -> None:
    _cfg, objects, segments, evictor, _ = _parts()
    for key in ("pinned", "a", "leased", "b"):
        _commit(objects, segments, key, soft_pin=key == "pinned")
    objects.lease(objects["leased"], "reader", until=100.0)
    objects.touch(["a"])  # most recently used now
    assert [o.key for o in evictor.candidates(now=1.0)] == ["b", "a", "pinned"]


def test_make_room_evicts_until_the_placement_fits() -> None:
    _cfg, objects, segments, evictor, evicted = _parts()
    for i in range(16):  # fills the 64 KiB segment
        _commit(objects, segments, f"k{i}")
    strategy = segments.strategy(pb.PLACEMENT_UNSPECIFIED)
    locs = evictor.make_room(strategy, 8192, 1, now=1.0)
    assert locs is not None and evicted == ["k0", "k1"]


def test_to_watermarks_evicts_down_to_the_low_watermark() -> None:
    _cfg, objects, segments, evictor, evicted = _parts(high_watermark=0.5, low_watermark=0.25)
    for i in range(12):  # 48 KiB of 64: above the high watermark
        _commit(objects, segments, f"k{i}")
    assert evictor.to_watermarks(now=1.0) == 8
    assert segments.used() <= 0.25 * segments.capacity() and evicted[0] == "k0"
