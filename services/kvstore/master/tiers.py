"""The master's tier mover: copies between a node's memory and its disk segment (the tier
below memory), in the background, as LMCache's local-disk backend and Mooncake Store's SSD
offload keep a second tier under DRAM.

* **Down** (demotion): when a node's memory segments pass ``demote_watermark``, its least
  recently used objects that have no disk copy yet get one on the node's disk segment (which
  evicts its own least recently used copies when it is full). Memory eviction then drops only
  the memory copy of an object that has a disk copy: the object stays in the store, readable
  from disk. Copying ahead of eviction keeps the copy off the put path: a put that needs room
  frees it by dropping memory copies, never by waiting for a disk write.
* **Up** (promotion): an object read while only disk copies hold it gets a memory copy again
  on the same node (when the node's memory has room without evicting), so the next reads
  are memory reads.

Each move is a :class:`~.repair.RepairJob` that the re-replication loop runs like a repair
(``KVNodeService.CopyReplica``; the source and the target are on the same node, so the node
copies locally, and flushes a disk target before it answers). The object is leased for the
move, so it is neither removed nor evicted under it; the new copy becomes a replica only when
the node reports the copy done. Replicas on one node's two tiers count as one node's against
the replica count a put asked for.
"""

from __future__ import annotations

from collections import OrderedDict

from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.services.kvstore.master.eviction import DISK, MEMORY, Evictor
from pdserve.services.kvstore.master.objects import ObjectTable
from pdserve.services.kvstore.master.repair import REPAIR_LEASE_S, RepairJob
from pdserve.services.kvstore.master.segments import SegmentTable
from pdserve.services.kvstore.master.types import Clock, Counters, ObjectState, ReplicaLoc

#: The lease holder name of tier moves.
MOVER = "master-tiers"
#: Most keys waiting for a promotion (older wishes are dropped first).
MAX_WANTED = 65536


class Tierer:
    """Demotions and promotions between memory and disk segments."""

    def __init__(
        self,
        cfg: MasterConfig,
        objects: ObjectTable,
        segments: SegmentTable,
        evictor: Evictor,
        clock: Clock,
        counters: Counters,
    ) -> None:
        self.cfg = cfg
        self.objects = objects
        self.segments = segments
        self.evictor = evictor
        self.clock = clock
        self.counters = counters
        self._wanted: OrderedDict[str, None] = OrderedDict()
        self._running: dict[str, RepairJob] = {}

    def read(self, obj: ObjectState) -> None:
        """A reader was handed ``obj``: wanted back in memory when only disk copies hold it."""
        if obj.replicas and not obj.in_memory():
            self._wanted[obj.key] = None
            self._wanted.move_to_end(obj.key)
            if len(self._wanted) > MAX_WANTED:
                self._wanted.popitem(last=False)

    def jobs(self, limit: int) -> list[RepairJob]:
        """Up to ``limit`` moves, promotions first (a reader asked for those), each with its
        target allocated and its object leased."""
        if limit <= 0 or not self.segments.live(DISK):
            return []
        now = self.clock.mono()
        out: list[RepairJob] = []
        while self._wanted and len(out) < limit:
            key, _ = self._wanted.popitem(last=False)
            obj = self.objects.get(key)
            if obj is None or key in self._running or obj.in_memory():
                continue
            job = self._promotion(obj, now)
            if job is not None:
                out.append(job)
        for disk in self.segments.live(DISK):
            if len(out) >= limit:
                break
            out += self._demotions(disk.node_id, limit - len(out), now)
        return out

    def _promotion(self, obj: ObjectState, now: float) -> RepairJob | None:
        for src in obj.replicas:
            for seg in self.segments.live(MEMORY):
                if seg.node_id != src.node_id:
                    continue
                target = self.segments.place_in(seg, obj.size)
                if target is not None:
                    return self._start(obj, src, target, now)
        return None

    def _demotions(self, node_id: str, limit: int, now: float) -> list[RepairJob]:
        memory = [s for s in self.segments.live(MEMORY) if s.node_id == node_id]
        capacity = sum(s.capacity for s in memory)
        if not capacity or sum(s.used for s in memory) <= self.cfg.demote_watermark * capacity:
            return []
        disk = self.segments.disk_of(node_id)
        out: list[RepairJob] = []
        for obj in self.objects.lru():
            if len(out) >= limit or disk is None:
                break
            if obj.key in self._running or obj.on_disk() or obj.inline or obj.leased(now):
                continue
            src = next((r for r in obj.replicas if r.node_id == node_id), None)
            if src is None:
                continue
            target = self.evictor.room_in(disk, obj.size, now)
            if target is None:
                break
            out.append(self._start(obj, src, target, now))
            disk = self.segments.disk_of(node_id)
        return out

    def _start(
        self, obj: ObjectState, src: ReplicaLoc, target: ReplicaLoc, now: float
    ) -> RepairJob:
        self.objects.lease(obj, MOVER, now + REPAIR_LEASE_S)
        job = RepairJob(
            obj.key, obj.size, src, target, obj, self.segments[target.segment_id], move=True
        )
        self._running[obj.key] = job
        return job

    def done(self, job: RepairJob, ok: bool) -> bool:
        """Records a move's outcome; True when the target became a replica (the caller
        journals the object)."""
        self._running.pop(job.key, None)
        self.objects.unlease(job.obj, MOVER)
        live = self.objects.get(job.key) is job.obj
        usable = self.segments.is_current(job.segment)
        tier = job.target.tier
        there = any(r.node_id == job.target.node_id and r.tier == tier for r in job.obj.replicas)
        if ok and live and usable and not there:
            self.objects.add_replica(job.obj, job.target)
            if tier == DISK:
                self.counters.demotions += 1
            else:
                self.counters.promotions += 1
            return True
        if not ok:
            self.counters.tier_move_failures += 1
        if usable:
            self.segments.free([job.target])
        return False


__all__ = ["MEMORY", "MOVER", "Tierer"]
