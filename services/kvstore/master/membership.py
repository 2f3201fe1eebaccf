"""Segments and nodes coming and going, and what that does to the objects on them: mount
(with the restore of re-reported and dormant replicas), unmount, heartbeats (a segment a node
no longer lists is dropped) and dead nodes (their replicas go dormant).

:class:`Membership` combines the parts it is given: the segment and object tables, the
dormant replicas, the journal and the repairer, plus the facade's ``delete`` (which frees,
journals and publishes a removal). It does not flush: the facade does, once per call.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from pdserve import errors
from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.services.kvstore.master.dormant import DormantReplicas
from pdserve.services.kvstore.master.journal import Journal
from pdserve.services.kvstore.master.limits import check_id, key_problem
from pdserve.services.kvstore.master.namespaces import DROPPED
from pdserve.services.kvstore.master.objects import ObjectTable
from pdserve.services.kvstore.master.persistence import StoredObject, StoredReplica
from pdserve.services.kvstore.master.repair import Repairer
from pdserve.services.kvstore.master.segments import SegmentTable
from pdserve.services.kvstore.master.types import (
    Clock,
    Counters,
    EventSink,
    NodeState,
    ObjectState,
    ReplicaLoc,
    SegmentState,
)
from pdserve.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)

#: delete(obj, reason, free=..., persist=...): the facade's removal of a committed object.
Delete = Callable[..., None]


class Membership:
    def __init__(
        self,
        cfg: MasterConfig,
        clock: Clock,
        counters: Counters,
        *,
        objects: ObjectTable,
        segments: SegmentTable,
        dormant: DormantReplicas,
        journal: Journal,
        repairer: Repairer,
        on_event: EventSink,
        delete: Delete,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.counters = counters
        self.objects = objects
        self.segments = segments
        self.dormant = dormant
        self.journal = journal
        self.repairer = repairer
        self.on_event = on_event
        self.delete = delete

    def grace_deadline(self) -> float:
        return self.clock.mono() + self.cfg.dormant_grace_s

    def forget_dormant(self, segment_id: str) -> list[tuple[StoredObject, StoredReplica]]:
        """Takes the dormant replicas of ``segment_id`` out; a key left with no dormant
        replica and no live object loses its persisted row."""
        out, gone = self.dormant.forget(segment_id)
        for key in gone:
            if key not in self.objects and self.objects.pending(key) is None:
                self.journal.mark_deleted(key)
        return out

    # ------------------------------------------------------------------ mount

    def mount(
        self,
        segment_id: str,
        node_id: str,
        size: int,
        endpoints: Sequence[pb.Endpoint],
        held: Sequence[tuple[str, int, int]] = (),
        *,
        keeps_bytes: bool = True,
        address: str = "",
        tier: int = pb.STORAGE_TIER_MEMORY,
    ) -> int:
        """See :meth:`.state.MasterState.mount`."""
        cfg = self.cfg
        check_id(cfg, "segment.segment_id", segment_id)
        check_id(cfg, "segment.node_id", node_id)
        if size <= 0:
            raise errors.InvalidArgument(f"segment.size must be > 0, got {size}")
        if size > cfg.max_segment_bytes:
            raise errors.ResourceExhausted(
                f"segment.size {size} exceeds max_segment_bytes={cfg.max_segment_bytes}"
            )
        if len(held) > cfg.max_held_objects:
            raise errors.ResourceExhausted(
                f"{len(held)} held objects; the limit is max_held_objects={cfg.max_held_objects}"
            )
        if size < 64:
            raise errors.InvalidArgument(f"segment.size {size} is smaller than one 64-byte block")
        seg = self.segments.alive(segment_id)
        if tier not in (pb.STORAGE_TIER_MEMORY, pb.STORAGE_TIER_DISK):
            raise errors.InvalidArgument(f"segment.tier {tier} is not a storage tier")
        if seg is not None and (seg.node_id != node_id or seg.size != size or seg.tier != tier):
            raise errors.AlreadyExists(
                f"segment {segment_id!r} is already mounted by node {seg.node_id!r} with "
                f"size {seg.size} (tier {seg.tier}); unmount it first or use another segment id"
            )
        revive: list[tuple[StoredObject, StoredReplica]] = []
        if seg is not None and keeps_bytes:
            self.segments.refresh(seg, endpoints)  # idempotent remount
        else:
            if seg is not None:  # its memory was made anew: the objects are gone
                self.drop_segment(seg, pb.KV_EVENT_REASON_NODE_DEAD)
            revive = self.forget_dormant(segment_id)
            if not keeps_bytes:
                revive = []
            seg = self.segments.add(segment_id, node_id, size, endpoints, tier)
        self.segments.join(node_id, segment_id, self.clock.mono(), address)
        candidates = [
            StoredObject(k, n, False, 0, (StoredReplica(segment_id, node_id, o),))
            for k, o, n in held
        ]
        candidates += [
            dataclasses.replace(stored, replicas=(r,))
            for stored, r in revive
            if r.node_id == node_id
        ]
        restored = self._restore_all(seg, candidates)
        log.info(
            "mounted segment %s of node %s (%d bytes), restored %d replicas",
            segment_id,
            node_id,
            size,
            restored,
        )
        return restored

    def _restore_all(self, seg: SegmentState, candidates: Sequence[StoredObject]) -> int:
        """Restores the candidates' replicas (one each, on ``seg``) that are valid and fit;
        returns how many. Linear: the ranges are reserved in one pass over the allocator."""
        ok: list[StoredObject] = []
        seen: set[str] = set()
        n = 0
        for c in candidates:
            if c.key in seen:
                continue
            seen.add(c.key)
            obj = self.objects.get(c.key)
            here = (
                [] if obj is None else [r for r in obj.replicas if r.segment_id == seg.segment_id]
            )
            if here:  # already restored (an idempotent remount): fine if it is the same place
                n += here[0].offset == c.replicas[0].offset
            elif self._restorable(seg, c):
                ok.append(c)
        reserved = self.segments.reserve(seg, [(c.replicas[0].offset, c.size) for c in ok])
        mono, wall = self.clock.mono(), self.clock.wall_ms()
        for c, problem in zip(ok, reserved, strict=True):
            if problem:
                log.warning("cannot restore %r on segment %s: %s", c.key, seg.segment_id, problem)
                continue
            rep = ReplicaLoc(seg.segment_id, seg.node_id, c.replicas[0].offset, tier=seg.tier)
            obj = self.objects.get(c.key)
            if obj is None:
                ttl = mono + (c.ttl_deadline_ms - wall) / 1000 if c.ttl_deadline_ms else 0.0
                ns = self.objects.namespaces.get(c.root) if c.root else None  # None: unknown
                obj = ObjectState(
                    c.key, c.size, [rep], soft_pin=c.soft_pin, checksum=c.checksum, ns=ns
                )
                self.objects.restore(obj, ttl)  # restored objects are the coldest
                self.on_event(pb.KV_EVENT_STORED, c.key, c.size, pb.KV_EVENT_REASON_UNSPECIFIED)
            else:
                self.objects.add_replica(obj, rep)
            self.journal.mark(obj)
            n += 1
        return n

    def _restorable(self, seg: SegmentState, c: StoredObject) -> bool:
        """Whether candidate ``c`` may get its replica back on ``seg`` (before allocation)."""
        if key_problem(self.cfg, c.key) or c.size <= 0 or c.size > self.cfg.max_object_bytes:
            log.warning("segment %s re-reported an invalid object %r", seg.segment_id, c.key)
            return False
        if self.objects.pending(c.key) is not None:
            return False
        obj = self.objects.get(c.key)
        if obj is None:
            if c.key in self.objects.namespaces.tombstones:
                log.warning("segment %s re-reported %r, which was dropped", seg.segment_id, c.key)
                return False
            return True
        if obj.size != c.size or (c.checksum and obj.checksum and c.checksum != obj.checksum):
            log.warning("%r on segment %s differs from the committed object", c.key, seg.segment_id)
            return False
        # one copy per node and tier (a node's memory and disk copies are both welcome back)
        return not any(r.node_id == seg.node_id and r.tier == seg.tier for r in obj.replicas)

    # ------------------------------------------------------------------ leaving

    def unmount(self, segment_id: str) -> int:
        """See :meth:`.state.MasterState.unmount`."""
        check_id(self.cfg, "segment_id", segment_id)
        seg = self.segments.alive(segment_id)
        if seg is None:
            raise errors.NotFound(f"segment {segment_id!r} is not mounted")
        removed = self.drop_segment(seg, pb.KV_EVENT_REASON_UNMOUNT)
        self.forget_dormant(segment_id)
        self.segments.remove(segment_id)
        self.segments.leave(seg.node_id, segment_id)
        return removed

    def drop_segment(self, seg: SegmentState, reason: int, *, dormant: bool = False) -> int:
        """Drops every replica (committed and pending) in ``seg`` and marks it dead; returns
        how many objects lost their last live replica. ``dormant``: remember the committed
        replicas until the segment remounts or its grace ends (a node presumed dead)."""
        removed = 0
        mono, wall = self.clock.mono(), self.clock.wall_ms()
        deadline = self.grace_deadline()
        for obj in self.objects.on_segment(seg.segment_id):
            mine = self.objects.strip_segment(obj, seg.segment_id)
            if dormant and obj.ns is not DROPPED:  # a dropped object is not remembered
                ttl_ms = int(wall + (obj.ttl_deadline - mono) * 1000) if obj.ttl_deadline else 0
                reps = tuple(StoredReplica(r.segment_id, r.node_id, r.offset) for r in mine)
                root = obj.ns.root if obj.ns is not None else ""
                stored = StoredObject(
                    obj.key, obj.size, obj.soft_pin, ttl_ms, reps, obj.checksum, root
                )
                self.dormant.add(stored, deadline)
            if obj.replicas:
                self.journal.mark(obj)
                self.repairer.want(obj)
            else:
                # A dormant object keeps its persisted row (it lists the dormant replicas).
                self.delete(obj, reason, free=False, persist=not dormant)
                removed += 1
        self.objects.strip_pending(seg.segment_id)
        self.segments.kill(seg)
        return removed

    def heartbeat(self, node_id: str, segment_ids: Sequence[str]) -> bool:
        """See :meth:`.state.MasterState.heartbeat`."""
        check_id(self.cfg, "node_id", node_id)
        node = self.segments.beat(node_id, self.clock.mono())
        if node is None:
            return True
        listed = set(segment_ids)
        stale = node.segment_ids - listed
        if stale and listed:
            for sid in sorted(stale):
                seg = self.segments.remove(sid)
                self.segments.leave(node_id, sid, forget_empty=False)
                self.forget_dormant(sid)
                if seg is not None and seg.alive:
                    n = self.drop_segment(seg, pb.KV_EVENT_REASON_NODE_DEAD)
                    log.warning(
                        "node %s no longer reports segment %s: dropped (%d objects lost)",
                        node_id,
                        sid,
                        n,
                    )
        for sid in listed:
            seg = self.segments.alive(sid)
            if seg is None or seg.node_id != node_id:
                return True
        return False

    def node_dead(self, node: NodeState) -> None:
        """``node`` missed its heartbeats: its replicas go dormant."""
        removed = 0
        deadline = self.grace_deadline()
        for sid in sorted(node.segment_ids):
            seg = self.segments.alive(sid)
            if seg is not None:
                removed += self.drop_segment(seg, pb.KV_EVENT_REASON_NODE_DEAD, dormant=True)
                self.dormant.hold_until(sid, deadline)
        self.segments.forget_node(node.node_id)
        self.counters.node_deaths += 1
        self.counters.node_dead_objects += removed
        log.warning(
            "node %s missed its heartbeats: declared dead; %d objects lost their last live "
            "replica (dormant until it remounts)",
            node.node_id,
            removed,
        )

    def expire_dormant(self, now: float) -> None:
        """Drops the dormant replicas (and the dead segments) whose grace ended."""
        for sid in self.dormant.due(now):
            lost = self.forget_dormant(sid)
            self.segments.remove_dead(sid)
            log.warning(
                "segment %s did not come back within dormant_grace_s=%.0fs: dropped it and "
                "%d dormant replicas",
                sid,
                self.cfg.dormant_grace_s,
                len(lost),
            )
