"""The KV store master's state: segments, nodes, objects, pending puts, leases, eviction.

A plain single-threaded class (the gRPC servicer calls it from the event loop; unit tests call
it directly with an injected :class:`Clock`). It holds metadata only, never payload bytes.

Rules it enforces:

* Objects are immutable: a put of a committed key is a no-op success (``already_exists``).
* A pending put (started, not ended) is invisible to readers, is never evicted, and its space
  is reclaimed after ``put_timeout_s``.
* A read lease (granted by :meth:`get_replicas`, per client, ended by :meth:`release` or by
  time) protects an object from eviction and removal.
* Eviction is LRU (last put end / get), soft-pinned objects only when nothing else can go;
  it runs when a segment or the pool passes ``high_watermark`` (down to ``low_watermark``) and
  on demand when an allocation fails.
* A node that misses ``heartbeat_miss_limit`` heartbeats is dead: nothing new is placed on
  it, and its replicas go *dormant*: invisible to readers (an object left without a live
  replica is gone for them: event reason ``KV_EVENT_REASON_NODE_DEAD``) but remembered, with
  their persisted rows, so a remount of the same segment with its bytes kept revives them.
  Time the master itself did not run (a stall: SIGSTOP, swap, a long pause) does not count as
  missed heartbeats.
* Restart: with a :class:`~pdserve.services.kvstore.persistence.MetadataStore` every commit and
  removal is written (one transaction per call); on start the rows come back as dormant
  replicas the same way.
* Dormant replicas revive when their segment remounts (same segment id and node id, the node
  saying it kept the bytes; offsets re-validated against the allocator) and are dropped, with
  their dead segment, after ``dormant_grace_s``. A node may also re-report ``held`` objects on
  mount; unknown keys are then accepted as committed. Both are processed in linear time.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from pdserve import errors
from pdserve.services.kvstore.allocator import OffsetAllocator
from pdserve.services.kvstore.master_config import MasterConfig
from pdserve.services.kvstore.persistence import MetadataStore, StoredObject, StoredReplica
from pdserve.services.kvstore.placement import PlacementStrategy, make_strategies
from pdserve.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)

OK = pb.KV_OK
#: Bytes of an object checksum (BLAKE3, truncated).
CHECKSUM_BYTES = 16


class Clock:
    """Monotonic seconds for deadlines, wall milliseconds for what clients see."""

    def mono(self) -> float:
        return time.monotonic()

    def wall_ms(self) -> float:
        return time.time() * 1000.0


@dataclass
class SegmentState:
    segment_id: str
    node_id: str
    size: int
    endpoints: list[pb.Endpoint]
    allocator: OffsetAllocator
    alive: bool = True

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def free(self) -> int:
        return self.allocator.free

    @property
    def used(self) -> int:
        return self.allocator.used


@dataclass
class NodeState:
    node_id: str
    last_heartbeat: float
    segment_ids: set[str] = field(default_factory=set)


@dataclass
class ReplicaLoc:
    segment_id: str
    node_id: str
    offset: int


@dataclass
class ObjectState:
    key: str
    size: int
    replicas: list[ReplicaLoc]
    soft_pin: bool = False
    ttl_ms: int = 0
    # Monotonic deadline of the TTL (0 = none), set at commit.
    ttl_deadline: float = 0.0
    # Pending puts only: when the reservation is reclaimed, and who started it.
    put_deadline: float = 0.0
    client_id: str = ""
    # client id -> monotonic lease end.
    leases: dict[str, float] = field(default_factory=dict)
    # The object's bytes, kept in memory for small objects (b"" = not inlined).
    inline: bytes = b""
    # The writer's BLAKE3-16 of the bytes (b"" = none), handed to readers.
    checksum: bytes = b""

    def leased(self, now: float) -> bool:
        if not self.leases:
            return False
        for client, until in list(self.leases.items()):
            if until <= now:
                del self.leases[client]
        return bool(self.leases)


@dataclass
class Counters:
    puts: int = 0
    gets: int = 0
    get_hits: int = 0
    evictions: int = 0
    removals: int = 0
    prefix_queries: int = 0
    prefix_hit_keys: int = 0
    ttl_expired: int = 0
    put_timeouts: int = 0
    node_deaths: int = 0
    stalls: int = 0
    node_dead_objects: int = 0


@dataclass(frozen=True)
class PutStartOutcome:
    key: str
    code: int
    message: str = ""
    already_exists: bool = False
    replicas: tuple[ReplicaLoc, ...] = ()


@dataclass(frozen=True)
class KeyOutcome:
    key: str
    code: int
    message: str = ""


@dataclass(frozen=True)
class GetOutcome:
    key: str
    code: int
    replicas: tuple[ReplicaLoc, ...] = ()
    lease_expires_ms: int = 0
    inline: bytes = b""
    checksum: bytes = b""
    # How long the granted lease lasts from now (milliseconds).
    lease_ms: int = 0


#: on_event(type, key, size, reason) with type pb.KV_EVENT_STORED / pb.KV_EVENT_REMOVED and
#: reason a pb.KVEventReason (unspecified for stored events).
EventSink = Callable[[int, str, int, int], None]


class MasterState:
    """All master metadata. Not thread-safe: call from one thread (the event loop)."""

    def __init__(
        self,
        cfg: MasterConfig,
        *,
        clock: Clock | None = None,
        store: MetadataStore | None = None,
        on_event: EventSink | None = None,
        placement_seed: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.clock = clock or Clock()
        self.store = store
        self.on_event = on_event or (lambda *_: None)
        self.strategies: dict[int, PlacementStrategy] = make_strategies(placement_seed)
        self.segments: dict[str, SegmentState] = {}
        self.nodes: dict[str, NodeState] = {}
        # Committed objects in LRU order (least recently used first).
        self.objects: OrderedDict[str, ObjectState] = OrderedDict()
        self.pending: dict[str, ObjectState] = {}
        self.counters = Counters()
        self._dirty: dict[str, ObjectState] = {}
        self._deleted: set[str] = set()
        # Restart: persisted objects waiting for their segments.
        self.dormant: dict[str, StoredObject] = {}
        self._dormant_by_segment: dict[str, set[str]] = {}
        # segment id -> monotonic time its dormant replicas (and, if dead, itself) are dropped
        self._dormant_deadline: dict[str, float] = {}
        self._last_tick = self.clock.mono()
        # (monotonic TTL deadline, key) of committed objects with a TTL.
        self._ttl_heap: list[tuple[float, str]] = []
        self.used_bytes = 0  # bytes of committed objects (object size, not per replica)
        self.inline_bytes = 0  # bytes of committed objects kept inline
        if store is not None:
            self._load(store)

    # ------------------------------------------------------------------ persistence

    def _load(self, store: MetadataStore) -> None:
        wall = self.clock.wall_ms()
        expired = []
        for obj in store.load():
            if obj.ttl_deadline_ms and obj.ttl_deadline_ms <= wall:
                expired.append(obj.key)
                continue
            self._add_dormant(obj)
        store.apply([], expired)
        if self.dormant:
            log.info(
                "loaded %d committed objects from %s; waiting up to %.0fs for %d segments",
                len(self.dormant),
                store.path,
                self.cfg.dormant_grace_s,
                len(self._dormant_by_segment),
            )

    def _add_dormant(self, stored: StoredObject) -> None:
        """Remembers ``stored``'s replicas until their segments remount or their grace ends."""
        old = self.dormant.get(stored.key)
        if old is not None:
            have = {(r.segment_id, r.offset) for r in old.replicas}
            extra = tuple(r for r in stored.replicas if (r.segment_id, r.offset) not in have)
            stored = dataclasses.replace(old, replicas=old.replicas + extra)
        self.dormant[stored.key] = stored
        deadline = self.clock.mono() + self.cfg.dormant_grace_s
        for r in stored.replicas:
            self._dormant_by_segment.setdefault(r.segment_id, set()).add(stored.key)
            self._dormant_deadline.setdefault(r.segment_id, deadline)

    def _forget_dormant(self, segment_id: str) -> list[tuple[StoredObject, StoredReplica]]:
        """Takes the dormant replicas of ``segment_id`` out; returns them with their objects.
        A key left with no dormant replica and no live object loses its persisted row."""
        self._dormant_deadline.pop(segment_id, None)
        out = []
        for key in sorted(self._dormant_by_segment.pop(segment_id, ())):
            stored = self.dormant.get(key)
            if stored is None:
                continue
            rest = tuple(r for r in stored.replicas if r.segment_id != segment_id)
            out.extend((stored, r) for r in stored.replicas if r.segment_id == segment_id)
            if rest:
                self.dormant[key] = dataclasses.replace(stored, replicas=rest)
            else:
                del self.dormant[key]
                if key not in self.objects and key not in self.pending:
                    self._mark_deleted(key)
        return out

    def _mark(self, obj: ObjectState) -> None:
        if self.store is not None:
            self._dirty[obj.key] = obj
            self._deleted.discard(obj.key)

    def _mark_deleted(self, key: str) -> None:
        if self.store is not None:
            self._dirty.pop(key, None)
            self._deleted.add(key)

    def flush(self) -> None:
        """Writes this call's changes in one transaction (called at the end of every mutating
        public method)."""
        if self.store is None or (not self._dirty and not self._deleted):
            return
        mono, wall = self.clock.mono(), self.clock.wall_ms()
        ups = [
            StoredObject(
                o.key,
                o.size,
                o.soft_pin,
                int(wall + (o.ttl_deadline - mono) * 1000) if o.ttl_deadline else 0,
                tuple(StoredReplica(r.segment_id, r.node_id, r.offset) for r in o.replicas),
                o.checksum,
            )
            for o in self._dirty.values()
        ]
        self.store.apply(ups, self._deleted)
        self._dirty.clear()
        self._deleted.clear()

    # ------------------------------------------------------------------ validation

    def _check_id(self, what: str, value: str) -> None:
        if not value:
            raise errors.InvalidArgument(f"{what} must not be empty")
        if len(value.encode()) > self.cfg.max_id_bytes:
            raise errors.InvalidArgument(
                f"{what} is {len(value.encode())} bytes; the limit is max_id_bytes="
                f"{self.cfg.max_id_bytes}"
            )

    def check_batch(self, n: int, what: str = "keys") -> None:
        """Whole-call checks of a batched request."""
        if n == 0:
            raise errors.InvalidArgument(f"the request has no {what}")
        if n > self.cfg.max_batch_keys:
            raise errors.ResourceExhausted(
                f"the request has {n} {what}; the limit is max_batch_keys={self.cfg.max_batch_keys}"
            )

    def key_problem(self, key: str) -> str:
        """Why ``key`` is invalid, or "" when it is fine."""
        if not key:
            return "key is empty"
        n = len(key.encode())
        if n > self.cfg.max_key_bytes:
            return f"key is {n} bytes; the limit is max_key_bytes={self.cfg.max_key_bytes}"
        return ""

    # ------------------------------------------------------------------ segments and nodes

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
        for key in [k for k, o in self.objects.items() if _on(o, seg.segment_id)]:
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

    # ------------------------------------------------------------------ puts

    def put_start(
        self,
        client_id: str,
        items: Sequence[tuple[str, int]],
        replicas: int = 0,
        soft_pin: bool = False,
        ttl_ms: int = 0,
        placement: int = pb.PLACEMENT_UNSPECIFIED,
        inline: Sequence[bytes] = (),
        checksums: Sequence[bytes] = (),
    ) -> list[PutStartOutcome]:
        """Allocates each ``(key, size)``. ``inline``, when given, holds each item's bytes
        for objects up to ``inline_max_bytes`` (b"" = not inlined); ``checksums`` each
        item's BLAKE3-16 (b"" = none)."""
        self.check_batch(len(items), "items")
        if inline and len(inline) != len(items):
            raise errors.InvalidArgument(f"{len(inline)} inline payloads for {len(items)} items")
        if checksums and len(checksums) != len(items):
            raise errors.InvalidArgument(f"{len(checksums)} checksums for {len(items)} items")
        n_rep = replicas or self.cfg.default_replicas
        if n_rep > self.cfg.max_replicas:
            raise errors.InvalidArgument(
                f"options.replicas={replicas} exceeds max_replicas={self.cfg.max_replicas}"
            )
        if ttl_ms > self.cfg.max_ttl_ms:
            raise errors.InvalidArgument(
                f"options.ttl_ms={ttl_ms} exceeds max_ttl_ms={self.cfg.max_ttl_ms}"
            )
        strategy = self.strategies.get(placement)
        if strategy is None:
            raise errors.InvalidArgument(f"options.placement={placement} is not a known strategy")
        now = self.clock.mono()
        out = []
        for i, (key, size) in enumerate(items):
            data = inline[i] if inline else b""
            checksum = checksums[i] if checksums else b""
            problem = self.key_problem(key)
            if not problem and size <= 0:
                problem = f"size must be > 0, got {size}"
            if not problem and size > self.cfg.max_object_bytes:
                problem = f"size {size} exceeds max_object_bytes={self.cfg.max_object_bytes}"
            if not problem and len(checksum) not in (0, CHECKSUM_BYTES):
                problem = f"checksum has {len(checksum)} bytes; want {CHECKSUM_BYTES} or none"
            if not problem and data and len(data) != size:
                problem = f"inline_data has {len(data)} bytes, the object {size}"
            if not problem and len(data) > self.cfg.inline_max_bytes:
                problem = (
                    f"inline_data of {len(data)} bytes exceeds inline_max_bytes="
                    f"{self.cfg.inline_max_bytes}"
                )
            if problem:
                out.append(PutStartOutcome(key, pb.KV_INVALID, problem))
                continue
            old = self.objects.get(key)
            if old is not None:
                if not self._expired(old, now):
                    out.append(PutStartOutcome(key, OK, "already committed", already_exists=True))
                    continue
                if old.leased(now):
                    out.append(
                        PutStartOutcome(
                            key, pb.KV_LEASED, "the expired previous copy is still being read"
                        )
                    )
                    continue
                self._delete(old, pb.KV_EVENT_REASON_TTL)
                self.counters.ttl_expired += 1
            if key in self.pending:
                out.append(
                    PutStartOutcome(
                        key,
                        pb.KV_PUT_IN_PROGRESS,
                        f"a put of this key by {self.pending[key].client_id!r} is in progress",
                    )
                )
                continue
            if len(self.nodes) < n_rep:
                out.append(
                    PutStartOutcome(
                        key,
                        pb.KV_NOT_ENOUGH_NODES,
                        f"{n_rep} replicas requested, {len(self.nodes)} nodes alive",
                    )
                )
                continue
            locs = self._place(strategy, size, n_rep, now)
            if locs is None:
                out.append(
                    PutStartOutcome(
                        key,
                        pb.KV_NO_SPACE,
                        f"no room for {size} bytes on {n_rep} distinct nodes, even after eviction",
                    )
                )
                continue
            self.pending[key] = ObjectState(
                key,
                size,
                locs,
                soft_pin=soft_pin,
                ttl_ms=ttl_ms,
                put_deadline=now + self.cfg.put_timeout_s,
                client_id=client_id,
                inline=data,
                checksum=checksum,
            )
            out.append(PutStartOutcome(key, OK, replicas=tuple(locs)))
        self._evict_to_watermarks(now)
        self.flush()
        return out

    def _place(
        self, strategy: PlacementStrategy, size: int, n_rep: int, now: float
    ) -> list[ReplicaLoc] | None:
        locs = self._try_place(strategy, size, n_rep)
        if locs is not None:
            return locs
        # On-demand eviction: one LRU pass, retrying after each victim.
        victims = self._eviction_candidates(now)
        for _ in range(self.cfg.max_evictions_per_alloc):
            victim = next(victims, None)
            if victim is None:
                return None
            self._evict(victim)
            locs = self._try_place(strategy, size, n_rep)
            if locs is not None:
                return locs
        return None

    def _try_place(
        self, strategy: PlacementStrategy, size: int, n_rep: int
    ) -> list[ReplicaLoc] | None:
        live = [s for s in self.segments.values() if s.alive and s.allocator.can_fit(size)]
        chosen: list[ReplicaLoc] = []
        used_nodes: set[str] = set()
        for seg in strategy.order(live, size):
            if seg.node_id in used_nodes:
                continue
            off = seg.allocator.allocate(size)
            if off is None:
                continue
            chosen.append(ReplicaLoc(seg.segment_id, seg.node_id, off))
            used_nodes.add(seg.node_id)
            if len(chosen) == n_rep:
                return chosen
        for loc in chosen:  # not enough: give back what we took
            self.segments[loc.segment_id].allocator.release(loc.offset)
        return None

    def put_end(self, client_id: str, keys: Sequence[str]) -> list[KeyOutcome]:
        self.check_batch(len(keys))
        now = self.clock.mono()
        out = []
        for key in keys:
            obj = self.pending.get(key)
            if obj is None:
                out.append(self._no_pending(key))
                continue
            del self.pending[key]
            if not obj.replicas:
                out.append(
                    KeyOutcome(
                        key, pb.KV_NOT_ENOUGH_NODES, "every replica's node died during the put"
                    )
                )
                continue
            obj.put_deadline = 0.0
            self._set_ttl(obj, now + obj.ttl_ms / 1000 if obj.ttl_ms else 0.0)
            if self.inline_bytes + len(obj.inline) > self.cfg.inline_capacity_bytes:
                obj.inline = b""  # full: served from its replicas like any other
            self.inline_bytes += len(obj.inline)
            self.objects[key] = obj
            self.used_bytes += obj.size
            self.counters.puts += 1
            self._mark(obj)
            self.on_event(pb.KV_EVENT_STORED, key, obj.size, pb.KV_EVENT_REASON_UNSPECIFIED)
            out.append(KeyOutcome(key, OK))
        self.flush()
        return out

    def _no_pending(self, key: str) -> KeyOutcome:
        problem = self.key_problem(key)
        if problem:
            return KeyOutcome(key, pb.KV_INVALID, problem)
        if key in self.objects:
            return KeyOutcome(key, pb.KV_NO_PENDING_PUT, "no put in progress: already committed")
        return KeyOutcome(
            key,
            pb.KV_NO_PENDING_PUT,
            "no put in progress (never started, already ended or revoked, or timed out)",
        )

    def put_revoke(self, client_id: str, keys: Sequence[str]) -> list[KeyOutcome]:
        self.check_batch(len(keys))
        out = []
        for key in keys:
            obj = self.pending.pop(key, None)
            if obj is None:
                out.append(self._no_pending(key))
                continue
            self._free(obj)
            out.append(KeyOutcome(key, OK))
        return out

    # ------------------------------------------------------------------ reads

    def _expired(self, obj: ObjectState, now: float) -> bool:
        return bool(obj.ttl_deadline) and obj.ttl_deadline <= now

    def get_replicas(
        self, client_id: str, keys: Sequence[str], lease_ms: int = 0
    ) -> list[GetOutcome]:
        self.check_batch(len(keys))
        if lease_ms > self.cfg.max_lease_ms:
            raise errors.InvalidArgument(
                f"lease_ms={lease_ms} exceeds max_lease_ms={self.cfg.max_lease_ms}"
            )
        lease_s = (lease_ms or self.cfg.default_lease_ms) / 1000
        now = self.clock.mono()
        wall = self.clock.wall_ms()
        until = now + lease_s
        out = []
        hits = 0
        for key in keys:
            obj = self.objects.get(key)
            if obj is None or self._expired(obj, now):
                problem = self.key_problem(key)
                out.append(GetOutcome(key, pb.KV_INVALID if problem else pb.KV_NOT_FOUND))
                continue
            hits += 1
            self.objects.move_to_end(key)
            lease = obj.leases[client_id] = max(obj.leases.get(client_id, 0.0), until)
            out.append(
                GetOutcome(
                    key,
                    OK,
                    tuple(obj.replicas),
                    int(wall + (lease - now) * 1000),
                    obj.inline,
                    obj.checksum,
                    int((lease - now) * 1000),
                )
            )
        self.counters.gets += len(keys)
        self.counters.get_hits += hits
        return out

    def release(self, client_id: str, keys: Sequence[str]) -> list[KeyOutcome]:
        self.check_batch(len(keys))
        out = []
        for key in keys:
            obj = self.objects.get(key)
            if obj is None:
                out.append(KeyOutcome(key, pb.KV_NOT_FOUND, "no such object"))
                continue
            if obj.leases.pop(client_id, None) is None:
                out.append(KeyOutcome(key, OK, "this client held no lease"))
            else:
                out.append(KeyOutcome(key, OK))
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.check_batch(len(keys))
        now = self.clock.mono()
        objs = self.objects
        out = []
        for key in keys:
            o = objs.get(key)
            out.append(o is not None and not (o.ttl_deadline and o.ttl_deadline <= now))
        return out

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """Number of leading keys that are committed: a plain dict walk."""
        self.check_batch(len(keys))
        now = self.clock.mono()
        objs = self.objects
        n = 0
        for key in keys:
            o = objs.get(key)
            if o is None or (o.ttl_deadline and o.ttl_deadline <= now):
                break
            n += 1
        self.counters.prefix_queries += 1
        self.counters.prefix_hit_keys += n
        return n

    # ------------------------------------------------------------------ removal and eviction

    def remove(self, keys: Sequence[str]) -> list[KeyOutcome]:
        self.check_batch(len(keys))
        now = self.clock.mono()
        out = []
        for key in keys:
            obj = self.objects.get(key)
            if obj is None:
                problem = self.key_problem(key)
                if problem:
                    out.append(KeyOutcome(key, pb.KV_INVALID, problem))
                elif key in self.pending:
                    out.append(KeyOutcome(key, pb.KV_PUT_IN_PROGRESS, "the put is not finished"))
                else:
                    out.append(KeyOutcome(key, pb.KV_NOT_FOUND, "no such object"))
                continue
            if obj.leased(now):
                out.append(
                    KeyOutcome(
                        key, pb.KV_LEASED, f"leased by {len(obj.leases)} reader(s); retry later"
                    )
                )
                continue
            self._delete(obj, pb.KV_EVENT_REASON_REMOVE)
            self.counters.removals += 1
            out.append(KeyOutcome(key, OK))
        self.flush()
        return out

    def _free(self, obj: ObjectState) -> None:
        for r in obj.replicas:
            seg = self.segments.get(r.segment_id)
            if seg is not None and seg.alive:
                seg.allocator.release(r.offset)

    def _delete(
        self, obj: ObjectState, reason: int, *, free: bool = True, persist: bool = True
    ) -> None:
        if free:
            self._free(obj)
        del self.objects[obj.key]
        self.used_bytes -= obj.size
        self.inline_bytes -= len(obj.inline)
        if persist:
            self._mark_deleted(obj.key)
        else:
            self._dirty.pop(obj.key, None)
        self.on_event(pb.KV_EVENT_REMOVED, obj.key, obj.size, reason)

    def _eviction_candidates(
        self, now: float, segment_id: str | None = None
    ) -> Iterator[ObjectState]:
        """Evictable objects (on ``segment_id`` when given) in eviction order: least recently
        used first, soft-pinned ones only after every other candidate; never a leased object
        (pending puts are not in ``objects`` at all). One pass over a snapshot; objects removed
        meanwhile are skipped."""
        pinned: list[ObjectState] = []
        for obj in list(self.objects.values()):
            if segment_id is not None and not _on(obj, segment_id):
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

    # ------------------------------------------------------------------ stats

    def stats(self) -> pb.StatsResponse:
        c = self.counters
        live = [s for s in self.segments.values() if s.alive]
        return pb.StatsResponse(
            objects=len(self.objects),
            used_bytes=self.used_bytes,
            capacity_bytes=sum(s.capacity for s in live),
            segments=[
                pb.SegmentStats(
                    segment_id=s.segment_id,
                    node_id=s.node_id,
                    capacity=s.capacity,
                    used=s.used,
                    alive=s.alive,
                )
                for s in self.segments.values()
            ],
            puts=c.puts,
            gets=c.gets,
            get_hits=c.get_hits,
            evictions=c.evictions,
            removals=c.removals,
            prefix_queries=c.prefix_queries,
            prefix_hit_keys=c.prefix_hit_keys,
            alive_nodes=len(self.nodes),
        )


def _on(obj: ObjectState, segment_id: str) -> bool:
    return any(r.segment_id == segment_id for r in obj.replicas)
