"""Eviction and housekeeping of the KV store master's state: LRU eviction between the
watermarks, and the periodic :meth:`EvictionMixin.tick` (stalls, dead nodes, TTLs, put
timeouts, dormant grace)."""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from collections.abc import Iterator

from pdserve.services.kvstore.master_config import MasterConfig
from pdserve.services.kvstore.master_types import (
    Clock,
    Counters,
    NodeState,
    ObjectState,
    SegmentState,
    on_segment,
)
from pdserve.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)


class EvictionMixin:
    """Eviction, TTLs and the housekeeping tick, for :class:`~.master_state.MasterState`.
    Uses ``_free`` and ``_delete`` of :class:`~.master_objects.ObjectsMixin`, ``_node_dead``
    of :class:`~.master_segments.SegmentsMixin` and the dormant bookkeeping and
    :meth:`flush` of :class:`~.master_persist.PersistenceMixin`."""

    cfg: MasterConfig
    clock: Clock
    segments: dict[str, SegmentState]
    nodes: dict[str, NodeState]
    objects: OrderedDict[str, ObjectState]
    pending: dict[str, ObjectState]
    counters: Counters
    _dormant_deadline: dict[str, float]
    _last_tick: float
    _ttl_heap: list[tuple[float, str]]

    # ------------------------------------------------------------------ eviction

    def _eviction_candidates(
        self, now: float, segment_id: str | None = None
    ) -> Iterator[ObjectState]:
        """Evictable objects (on ``segment_id`` when given) in eviction order: least recently
        used first, soft-pinned ones only after every other candidate; never a leased object
        (pending puts are not in ``objects`` at all). One pass over a snapshot; objects removed
        meanwhile are skipped."""
        pinned: list[ObjectState] = []
        for obj in list(self.objects.values()):
            if segment_id is not None and not on_segment(obj, segment_id):
                continue
            if obj.soft_pin:
                pinned.append(obj)
            elif self.objects.get(obj.key) is obj and not obj.leased(now):
                yield obj
        for obj in pinned:
            if self.objects.get(obj.key) is obj and not obj.leased(now):
                yield obj

    def _evict(self, obj: ObjectState) -> None:
        self._delete(obj, pb.KV_EVENT_REASON_EVICT)
        self.counters.evictions += 1

    def _evict_to_watermarks(self, now: float) -> int:
        cfg = self.cfg
        evicted = 0
        for seg in list(self.segments.values()):
            if not seg.alive or seg.capacity == 0 or seg.used <= cfg.high_watermark * seg.capacity:
                continue
            for obj in self._eviction_candidates(now, seg.segment_id):
                if seg.used <= cfg.low_watermark * seg.capacity:
                    break
                self._evict(obj)
                evicted += 1
        cap = sum(s.capacity for s in self.segments.values() if s.alive)
        if cap and self._pool_used() > cfg.high_watermark * cap:
            for obj in self._eviction_candidates(now):
                if self._pool_used() <= cfg.low_watermark * cap:
                    break
                self._evict(obj)
                evicted += 1
        return evicted

    def _pool_used(self) -> int:
        return sum(s.used for s in self.segments.values() if s.alive)

    # ------------------------------------------------------------------ housekeeping

    def tick(self) -> None:
        """Periodic pass: dead nodes, TTL expiry, put timeouts, dormant grace, watermarks."""
        now = self.clock.mono()
        stalled = now - self._last_tick - self.cfg.tick_interval_ms / 1000
        self._last_tick = now
        if stalled > self.cfg.heartbeat_interval_ms / 1000:
            # The master did not run (stopped, swapped out, a long pause): heartbeats sent
            # meanwhile were not heard. That time does not count against the nodes.
            log.warning(
                "housekeeping ran %.1fs late; not counting it as missed heartbeats", stalled
            )
            self.counters.stalls += 1
            for node in self.nodes.values():
                node.last_heartbeat = min(now, node.last_heartbeat + stalled)
        dead_after = self.cfg.heartbeat_interval_ms * self.cfg.heartbeat_miss_limit / 1000
        for node in list(self.nodes.values()):
            if now - node.last_heartbeat > dead_after:
                self._node_dead(node)
        self._expire_ttls(now)
        for key in [k for k, o in self.pending.items() if o.put_deadline <= now]:
            obj = self.pending.pop(key)
            self._free(obj)
            self.counters.put_timeouts += 1
            log.warning("put of %r by %r timed out; space reclaimed", key, obj.client_id)
        for sid in [s for s, t in self._dormant_deadline.items() if t <= now]:
            lost = self._forget_dormant(sid)
            seg = self.segments.get(sid)
            if seg is not None and not seg.alive:
                del self.segments[sid]
            log.warning(
                "segment %s did not come back within dormant_grace_s=%.0fs: dropped it and "
                "%d dormant replicas",
                sid,
                self.cfg.dormant_grace_s,
                len(lost),
            )
        self._evict_to_watermarks(now)
        self.flush()

    def _expire_ttls(self, now: float) -> None:
        """Deletes objects whose TTL ended (they are invisible from the deadline on; a leased
        one keeps its space until the lease ends)."""
        still_leased = []
        heap = self._ttl_heap
        while heap and heap[0][0] <= now:
            deadline, key = heapq.heappop(heap)
            obj = self.objects.get(key)
            if obj is None or obj.ttl_deadline != deadline:
                continue  # removed, or a newer object under the same key
            if obj.leased(now):
                still_leased.append((deadline, key))
                continue
            self._delete(obj, pb.KV_EVENT_REASON_TTL)
            self.counters.ttl_expired += 1
        for item in still_leased:
            heapq.heappush(heap, item)

    def _set_ttl(self, obj: ObjectState, deadline: float) -> None:
        obj.ttl_deadline = deadline
        if deadline:
            heapq.heappush(self._ttl_heap, (deadline, obj.key))
