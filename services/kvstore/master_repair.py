"""Re-replication: an object that lost a replica (its node was declared dead, or dropped a
segment) while keeping at least one gets a new copy on another node, in the background.

The master hands out repair jobs (source replica, newly allocated target) a few per pass;
the master process copies the bytes (the only time payload passes through it) and reports
each job done. The object is read-leased by the repairer for the copy, so it is neither
removed nor evicted under it. A target whose copy failed is freed and the object queued again;
a replica that comes back (a dormant one reviving) simply makes the object whole again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.services.kvstore.master_types import (
    Clock,
    Counters,
    ObjectState,
    ReplicaLoc,
    SegmentState,
)
from pdserve.services.kvstore.placement import PlacementStrategy
from pdserve.v1 import kvstore_pb2 as pb

#: The lease holder name of repair copies.
REPAIRER = "master-repair"
#: How long a repair copy may take before its lease ends (seconds).
REPAIR_LEASE_S = 60.0


@dataclass(frozen=True)
class RepairJob:
    key: str
    size: int
    source: ReplicaLoc
    target: ReplicaLoc
    obj: ObjectState
    #: The segment the target was allocated in (a remount replaces it, and its allocator).
    segment: SegmentState


class RepairMixin:
    """Under-replicated objects and their repair jobs (part of MasterState)."""

    objects: dict[str, ObjectState]
    segments: dict[str, SegmentState]
    clock: Clock
    counters: Counters
    strategies: dict[int, PlacementStrategy]
    # and PersistenceMixin's _mark and flush, ObjectsMixin's _try_place

    def _init_repair(self) -> None:
        self._repair_queue: deque[str] = deque()
        self._repair_queued: set[str] = set()
        self._repairing: dict[str, RepairJob] = {}

    def _want_repair(self, obj: ObjectState) -> None:
        """Queues ``obj`` when it has fewer live replicas than its put asked for."""
        if obj.replicas and len(obj.replicas) < obj.want and obj.key not in self._repair_queued:
            self._repair_queue.append(obj.key)
            self._repair_queued.add(obj.key)

    def under_replicated(self) -> int:
        return len(self._repair_queued) + len(self._repairing)

    def repair_jobs(self, limit: int) -> list[RepairJob]:
        """Up to ``limit`` copies to make, each with its target allocated (on a live node that
        holds no copy yet) and its object leased. An object no node can take yet stays
        queued."""
        jobs: list[RepairJob] = []
        now = self.clock.mono()
        waiting = []
        while self._repair_queue and len(jobs) < limit:
            key = self._repair_queue.popleft()
            self._repair_queued.discard(key)
            obj = self.objects.get(key)
            if obj is None or key in self._repairing or len(obj.replicas) >= obj.want:
                continue
            held = {r.node_id for r in obj.replicas}
            placed = self._try_place(self.strategies[pb.PLACEMENT_UNSPECIFIED], obj.size, 1, held)
            if placed is None:
                waiting.append(key)
                continue
            target = placed[0]
            obj.leases[REPAIRER] = now + REPAIR_LEASE_S
            segment = self.segments[target.segment_id]
            job = RepairJob(key, obj.size, obj.replicas[0], target, obj, segment)
            self._repairing[key] = job
            jobs.append(job)
        for key in waiting:
            self._repair_queue.append(key)
            self._repair_queued.add(key)
        return jobs

    def repair_done(self, job: RepairJob, ok: bool) -> bool:
        """Records a copy's outcome; True when the target became a replica."""
        self._repairing.pop(job.key, None)
        job.obj.leases.pop(REPAIRER, None)
        seg = job.segment
        live = self.objects.get(job.key) is job.obj
        usable = self.segments.get(seg.segment_id) is seg and seg.alive
        held = {r.node_id for r in job.obj.replicas}
        if ok and live and usable and job.target.node_id not in held:
            job.obj.replicas.append(job.target)
            self.counters.repairs += 1
            self._mark(job.obj)
            self.flush()
            return True
        if usable:
            seg.allocator.release(job.target.offset)
        if live:
            self._want_repair(job.obj)
        return False
