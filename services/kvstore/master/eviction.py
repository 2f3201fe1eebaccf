"""The master's evictor: which committed objects go when space runs short, as Mooncake's
master hands eviction to its own strategy object.

Idle fingerprints' objects first (a model fingerprint with no put and no hit for
``idle_fingerprint_s``: no live worker serves it, :mod:`.namespaces`), then LRU (last put end,
get or prefix hit), soft-pinned objects only after every other candidate, never a leased one
(pending puts are not candidates at all). With tenant shares (:mod:`.quotas`), objects of
tenants over their share come before all of these, and pinned objects (:mod:`.pins`) are no
candidates. It evicts on demand, when an
allocation fails, and between the watermarks, when a segment or a tier's pool passes
``high_watermark`` (down to ``low_watermark``). Each tier is evicted on its own: memory when
memory runs short, a node's disk segment when it does. It reads the object and segment tables
and evicts through the ``evict(obj, tier)`` callable it is given (the facade's: an object with
a copy in the other tier only loses its copies in ``tier``; otherwise it leaves the store:
the space is freed, the removal journaled and the event published).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.services.kvstore.master.objects import ObjectTable
from pdserve.services.kvstore.master.placement import PlacementStrategy
from pdserve.services.kvstore.master.segments import SegmentTable
from pdserve.services.kvstore.master.types import ObjectState, ReplicaLoc, SegmentState
from pdserve.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    from pdserve.services.kvstore.master.quotas import Quotas

MEMORY = pb.STORAGE_TIER_MEMORY
DISK = pb.STORAGE_TIER_DISK


class Evictor:
    def __init__(
        self,
        cfg: MasterConfig,
        objects: ObjectTable,
        segments: SegmentTable,
        evict: Callable[[ObjectState, int], None],
        quotas: Quotas | None = None,
    ) -> None:
        self.cfg = cfg
        self.objects = objects
        self.segments = segments
        self._evict = evict
        self.quotas = quotas

    def evict(self, obj: ObjectState, tier: int) -> None:
        """Evicts ``obj``'s copies in ``tier`` (counted for its tenant)."""
        if self.quotas is not None:
            self.quotas.evicted(obj, tier)
        self._evict(obj, tier)

    def candidates(
        self, now: float, segment_id: str | None = None, tier: int = MEMORY
    ) -> Iterator[ObjectState]:
        """Evictable objects with a copy on ``segment_id`` (when given; ``tier`` is then
        its tier) or else in ``tier``, in eviction order: over-share tenants' objects first
        (:meth:`.quotas.Quotas.order`, without pinned ones), then idle fingerprints' objects
        (least recently used first), then the others', then the soft-pinned ones."""
        if self.quotas is None:
            return self._lru_order(now, segment_id, tier)
        if segment_id is not None:
            tier = self.segments[segment_id].tier
        base = self._lru_order(now, segment_id, tier, check=False)
        return self.quotas.order(
            base, tier, lambda o: self._evictable(o, now), whole_tier=segment_id is None
        )

    def _lru_order(
        self, now: float, segment_id: str | None, tier: int, check: bool = True
    ) -> Iterator[ObjectState]:
        """:meth:`candidates` without tenants: one pass over a snapshot; objects removed
        meanwhile are skipped (not checked with ``check`` False: every object with a copy
        there, leased ones too)."""
        idle = self.objects.namespaces.idle(now)
        pinned: list[ObjectState] = []
        busy: list[ObjectState] = []
        for obj in self.objects.lru():
            if segment_id is not None:
                if not any(r.segment_id == segment_id for r in obj.replicas):
                    continue
            elif not any(r.tier == tier for r in obj.replicas):
                continue
            if obj.soft_pin:
                pinned.append(obj)
            elif idle and obj.ns in idle:
                if not check or self._evictable(obj, now):
                    yield obj
            else:
                busy.append(obj)
        for obj in busy + pinned:
            if not check or self._evictable(obj, now):
                yield obj

    def _evictable(self, obj: ObjectState, now: float) -> bool:
        return self.objects.get(obj.key) is obj and not obj.leased(now)

    def make_room(
        self, strategy: PlacementStrategy, size: int, n_rep: int, now: float
    ) -> list[ReplicaLoc] | None:
        """``n_rep`` new ranges of ``size`` bytes on distinct nodes (as
        :meth:`.segments.SegmentTable.try_place`), evicting in LRU order (at most
        ``max_evictions_per_alloc`` objects) until they fit; None when they never do."""
        locs = self.segments.try_place(strategy, size, n_rep)
        if locs is not None:
            return locs
        victims = self.candidates(now)
        for _ in range(self.cfg.max_evictions_per_alloc):
            victim = next(victims, None)
            if victim is None:
                return None
            self.evict(victim, MEMORY)
            locs = self.segments.try_place(strategy, size, n_rep)
            if locs is not None:
                return locs
        return None

    def room_in(self, seg: SegmentState, size: int, now: float) -> ReplicaLoc | None:
        """A new range of ``size`` bytes in ``seg``, evicting its copies in LRU order (at
        most ``max_evictions_per_alloc``) until one fits; None when it never does."""
        loc = self.segments.place_in(seg, size)
        victims = self.candidates(now, seg.segment_id)
        for _ in range(self.cfg.max_evictions_per_alloc):
            if loc is not None:
                return loc
            victim = next(victims, None)
            if victim is None:
                return None
            self.evict(victim, seg.tier)
            loc = self.segments.place_in(seg, size)
        return loc

    def to_watermarks(self, now: float) -> int:
        """Evicts every segment, then each tier's pool, above the high watermark down to the
        low one; returns how many copies went."""
        cfg = self.cfg
        evicted = 0
        for seg in self.segments.live(None):
            if seg.capacity == 0 or seg.used <= cfg.high_watermark * seg.capacity:
                continue
            for obj in self.candidates(now, seg.segment_id):
                if seg.used <= cfg.low_watermark * seg.capacity:
                    break
                self.evict(obj, seg.tier)
                evicted += 1
        for tier in (MEMORY, DISK):
            cap = self.segments.capacity(tier)
            if cap and self.segments.used(tier) > cfg.high_watermark * cap:
                for obj in self.candidates(now, tier=tier):
                    if self.segments.used(tier) <= cfg.low_watermark * cap:
                        break
                    self.evict(obj, tier)
                    evicted += 1
        return evicted
