"""Segments and nodes of the KV store master's state: mount (with the restore of re-reported
and dormant replicas), unmount, heartbeats and dead nodes."""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Sequence

from pdserve import errors
from pdserve.services.kvstore.allocator import OffsetAllocator
from pdserve.services.kvstore.master_config import MasterConfig
from pdserve.services.kvstore.master_types import (
    Clock,
    Counters,
    EventSink,
    NodeState,
    ObjectState,
    ReplicaLoc,
    SegmentState,
    on_segment,
)
from pdserve.services.kvstore.persistence import StoredObject, StoredReplica
from pdserve.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)


class SegmentsMixin:
    """Segment and node lifecycle, for :class:`~.master_state.MasterState`. Uses its
    validation helpers, the dormant bookkeeping and :meth:`flush` of
    :class:`~.master_persist.PersistenceMixin`, ``_delete`` of
    :class:`~.master_objects.ObjectsMixin` and ``_set_ttl`` of
    :class:`~.master_eviction.EvictionMixin`."""

    cfg: MasterConfig
    clock: Clock
    on_event: EventSink
    segments: dict[str, SegmentState]
    nodes: dict[str, NodeState]
    objects: OrderedDict[str, ObjectState]
    pending: dict[str, ObjectState]
    counters: Counters
    used_bytes: int
    _dormant_deadline: dict[str, float]

    def mount(
        self,
        segment_id: str,
        node_id: str,
        size: int,
        endpoints: Sequence[pb.Endpoint],
        held: Sequence[tuple[str, int, int]] = (),
        *,
        keeps_bytes: bool = True,
    ) -> int:
        """Mounts (or idempotently remounts) a segment; returns how many replicas of ``held``
        and of dormant objects were restored on it. ``keeps_bytes`` False says the segment's
        memory is new (zeroed): nothing remembered on it survives."""
        self._check_id("segment.segment_id", segment_id)
        self._check_id("segment.node_id", node_id)
        if size <= 0:
            raise errors.InvalidArgument(f"segment.size must be > 0, got {size}")
        if size > self.cfg.max_segment_bytes:
            raise errors.ResourceExhausted(
                f"segment.size {size} exceeds max_segment_bytes={self.cfg.max_segment_bytes}"
            )
        if len(held) > self.cfg.max_held_objects:
            raise errors.ResourceExhausted(
                f"{len(held)} held objects; the limit is max_held_objects="
                f"{self.cfg.max_held_objects}"
            )
        if size < 64:
            raise errors.InvalidArgument(f"segment.size {size} is smaller than one 64-byte block")
        now = self.clock.mono()
        seg = self.segments.get(segment_id)
        if seg is not None and seg.alive and (seg.node_id != node_id or seg.size != size):
            raise errors.AlreadyExists(
                f"segment {segment_id!r} is already mounted by node {seg.node_id!r} with "
                f"size {seg.size}; unmount it first or use another segment id"
            )
        revive: list[tuple[StoredObject, StoredReplica]] = []
        if seg is not None and seg.alive and keeps_bytes:
            seg.endpoints = list(endpoints)  # idempotent remount: refresh the endpoints
        else:
            if seg is not None and seg.alive:  # its memory was made anew: the objects are gone
                self._drop_segment(seg, pb.KV_EVENT_REASON_NODE_DEAD)
            revive = self._forget_dormant(segment_id)
            if not keeps_bytes:
                revive = []
            seg = SegmentState(segment_id, node_id, size, list(endpoints), OffsetAllocator(size))
            self.segments[segment_id] = seg
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeState(node_id, now)
        node.last_heartbeat = now
        node.segment_ids.add(segment_id)
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
        self.flush()
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
        reserved = seg.allocator.reserve_many([(c.replicas[0].offset, c.size) for c in ok])
        mono, wall = self.clock.mono(), self.clock.wall_ms()
        for c, problem in zip(ok, reserved, strict=True):
            if problem:
                log.warning("cannot restore %r on segment %s: %s", c.key, seg.segment_id, problem)
                continue
            rep = ReplicaLoc(seg.segment_id, seg.node_id, c.replicas[0].offset)
            obj = self.objects.get(c.key)
            if obj is None:
                ttl = mono + (c.ttl_deadline_ms - wall) / 1000 if c.ttl_deadline_ms else 0.0
                obj = ObjectState(c.key, c.size, [rep], soft_pin=c.soft_pin, checksum=c.checksum)
                self._set_ttl(obj, ttl)
                self.objects[c.key] = obj
                self.objects.move_to_end(c.key, last=False)  # restored objects are the coldest
                self.used_bytes += c.size
                self.on_event(pb.KV_EVENT_STORED, c.key, c.size, pb.KV_EVENT_REASON_UNSPECIFIED)
            else:
                obj.replicas.append(rep)
            self._mark(obj)
            n += 1
        return n

    def _restorable(self, seg: SegmentState, c: StoredObject) -> bool:
        """Whether candidate ``c`` may get its replica back on ``seg`` (before allocation)."""
        if self.key_problem(c.key) or c.size <= 0 or c.size > self.cfg.max_object_bytes:
            log.warning("segment %s re-reported an invalid object %r", seg.segment_id, c.key)
            return False
        if c.key in self.pending:
            return False
        obj = self.objects.get(c.key)
        if obj is None:
            return True
        if obj.size != c.size or (c.checksum and obj.checksum and c.checksum != obj.checksum):
            log.warning("%r on segment %s differs from the committed object", c.key, seg.segment_id)
            return False
        return not any(r.node_id == seg.node_id for r in obj.replicas)

    def unmount(self, segment_id: str) -> int:
        """Removes a segment and every replica in it; returns how many objects lost their last
        replica (deleted, event reason ``KV_EVENT_REASON_UNMOUNT``)."""
        self._check_id("segment_id", segment_id)
        seg = self.segments.get(segment_id)
        if seg is None or not seg.alive:
            raise errors.NotFound(f"segment {segment_id!r} is not mounted")
        removed = self._drop_segment(seg, pb.KV_EVENT_REASON_UNMOUNT)
        self._forget_dormant(segment_id)
        del self.segments[segment_id]
        node = self.nodes.get(seg.node_id)
        if node is not None:
            node.segment_ids.discard(segment_id)
            if not node.segment_ids:
                del self.nodes[seg.node_id]
        self.flush()
        return removed

    def _drop_segment(self, seg: SegmentState, reason: int, *, dormant: bool = False) -> int:
        """Drops every replica (committed and pending) in ``seg`` and marks it dead; returns
        how many objects lost their last live replica. ``dormant``: remember the committed
        replicas until the segment remounts or its grace ends (a node presumed dead)."""
        seg.alive = False
        removed = 0
        mono, wall = self.clock.mono(), self.clock.wall_ms()
        for key in [k for k, o in self.objects.items() if on_segment(o, seg.segment_id)]:
            obj = self.objects[key]
            mine = [r for r in obj.replicas if r.segment_id == seg.segment_id]
            obj.replicas = [r for r in obj.replicas if r.segment_id != seg.segment_id]
            if dormant:
                ttl_ms = int(wall + (obj.ttl_deadline - mono) * 1000) if obj.ttl_deadline else 0
                reps = tuple(StoredReplica(r.segment_id, r.node_id, r.offset) for r in mine)
                self._add_dormant(
                    StoredObject(key, obj.size, obj.soft_pin, ttl_ms, reps, obj.checksum)
                )
            if obj.replicas:
                self._mark(obj)
                self._want_repair(obj)
            else:
                # A dormant object keeps its persisted row (it lists the dormant replicas).
                self._delete(obj, reason, free=False, persist=not dormant)
                removed += 1
        for obj in self.pending.values():
            obj.replicas = [r for r in obj.replicas if r.segment_id != seg.segment_id]
        seg.allocator = OffsetAllocator(seg.size)
        return removed

    def heartbeat(self, node_id: str, segment_ids: Sequence[str]) -> bool:
        """Records a heartbeat; returns True when the node must remount (the master does not
        know it or some of its segments, e.g. after a master restart or after it was declared
        dead).

        ``segment_ids`` is the node's full set: a segment the master holds for this node that
        is not listed is gone (e.g. the node process restarted with new segment ids) and is
        dropped with its replicas (event reason ``KV_EVENT_REASON_NODE_DEAD``)."""
        self._check_id("node_id", node_id)
        node = self.nodes.get(node_id)
        if node is None:
            return True
        node.last_heartbeat = self.clock.mono()
        listed = set(segment_ids)
        stale = node.segment_ids - listed
        if stale and listed:
            for sid in sorted(stale):
                seg = self.segments.pop(sid, None)
                node.segment_ids.discard(sid)
                self._forget_dormant(sid)
                if seg is not None and seg.alive:
                    n = self._drop_segment(seg, pb.KV_EVENT_REASON_NODE_DEAD)
                    log.warning(
                        "node %s no longer reports segment %s: dropped (%d objects lost)",
                        node_id,
                        sid,
                        n,
                    )
            self.flush()
        for sid in listed:
            seg = self.segments.get(sid)
            if seg is None or not seg.alive or seg.node_id != node_id:
                return True
        return False

    def alive_nodes(self) -> int:
        return len(self.nodes)

    def _node_dead(self, node: NodeState) -> None:
        removed = 0
        deadline = self.clock.mono() + self.cfg.dormant_grace_s
        for sid in sorted(node.segment_ids):
            seg = self.segments.get(sid)
            if seg is not None and seg.alive:
                removed += self._drop_segment(seg, pb.KV_EVENT_REASON_NODE_DEAD, dormant=True)
                self._dormant_deadline.setdefault(sid, deadline)
        del self.nodes[node.node_id]
        self.counters.node_deaths += 1
        self.counters.node_dead_objects += removed
        log.warning(
            "node %s missed its heartbeats: declared dead; %d objects lost their last live "
            "replica (dormant until it remounts)",
            node.node_id,
            removed,
        )
