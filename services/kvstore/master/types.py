"""Plain types of the KV store master's state (:class:`~.state.MasterState`): the clock, the
segment, node, object and replica records, the counters, what the state's calls return
(outcomes, :class:`StoreStats`) and the event sink. No protobuf messages are built here.

The records are owned by the part that holds them (objects by :class:`~.objects.ObjectTable`,
segments and nodes by :class:`~.segments.SegmentTable`); the others change them only through
that part's methods."""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.services.kvstore.master.allocator import OffsetAllocator
from pdserve.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    from pdserve.services.kvstore.master.namespaces import Namespace

OK = pb.KV_OK
#: Bytes of an object checksum (BLAKE3, truncated).
CHECKSUM_BYTES = 16
#: Allocation ids (ReplicaLoc.alloc_id): unique within the process, so within one master key.
_ALLOC_IDS = itertools.count(1)


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
    #: pb.STORAGE_TIER_MEMORY (puts land here) or pb.STORAGE_TIER_DISK (the tier below).
    tier: int = pb.STORAGE_TIER_MEMORY

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
    # Its KVNodeService address host:port, as its mount said ("" = not given).
    address: str = ""


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """A chunk's place in its chain, as its writer gave it (``KVBlockMeta``)."""

    #: Key of the previous chunk ("" = the first chunk of its chain).
    parent: str
    #: The chunk's token ids, packed uint32 little-endian.
    tokens: bytes
    #: Tokens per chunk (0 = not given).
    block_size: int
    #: Where the writer says it lives ("" = the master's kv_events_medium).
    medium: str
    #: The engine's own hashes of the blocks inside the chunk, in order (vLLM's
    #: ``request.block_hashes``; () = not given).
    engine_hashes: tuple[bytes, ...] = ()
    #: The engine's hash of the block before the chunk's first (b"" = none or not given).
    engine_parent: bytes = b""
    #: Tokens per engine block (0 = not given).
    engine_block_size: int = 0


_BLOCK_KEY = re.compile(r"[0-9a-f]{64}")


def is_block_key(key: str) -> bool:
    """Whether ``key`` is a chunk key (64 lowercase hex characters): a KV block, published in
    the KV event stream; other objects (request tails, raw objects) are not blocks."""
    return len(key) == 64 and _BLOCK_KEY.fullmatch(key) is not None


#: Most token ids one block's metadata may carry (a chunk is at most this many tokens).
MAX_BLOCK_TOKENS = 65536
#: Most engine block hashes one chunk's metadata may carry (chunk size / engine block size).
MAX_ENGINE_HASHES = 64
#: Longest engine block hash (bytes; vLLM's sha256 hashes are 32).
MAX_ENGINE_HASH_BYTES = 64


@dataclass
class ReplicaLoc:
    segment_id: str
    node_id: str
    offset: int
    # This placement's id, bound into its data-plane grants (pdserve/store/grants.py): every
    # ReplicaLoc made (a placement, a restore) takes the next one.
    alloc_id: int = field(default_factory=lambda: next(_ALLOC_IDS))
    #: The tier of its segment (pb.StorageTier).
    tier: int = pb.STORAGE_TIER_MEMORY

    @property
    def on_disk(self) -> bool:
        return self.tier == pb.STORAGE_TIER_DISK


@dataclass
class ObjectState:
    key: str
    size: int
    replicas: list[ReplicaLoc]
    soft_pin: bool = False
    ttl_ms: int = 0
    # Monotonic deadline of the TTL (0 = none), set at commit.
    ttl_deadline: float = 0.0
    # Pending puts only: when the reservation is reclaimed.
    put_deadline: float = 0.0
    # Who started the put (kept after commit: removal checks it; "" = restored from disk).
    client_id: str = ""
    # client id -> monotonic lease end.
    leases: dict[str, float] = field(default_factory=dict)
    # The object's bytes, kept in memory for small objects (b"" = not inlined).
    inline: bytes = b""
    # The writer's BLAKE3-16 of the bytes (b"" = none), handed to readers.
    checksum: bytes = b""
    # Replicas its put asked for; an object left with fewer live ones is re-replicated.
    want: int = 1
    # What the writer said the object is as a KV block (PutStartItem.block), for the KV event
    # stream; None = not given. In memory only: not persisted (docs/architecture.md).
    block: BlockMeta | None = None
    # Whose KV it is (:mod:`.namespaces`, shared by its namespace's objects); None = unknown.
    ns: Namespace | None = None

    @property
    def tenant(self) -> str:
        """The tenant of its namespace ("" = none, or an unknown namespace)."""
        return self.ns.tenant if self.ns is not None else ""

    def in_memory(self) -> bool:
        """Whether a memory replica holds it (else only disk ones do)."""
        return any(not r.on_disk for r in self.replicas)

    def on_disk(self) -> bool:
        """Whether a disk replica holds it."""
        return any(r.on_disk for r in self.replicas)

    def nodes(self) -> set[str]:
        """The nodes holding a replica (the copies that count against ``want``: a memory and
        a disk copy on one node are one node's)."""
        return {r.node_id for r in self.replicas}

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
    repairs: int = 0
    repair_failures: int = 0
    demotions: int = 0
    promotions: int = 0
    memory_evictions: int = 0
    tier_move_failures: int = 0
    dropped_objects: int = 0
    quarantined_misses: int = 0


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


@dataclass(slots=True)
class GetOutcome:
    """A get's (or a prefix lookup's) answer for one key. Not frozen: a lookup makes one per
    key found, and a frozen dataclass's ``__init__`` costs about twice as much."""

    key: str
    code: int
    # The object's size (bytes; 0 when not found).
    size: int = 0
    replicas: tuple[ReplicaLoc, ...] = ()
    lease_expires_ms: int = 0
    inline: bytes = b""
    checksum: bytes = b""
    # How long the granted lease lasts from now (milliseconds).
    lease_ms: int = 0


@dataclass(frozen=True)
class SegmentStats:
    segment_id: str
    node_id: str
    capacity: int
    used: int
    alive: bool
    tier: int = pb.STORAGE_TIER_MEMORY


@dataclass(frozen=True)
class StoreStats:
    """What :meth:`~.state.MasterState.stats` returns: the fields of
    ``pb.StatsResponse``, one for one (the servicer converts it)."""

    objects: int
    used_bytes: int
    capacity_bytes: int
    segments: tuple[SegmentStats, ...]
    puts: int
    gets: int
    get_hits: int
    evictions: int
    removals: int
    prefix_queries: int
    prefix_hit_keys: int
    alive_nodes: int
    demotions: int = 0
    promotions: int = 0
    memory_evictions: int = 0
    disk_capacity_bytes: int = 0
    disk_used_bytes: int = 0
    dropped_objects: int = 0
    quarantined_fingerprints: int = 0
    quarantined_misses: int = 0


#: on_event(type, key, size, reason) with type pb.KV_EVENT_STORED / pb.KV_EVENT_REMOVED and
#: reason a pb.KVEventReason (unspecified for stored events); a move between tiers adds the
#: tier: on_event(type, key, size, pb.KV_EVENT_REASON_TIER, tier), the copy added or dropped.
EventSink = Callable[..., None]


def on_segment(obj: ObjectState, segment_id: str) -> bool:
    """Whether ``obj`` has a replica on ``segment_id``."""
    return any(r.segment_id == segment_id for r in obj.replicas)
