"""The KV store master's state: segments, nodes, objects, pending puts, leases, eviction.

A plain single-threaded class (the gRPC servicer calls it from the event loop; unit tests call
it directly with an injected :class:`Clock`). It holds metadata only, never payload bytes.

:class:`MasterState` creates the shared attributes and holds the validation helpers and
:meth:`~MasterState.stats`; the rest comes from one mixin per concern, which call each other
through ``self``: :mod:`.master_persist` (recovery and persistence), :mod:`.master_segments`
(segments and nodes), :mod:`.master_objects` (puts, reads and leases, removal) and
:mod:`.master_eviction` (eviction and housekeeping). The plain types are in
:mod:`.master_types` (re-exported here).

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

from collections import OrderedDict

from pdserve import errors
from pdserve.services.kvstore.master_config import MasterConfig
from pdserve.services.kvstore.master_eviction import EvictionMixin
from pdserve.services.kvstore.master_objects import ObjectsMixin
from pdserve.services.kvstore.master_persist import PersistenceMixin
from pdserve.services.kvstore.master_repair import RepairMixin
from pdserve.services.kvstore.master_segments import SegmentsMixin
from pdserve.services.kvstore.master_types import (
    CHECKSUM_BYTES,
    OK,
    Clock,
    Counters,
    EventSink,
    GetOutcome,
    KeyOutcome,
    NodeState,
    ObjectState,
    PutStartOutcome,
    ReplicaLoc,
    SegmentState,
    SegmentStats,
    StoreStats,
)
from pdserve.services.kvstore.persistence import MetadataStore, StoredObject
from pdserve.services.kvstore.placement import PlacementStrategy, make_strategies

__all__ = [
    "CHECKSUM_BYTES",
    "OK",
    "Clock",
    "Counters",
    "EventSink",
    "GetOutcome",
    "KeyOutcome",
    "MasterState",
    "NodeState",
    "ObjectState",
    "PutStartOutcome",
    "ReplicaLoc",
    "SegmentState",
    "SegmentStats",
    "StoreStats",
]


class MasterState(PersistenceMixin, SegmentsMixin, ObjectsMixin, EvictionMixin, RepairMixin):
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
        self._init_repair()
        if store is not None:
            self._load(store)

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

    # ------------------------------------------------------------------ stats

    def stats(self) -> StoreStats:
        c = self.counters
        live = [s for s in self.segments.values() if s.alive]
        return StoreStats(
            objects=len(self.objects),
            used_bytes=self.used_bytes,
            capacity_bytes=sum(s.capacity for s in live),
            segments=tuple(
                SegmentStats(
                    segment_id=s.segment_id,
                    node_id=s.node_id,
                    capacity=s.capacity,
                    used=s.used,
                    alive=s.alive,
                )
                for s in self.segments.values()
            ),
            puts=c.puts,
            gets=c.gets,
            get_hits=c.get_hits,
            evictions=c.evictions,
            removals=c.removals,
            prefix_queries=c.prefix_queries,
            prefix_hit_keys=c.prefix_hit_keys,
            alive_nodes=len(self.nodes),
        )
