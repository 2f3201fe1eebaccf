"""The master's object table: committed objects in LRU order, pending puts, read leases, TTLs
and the byte accounting of what is committed.

It holds the :class:`~.types.ObjectState` records and answers the read path (replica lists
with their leases, exists, longest prefix, lease release) by itself. Whatever else an object's
life touches (its replicas' space, the journal, events) is the facade's
(:class:`~.state.MasterState`) to combine: :meth:`ObjectTable.drop` only forgets an object.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence

from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.services.kvstore.master.limits import key_problem
from pdserve.services.kvstore.master.namespaces import NamespaceTable
from pdserve.services.kvstore.master.types import (
    CHECKSUM_BYTES,
    MAX_BLOCK_TOKENS,
    MAX_ENGINE_HASH_BYTES,
    MAX_ENGINE_HASHES,
    OK,
    BlockMeta,
    Counters,
    GetOutcome,
    KeyOutcome,
    ObjectState,
    ReplicaLoc,
    is_block_key,
)
from pdserve.v1 import kvstore_pb2 as pb


def _block_problem(block: BlockMeta) -> str:
    """Why a put's KV block metadata is invalid, or "" when it is fine."""
    if len(block.tokens) % 4:
        return f"block.token_ids has {len(block.tokens)} bytes, not a multiple of 4 (uint32)"
    if len(block.tokens) > 4 * MAX_BLOCK_TOKENS:
        return f"block.token_ids holds more than {MAX_BLOCK_TOKENS} tokens"
    if block.parent and not is_block_key(block.parent):
        return "block.parent_key must be a chunk key (64 hex characters) or empty"
    if len(block.medium) > 32:
        return "block.medium is longer than 32 characters"
    return _engine_problem(block)


def _engine_problem(block: BlockMeta) -> str:
    """Why a put's engine block hashes are invalid, or "" when they are fine (or absent)."""
    hashes = block.engine_hashes
    if len(hashes) > MAX_ENGINE_HASHES:
        return f"block.engine_block_hashes has {len(hashes)} hashes; at most {MAX_ENGINE_HASHES}"
    for i, h in enumerate(hashes):
        if not 0 < len(h) <= MAX_ENGINE_HASH_BYTES:
            return (
                f"block.engine_block_hashes[{i}] has {len(h)} bytes; want 1 to "
                f"{MAX_ENGINE_HASH_BYTES}"
            )
    if len(block.engine_parent) > MAX_ENGINE_HASH_BYTES:
        return (
            f"block.engine_parent_block_hash has {len(block.engine_parent)} bytes; at most "
            f"{MAX_ENGINE_HASH_BYTES}"
        )
    if not hashes:
        if block.engine_parent or block.engine_block_size:
            return "block.engine_parent_block_hash and engine_block_size need engine_block_hashes"
        return ""
    if block.engine_block_size <= 0:
        return "block.engine_block_size must be > 0 with engine_block_hashes"
    n_tokens = len(block.tokens) // 4
    if n_tokens and block.engine_block_size * len(hashes) != n_tokens:
        return (
            f"block.engine_block_size {block.engine_block_size} x {len(hashes)} "
            f"engine_block_hashes = {block.engine_block_size * len(hashes)} tokens; "
            f"token_ids has {n_tokens}"
        )
    return ""


def item_problem(
    cfg: MasterConfig, key: str, size: int, data: bytes, checksum: bytes, block: BlockMeta | None
) -> str:
    """Why one put item is invalid, or "" when it is fine."""
    problem = key_problem(cfg, key)
    if not problem and block is not None:
        problem = _block_problem(block)
    if not problem and size <= 0:
        problem = f"size must be > 0, got {size}"
    if not problem and size > cfg.max_object_bytes:
        problem = f"size {size} exceeds max_object_bytes={cfg.max_object_bytes}"
    if not problem and len(checksum) not in (0, CHECKSUM_BYTES):
        problem = f"checksum has {len(checksum)} bytes; want {CHECKSUM_BYTES} or none"
    if not problem and data and len(data) != size:
        problem = f"inline_data has {len(data)} bytes, the object {size}"
    if not problem and len(data) > cfg.inline_max_bytes:
        problem = (
            f"inline_data of {len(data)} bytes exceeds inline_max_bytes={cfg.inline_max_bytes}"
        )
    return problem


def _tier(r: ReplicaLoc) -> int:
    """Sort key of replicas for readers: memory before disk."""
    return r.tier


def expired(obj: ObjectState, now: float) -> bool:
    """Whether ``obj``'s TTL ended by ``now`` (monotonic seconds)."""
    return bool(obj.ttl_deadline) and obj.ttl_deadline <= now


class ObjectTable(Mapping[str, ObjectState]):
    """A read-only mapping of the committed objects (least recently used first), plus the
    pending puts and the calls that change either. Single-threaded, like the facade."""

    def __init__(
        self, cfg: MasterConfig, counters: Counters, namespaces: NamespaceTable | None = None
    ) -> None:
        self.cfg = cfg
        self.counters = counters
        if namespaces is None:
            namespaces = NamespaceTable(cfg.idle_fingerprint_s)
        self.namespaces = namespaces
        #: The namespaces readers must not see (the table's set, read here; empty unless a
        #: quarantine or a drop hides some): the read path looks into it only when non-empty.
        self.hidden = self.namespaces.hidden
        self._lru: OrderedDict[str, ObjectState] = OrderedDict()
        self._pending: dict[str, ObjectState] = {}
        # (monotonic TTL deadline, key) of committed objects with a TTL.
        self._ttl_heap: list[tuple[float, str]] = []
        #: Bytes of committed objects (object size, not per replica).
        self.used_bytes = 0
        #: Bytes of committed objects kept inline.
        self.inline_bytes = 0

    # ------------------------------------------------------------------ the mapping

    def __getitem__(self, key: str) -> ObjectState:
        return self._lru[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._lru)

    def __len__(self) -> int:
        return len(self._lru)

    def visible(self, key: str, now: float) -> ObjectState | None:
        """The committed object ``key`` unless its TTL ended or its namespace is hidden."""
        obj = self._lru.get(key)
        if obj is None or expired(obj, now) or (self.hidden and self._hides(obj)):
            return None
        return obj

    def _hides(self, obj: ObjectState) -> bool:
        """Whether ``obj``'s namespace is hidden (counted as a quarantined miss)."""
        if obj.ns not in self.hidden:
            return False
        self.counters.quarantined_misses += 1
        return True

    def visible_keys(self, now: float) -> list[str]:
        """Every key a reader can see now, least recently used first."""
        hidden = self.hidden
        return [
            k
            for k, o in self._lru.items()
            if not expired(o, now) and not (hidden and o.ns in hidden)
        ]

    def lru(self) -> list[ObjectState]:
        """A snapshot of the committed objects, least recently used first."""
        return list(self._lru.values())

    def on_segment(self, segment_id: str) -> list[ObjectState]:
        """The committed objects with a replica on ``segment_id``."""
        return [
            o for o in self._lru.values() if any(r.segment_id == segment_id for r in o.replicas)
        ]

    # ------------------------------------------------------------------ pending puts

    def pending(self, key: str) -> ObjectState | None:
        return self._pending.get(key)

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def add_pending(self, obj: ObjectState) -> None:
        self._pending[obj.key] = obj

    def take_pending(self, key: str) -> ObjectState:
        return self._pending.pop(key)

    def owned_pending(self, client_id: str, key: str) -> ObjectState | KeyOutcome:
        """The pending put of ``key`` when ``client_id`` started it; else why not."""
        obj = self._pending.get(key)
        if obj is None:
            problem = key_problem(self.cfg, key)
            if problem:
                return KeyOutcome(key, pb.KV_INVALID, problem)
            if key in self._lru:
                return KeyOutcome(
                    key, pb.KV_NO_PENDING_PUT, "no put in progress: already committed"
                )
            return KeyOutcome(
                key,
                pb.KV_NO_PENDING_PUT,
                "no put in progress (never started, already ended or revoked, or timed out)",
            )
        if obj.client_id != client_id:
            return KeyOutcome(
                key, pb.KV_NOT_OWNER, "another writer started this put: only it may end it"
            )
        return obj

    def timed_out_puts(self, now: float) -> list[ObjectState]:
        """Takes out the pending puts whose time is up."""
        late = [k for k, o in self._pending.items() if o.put_deadline <= now]
        return [self._pending.pop(k) for k in late]

    def strip_pending(self, segment_id: str) -> None:
        """Forgets the pending puts' replicas on ``segment_id`` (its node is gone)."""
        for obj in self._pending.values():
            obj.replicas = [r for r in obj.replicas if r.segment_id != segment_id]

    # ------------------------------------------------------------------ commit and drop

    def commit(self, obj: ObjectState, now: float) -> None:
        """Makes the pending put ``obj`` (already taken out) a committed object, most
        recently used; its inline bytes are dropped when the inline budget is full."""
        obj.put_deadline = 0.0
        self._set_ttl(obj, now + obj.ttl_ms / 1000 if obj.ttl_ms else 0.0)
        if self.inline_bytes + len(obj.inline) > self.cfg.inline_capacity_bytes:
            obj.inline = b""  # full: served from its replicas like any other
        self.inline_bytes += len(obj.inline)
        self._lru[obj.key] = obj
        self.used_bytes += obj.size
        self.counters.puts += 1
        self.namespaces.used(obj.ns, now)
        if self.namespaces.tombstones:
            self.namespaces.tombstones.pop(obj.key, None)  # stored anew: re-reports welcome

    def restore(self, obj: ObjectState, ttl_deadline: float) -> None:
        """Adds an object brought back from a node or the journal, as the coldest."""
        self._set_ttl(obj, ttl_deadline)
        self._lru[obj.key] = obj
        self._lru.move_to_end(obj.key, last=False)
        self.used_bytes += obj.size

    def drop(self, obj: ObjectState) -> None:
        """Forgets the committed object ``obj`` (its replicas' space is the caller's)."""
        del self._lru[obj.key]
        self.used_bytes -= obj.size
        self.inline_bytes -= len(obj.inline)

    def add_replica(self, obj: ObjectState, replica: ReplicaLoc) -> None:
        obj.replicas.append(replica)

    def strip_tier(self, obj: ObjectState, tier: int) -> list[ReplicaLoc]:
        """Takes ``obj``'s replicas in ``tier`` out; returns them."""
        mine = [r for r in obj.replicas if r.tier == tier]
        obj.replicas = [r for r in obj.replicas if r.tier != tier]
        return mine

    def strip_segment(self, obj: ObjectState, segment_id: str) -> list[ReplicaLoc]:
        """Takes ``obj``'s replicas on ``segment_id`` out; returns them."""
        mine = [r for r in obj.replicas if r.segment_id == segment_id]
        obj.replicas = [r for r in obj.replicas if r.segment_id != segment_id]
        return mine

    # ------------------------------------------------------------------ TTLs and leases

    def _set_ttl(self, obj: ObjectState, deadline: float) -> None:
        obj.ttl_deadline = deadline
        if deadline:
            heapq.heappush(self._ttl_heap, (deadline, obj.key))

    def expired_ttls(self, now: float) -> list[ObjectState]:
        """The objects whose TTL ended and that no reader holds (they are invisible from the
        deadline on; a leased one keeps its space until the lease ends)."""
        still_leased, out = [], []
        heap = self._ttl_heap
        while heap and heap[0][0] <= now:
            deadline, key = heapq.heappop(heap)
            obj = self._lru.get(key)
            if obj is None or obj.ttl_deadline != deadline:
                continue  # removed, or a newer object under the same key
            if obj.leased(now):
                still_leased.append((deadline, key))
            else:
                out.append(obj)
        for item in still_leased:
            heapq.heappush(heap, item)
        return out

    @staticmethod
    def lease(obj: ObjectState, holder: str, until: float) -> float:
        """Extends ``holder``'s read lease of ``obj`` to ``until``; returns its end."""
        end = obj.leases[holder] = max(obj.leases.get(holder, 0.0), until)
        return end

    @staticmethod
    def unlease(obj: ObjectState, holder: str) -> bool:
        """Ends ``holder``'s lease of ``obj``; False when it held none."""
        return obj.leases.pop(holder, None) is not None

    # ------------------------------------------------------------------ reads

    def touch(self, keys: Sequence[str]) -> None:
        """Marks ``keys`` (committed, in chain order) most recently used, the first key most
        recent of all: LRU eviction then takes a chain's deepest chunks first, so what is
        left of a prefix stays a usable prefix (a lost head would strand the rest)."""
        for key in reversed(keys):
            self._lru.move_to_end(key)

    def get_replicas(
        self, client_id: str, keys: Sequence[str], lease_s: float, now: float, wall_ms: float
    ) -> list[GetOutcome]:
        """Each key's replicas, leased to ``client_id`` for ``lease_s`` more seconds."""
        out = []
        found: list[str] = []
        for key in keys:
            obj = self.visible(key, now)
            if obj is None:
                problem = key_problem(self.cfg, key)
                out.append(GetOutcome(key, pb.KV_INVALID if problem else pb.KV_NOT_FOUND))
                continue
            found.append(key)
            out.append(self._leased(obj, client_id, now + lease_s, now, wall_ms))
        if found:
            self.namespaces.used(self._lru[found[0]].ns, now)
        self.touch(found)
        self.counters.gets += len(keys)
        self.counters.get_hits += len(found)
        return out

    def _leased(
        self, obj: ObjectState, client_id: str, until: float, now: float, wall_ms: float
    ) -> GetOutcome:
        """The found ``obj``'s outcome, its read lease for ``client_id`` extended to
        ``until`` (monotonic)."""
        lease = self.lease(obj, client_id, until)
        reps = obj.replicas
        return GetOutcome(
            obj.key,
            OK,
            obj.size,
            tuple(sorted(reps, key=_tier)) if len(reps) > 1 else tuple(reps),
            int(wall_ms + (lease - now) * 1000),
            obj.inline,
            obj.checksum,
            int((lease - now) * 1000),
        )

    def release(self, client_id: str, keys: Sequence[str]) -> list[KeyOutcome]:
        out = []
        for key in keys:
            obj = self._lru.get(key)
            if obj is None:
                out.append(KeyOutcome(key, pb.KV_NOT_FOUND, "no such object"))
            elif self.unlease(obj, client_id):
                out.append(KeyOutcome(key, OK))
            else:
                out.append(KeyOutcome(key, OK, "this client held no lease"))
        return out

    def exists(self, keys: Sequence[str], now: float) -> list[bool]:
        objs = self._lru
        out = []
        for key in keys:
            o = objs.get(key)
            out.append(o is not None and not (o.ttl_deadline and o.ttl_deadline <= now))
        if self.hidden:
            out = [ok and not self._hides(objs[k]) for k, ok in zip(keys, out, strict=True)]
        return out

    def longest_prefix(self, keys: Sequence[str], now: float) -> int:
        """Number of leading keys that are committed: a plain dict walk. The keys found
        count as used for LRU eviction, as a read does: a worker asks this of every prompt
        it schedules, and a prefix that its own cache serves (so it reads nothing from the
        store) is still in demand; without the touch a hot prefix would age out behind the
        one-off tails written after it."""
        return len(self._prefix(keys, now))

    def prefix_replicas(
        self, client_id: str, keys: Sequence[str], lease_s: float, now: float, wall_ms: float
    ) -> list[GetOutcome]:
        """:meth:`longest_prefix` and :meth:`get_replicas` of the leading keys it finds in
        one walk (one LRU touch): their replicas, leased to ``client_id`` for ``lease_s``
        more seconds. Counted as a prefix query, and the keys found as gets and get hits
        (the reader skips the get's lookup for them)."""
        found = self._prefix(keys, now)
        until = now + lease_s
        self.counters.gets += len(found)
        self.counters.get_hits += len(found)
        return [self._leased(o, client_id, until, now, wall_ms) for o in found]

    def _prefix(self, keys: Sequence[str], now: float) -> list[ObjectState]:
        """The committed (TTL not ended) objects of the leading ``keys``, up to the first
        that is not; touched and counted as a prefix query."""
        objs = self._lru
        found: list[ObjectState] = []
        for key in keys:
            o = objs.get(key)
            if o is None or (o.ttl_deadline and o.ttl_deadline <= now):
                break
            found.append(o)
        if self.hidden:  # a quarantine or a drop hides some: the prefix ends at the first
            found = found[: next((i for i, o in enumerate(found) if self._hides(o)), len(found))]
        n = len(found)
        if n and (ns := found[0].ns) is not None:
            ns.fp.last_used = now  # the fingerprint is served (NamespaceTable.used, inlined)
        self.touch(keys[:n])
        self.counters.prefix_queries += 1
        self.counters.prefix_hit_keys += n
        return found
