"""The master's :class:`~.types.StoreStats` (``StatsResponse``) from its parts' state."""

from __future__ import annotations

from pdserve.services.kvstore.master.namespaces import NamespaceTable
from pdserve.services.kvstore.master.objects import ObjectTable
from pdserve.services.kvstore.master.segments import SegmentTable
from pdserve.services.kvstore.master.types import Counters, SegmentStats, StoreStats
from pdserve.v1 import kvstore_pb2 as pb


def store_stats(
    objects: ObjectTable, segments: SegmentTable, c: Counters, namespaces: NamespaceTable
) -> StoreStats:
    """Pool-wide counters and each segment's capacity and use, now."""
    return StoreStats(
        objects=len(objects),
        used_bytes=objects.used_bytes,
        capacity_bytes=segments.capacity(),
        segments=tuple(
            SegmentStats(
                segment_id=s.segment_id,
                node_id=s.node_id,
                capacity=s.capacity,
                used=s.used,
                alive=s.alive,
                tier=s.tier,
            )
            for s in segments.values()
        ),
        puts=c.puts,
        gets=c.gets,
        get_hits=c.get_hits,
        evictions=c.evictions,
        removals=c.removals,
        prefix_queries=c.prefix_queries,
        prefix_hit_keys=c.prefix_hit_keys,
        alive_nodes=segments.alive_nodes(),
        demotions=c.demotions,
        promotions=c.promotions,
        memory_evictions=c.memory_evictions,
        disk_capacity_bytes=segments.capacity(pb.STORAGE_TIER_DISK),
        disk_used_bytes=segments.used(pb.STORAGE_TIER_DISK),
        dropped_objects=c.dropped_objects,
        quarantined_fingerprints=len(namespaces.quarantined()),
        quarantined_misses=c.quarantined_misses,
    )
