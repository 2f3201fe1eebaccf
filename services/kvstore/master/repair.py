"""The master's repairer: an object that lost a replica (its node was declared dead, or
dropped a segment) while keeping at least one gets a new copy on another node, in the
background.

The repairer hands out jobs (source replica, newly allocated target) a few per pass; the
master asks the target's node to make the copy (``KVNodeService.CopyReplica``: the node reads
the source over the data plane and writes its own segment; no payload passes through the
master) and reports each job done. The object is read-leased by the repairer for the copy, so
it is neither removed nor evicted under it. A target whose copy failed is freed and the object
queued again; a replica that comes back (a dormant one reviving) makes the object whole again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.services.kvstore.master.objects import ObjectTable
from pdserve.services.kvstore.master.segments import SegmentTable
from pdserve.services.kvstore.master.types import (
    Clock,
    Counters,
    ObjectState,
    ReplicaLoc,
    SegmentState,
)
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
    #: A move between one node's tiers (:mod:`.tiers`), not a new copy on another node.
    move: bool = False


class Repairer:
    """Under-replicated objects and their repair jobs."""

    def __init__(
        self, objects: ObjectTable, segments: SegmentTable, clock: Clock, counters: Counters
    ) -> None:
        self.objects = objects
        self.segments = segments
        self.clock = clock
        self.counters = counters
        self._queue: deque[str] = deque()
        self._queued: set[str] = set()
        self._running: dict[str, RepairJob] = {}

    def want(self, obj: ObjectState) -> None:
        """Queues ``obj`` when it has fewer live replicas than its put asked for."""
        if obj.replicas and len(obj.nodes()) < obj.want and obj.key not in self._queued:
            self._queue.append(obj.key)
            self._queued.add(obj.key)

    def under_replicated(self) -> int:
        return len(self._queued) + len(self._running)

    def jobs(self, limit: int) -> list[RepairJob]:
        """Up to ``limit`` copies to make, each with its target allocated (on a live node that
        holds no copy yet and that mounted with its address, so it can be asked to copy) and
        its object leased. An object no node can take yet stays queued."""
        jobs: list[RepairJob] = []
        now = self.clock.mono()
        waiting = []
        strategy = self.segments.strategy(pb.PLACEMENT_UNSPECIFIED)
        assert strategy is not None
        unaddressed = self.segments.unaddressed()
        while self._queue and len(jobs) < limit:
            key = self._queue.popleft()
            self._queued.discard(key)
            obj = self.objects.get(key)
            if obj is None or key in self._running or len(obj.nodes()) >= obj.want:
                continue
            held = obj.nodes()
            placed = self.segments.try_place(strategy, obj.size, 1, held | unaddressed)
            if placed is None:
                waiting.append(key)
                continue
            target = placed[0]
            self.objects.lease(obj, REPAIRER, now + REPAIR_LEASE_S)
            segment = self.segments[target.segment_id]
            job = RepairJob(key, obj.size, obj.replicas[0], target, obj, segment)
            self._running[key] = job
            jobs.append(job)
        for key in waiting:
            self._queue.append(key)
            self._queued.add(key)
        return jobs

    def done(self, job: RepairJob, ok: bool) -> bool:
        """Records a copy's outcome; True when the target became a replica (the caller
        journals the object)."""
        self._running.pop(job.key, None)
        self.objects.unlease(job.obj, REPAIRER)
        seg = job.segment
        live = self.objects.get(job.key) is job.obj
        usable = self.segments.is_current(seg)
        held = {r.node_id for r in job.obj.replicas}
        if ok and live and usable and job.target.node_id not in held:
            self.objects.add_replica(job.obj, job.target)
            self.counters.repairs += 1
            return True
        if not ok:
            self.counters.repair_failures += 1
        if usable:
            self.segments.free([job.target])
        if live:
            self.want(job.obj)
        return False
