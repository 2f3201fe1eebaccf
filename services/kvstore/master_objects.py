"""Objects in the KV store master's state: puts (start, end, revoke, with placement and
on-demand eviction), reads and read leases, and removal."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from pdserve import errors
from pdserve.services.kvstore.master_config import MasterConfig
from pdserve.services.kvstore.master_types import (
    CHECKSUM_BYTES,
    MAX_BLOCK_TOKENS,
    OK,
    BlockMeta,
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
    is_block_key,
)
from pdserve.services.kvstore.placement import PlacementStrategy
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
    return ""


class ObjectsMixin:
    """Puts, reads, leases and removal, for :class:`~.master_state.MasterState`. Uses its
    validation helpers, the write-back of :class:`~.master_persist.PersistenceMixin` and the
    eviction and TTL methods of :class:`~.master_eviction.EvictionMixin`."""

    cfg: MasterConfig
    clock: Clock
    on_event: EventSink
    strategies: dict[int, PlacementStrategy]
    segments: dict[str, SegmentState]
    nodes: dict[str, NodeState]
    objects: OrderedDict[str, ObjectState]
    pending: dict[str, ObjectState]
    counters: Counters
    used_bytes: int
    inline_bytes: int
    _dirty: dict[str, ObjectState]

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
        blocks: Sequence[BlockMeta | None] = (),
    ) -> list[PutStartOutcome]:
        """Allocates each ``(key, size)``. ``inline``, when given, holds each item's bytes
        for objects up to ``inline_max_bytes`` (b"" = not inlined); ``checksums`` each
        item's BLAKE3-16 (b"" = none); ``blocks`` each item's KV block metadata (None =
        none), kept with the object for its stored event."""
        self.check_batch(len(items), "items")
        if blocks and len(blocks) != len(items):
            raise errors.InvalidArgument(f"{len(blocks)} block metadata for {len(items)} items")
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
            block = blocks[i] if blocks else None
            problem = self.key_problem(key)
            if not problem and block is not None:
                problem = _block_problem(block)
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
                want=n_rep,
                block=block,
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
        self,
        strategy: PlacementStrategy,
        size: int,
        n_rep: int,
        exclude_nodes: Collection[str] = (),
    ) -> list[ReplicaLoc] | None:
        """``n_rep`` new ranges of ``size`` bytes on distinct nodes, none of
        ``exclude_nodes``, in ``strategy``'s order; None (nothing taken) when they do not fit."""
        live = [s for s in self.segments.values() if s.alive and s.allocator.can_fit(size)]
        chosen: list[ReplicaLoc] = []
        used_nodes: set[str] = set(exclude_nodes)
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
            if obj.client_id != client_id:
                out.append(self._not_owner(obj))
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
        self._touch([o.key for o in out if o.code == OK])
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

    @staticmethod
    def _not_owner(obj: ObjectState) -> KeyOutcome:
        return KeyOutcome(
            obj.key, pb.KV_NOT_OWNER, "another writer started this put: only it may end it"
        )

    def put_revoke(self, client_id: str, keys: Sequence[str]) -> list[KeyOutcome]:
        self.check_batch(len(keys))
        out = []
        for key in keys:
            obj = self.pending.get(key)
            if obj is None:
                out.append(self._no_pending(key))
                continue
            if obj.client_id != client_id:
                out.append(self._not_owner(obj))
                continue
            del self.pending[key]
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
        found: list[str] = []
        for key in keys:
            obj = self.objects.get(key)
            if obj is None or self._expired(obj, now):
                problem = self.key_problem(key)
                out.append(GetOutcome(key, pb.KV_INVALID if problem else pb.KV_NOT_FOUND))
                continue
            hits += 1
            found.append(key)
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
        self._touch(found)
        self.counters.gets += len(keys)
        self.counters.get_hits += hits
        return out

    def _touch(self, keys: Sequence[str]) -> None:
        """Marks ``keys`` (committed, in chain order) most recently used, the first key most
        recent of all: LRU eviction then takes a chain's deepest chunks first, so what is
        left of a prefix stays a usable prefix (a lost head would strand the rest)."""
        for key in reversed(keys):
            self.objects.move_to_end(key)

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
        """Number of leading keys that are committed: a plain dict walk. The keys found
        count as used for LRU eviction, as a read does: a worker asks this of every prompt
        it schedules, and a prefix that its own cache serves (so it reads nothing from the
        store) is still in demand; without the touch a hot prefix would age out behind the
        one-off tails written after it."""
        self.check_batch(len(keys))
        now = self.clock.mono()
        objs = self.objects
        n = 0
        for key in keys:
            o = objs.get(key)
            if o is None or (o.ttl_deadline and o.ttl_deadline <= now):
                break
            n += 1
        self._touch(keys[:n])
        self.counters.prefix_queries += 1
        self.counters.prefix_hit_keys += n
        return n

    # ------------------------------------------------------------------ removal

    def remove(self, keys: Sequence[str], owner: str = "") -> list[KeyOutcome]:
        """Removes committed objects; with ``owner``, only those whose writer's client id
        starts with it (an identity's prefix; see :mod:`.master_auth`)."""
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
            if owner and not obj.client_id.startswith(owner):
                out.append(KeyOutcome(key, pb.KV_NOT_OWNER, "another writer stored this object"))
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
