"""The KV store master's state: a facade over parts that each own their state.

A plain single-threaded class (the gRPC servicer calls it from the event loop; unit tests call
it directly with an injected :class:`Clock`). It holds metadata only, never payload bytes.

The parts, each with its own state, collaborating only through their methods:

* :class:`~.objects.ObjectTable` (``objects``): committed objects in LRU order, pending puts,
  read leases, TTLs, byte accounting; it answers the read path itself.
* :class:`~.segments.SegmentTable` (``segments``): nodes, segments, allocators, placement.
* :class:`~.eviction.Evictor`: which objects go when space runs short.
* :class:`~.journal.Journal` and :class:`~.dormant.DormantReplicas` (``dormant``):
  persistence, and what a restart or a dead node leaves to come back.
* :class:`~.repair.Repairer`: under-replicated objects and their copy jobs.
* :class:`~.tiers.Tierer` (``tierer``): copies between a node's memory and disk tiers (down
  before memory evicts, up after a read of a disk-only object), run as copy jobs too.
* :class:`~.membership.Membership`: segments and nodes coming and going.
* :class:`~.invalidation.Invalidation` over :class:`~.namespaces.NamespaceTable`
  (``namespaces``): whose KV each object is, drops and quarantines of a model's chunks.

The facade validates whole calls, combines the parts (a put places through the segment
table, evicts through the evictor, records in the object table) and ends every mutating call
with one journal flush. It is the one place that removes a committed object
(:meth:`MasterState._delete`: free its space, journal it, publish the event).

Rules it enforces:

* Objects are immutable: a put of a committed key is a no-op success (``already_exists``).
* A pending put (started, not ended) is invisible to readers, is never evicted, and its space
  is reclaimed after ``put_timeout_s``.
* A read lease (granted by :meth:`get_replicas` and :meth:`prefix_replicas`, per client,
  ended by :meth:`release` or by time) protects an object from eviction and removal.
* Eviction takes idle fingerprints' objects first, then LRU (last put end / get), soft-pinned
  ones last; it runs past ``high_watermark`` (down to ``low_watermark``) and on demand.
  Objects of tenants over their share go before all of these, and a tenant's pinned objects
  never go (:class:`~.quotas.Quotas`, :class:`~.pins.PinTable`).
* A node that misses ``heartbeat_miss_limit`` heartbeats is dead: nothing new is placed on
  it, and its replicas go *dormant*: invisible to readers (an object left without a live
  replica is gone for them: event reason ``KV_EVENT_REASON_NODE_DEAD``) but remembered, with
  their persisted rows, so a remount of the same segment with its bytes kept revives them.
  Time the master itself did not run (a stall: SIGSTOP, swap, a long pause) does not count as
  missed heartbeats.
* Restart: with a :class:`~.persistence.MetadataStore` every commit and removal is written
  (one transaction per call); on start the rows come back as dormant replicas the same way.
* Dormant replicas revive when their segment remounts (same segment id and node id, the node
  saying it kept the bytes; offsets re-validated against the allocator) and are dropped, with
  their dead segment, after ``dormant_grace_s``. A node may also re-report ``held`` objects on
  mount; unknown keys are then accepted as committed. Both are processed in linear time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from pdserve import errors
from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.services.kvstore.master.dormant import DormantReplicas
from pdserve.services.kvstore.master.eviction import Evictor
from pdserve.services.kvstore.master.invalidation import DropReport, Invalidation
from pdserve.services.kvstore.master.journal import Journal
from pdserve.services.kvstore.master.limits import check_batch, check_put, key_problem
from pdserve.services.kvstore.master.membership import Membership
from pdserve.services.kvstore.master.namespaces import NamespaceTable
from pdserve.services.kvstore.master.objects import ObjectTable, expired, item_problem
from pdserve.services.kvstore.master.persistence import MetadataStore
from pdserve.services.kvstore.master.pins import PinTable
from pdserve.services.kvstore.master.quotas import Quotas
from pdserve.services.kvstore.master.repair import Repairer, RepairJob
from pdserve.services.kvstore.master.segments import SegmentTable
from pdserve.services.kvstore.master.shares import Shares
from pdserve.services.kvstore.master.stats import store_stats
from pdserve.services.kvstore.master.tiers import MEMORY, Tierer
from pdserve.services.kvstore.master.types import (
    OK,
    BlockMeta,
    Clock,
    Counters,
    EventSink,
    GetOutcome,
    KeyOutcome,
    ObjectState,
    PutStartOutcome,
    StoreStats,
)
from pdserve.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)


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
        self.on_event = on_event or (lambda *_: None)
        self.counters = Counters()
        self.namespaces = NamespaceTable(cfg.idle_fingerprint_s)
        self.objects = ObjectTable(cfg, self.counters, self.namespaces)
        self.segments = SegmentTable(placement_seed)
        self.pins = PinTable(self.objects, cfg.max_batch_keys)
        shares = Shares.configured(
            cfg.tenant_shares, cfg.tenant_shares_file, cfg.default_tenant_share
        )
        self.quotas = Quotas(shares, self.objects, self.segments, self.pins)
        self.evictor = Evictor(cfg, self.objects, self.segments, self._evict, self.quotas)
        self.journal = Journal(store, self.clock, self.namespaces)
        self.journal.pins = self.pins
        self.dormant = DormantReplicas()
        self.invalidation = Invalidation(
            self.clock,
            self.counters,
            objects=self.objects,
            namespaces=self.namespaces,
            dormant=self.dormant,
            journal=self.journal,
            delete=self._delete,
        )
        self.repairer = Repairer(self.objects, self.segments, self.clock, self.counters)
        self.tierer = Tierer(
            cfg, self.objects, self.segments, self.evictor, self.clock, self.counters
        )
        self.membership = Membership(
            cfg,
            self.clock,
            self.counters,
            objects=self.objects,
            segments=self.segments,
            dormant=self.dormant,
            journal=self.journal,
            repairer=self.repairer,
            on_event=self.on_event,
            delete=self._delete,
        )
        self._last_tick = self.clock.mono()
        self._removing: ObjectState | None = None
        if store is not None:
            self._load()

    @property
    def store(self) -> MetadataStore | None:
        return self.journal.store

    def _load(self) -> None:
        """Persisted objects come back as dormant replicas, waiting for their segments."""
        deadline = self.membership.grace_deadline()
        self.namespaces.restore(*self.journal.load_namespaces(), self.clock.mono())
        self.pins.restore(self.journal.load_pins())
        for stored in self.journal.load():
            self.dormant.add(stored, deadline)
        if self.dormant:
            log.info(
                "loaded %d committed objects from %s; waiting up to %.0fs for %d segments",
                len(self.dormant),
                self.journal.store.path if self.journal.store else "",
                self.cfg.dormant_grace_s,
                self.dormant.segments,
            )

    def flush(self) -> None:
        """Writes this call's changes in one transaction (the end of every mutating call)."""
        self.journal.flush()

    # ------------------------------------------------------------------ removal of objects

    def _delete(
        self, obj: ObjectState, reason: int, *, free: bool = True, persist: bool = True
    ) -> None:
        """Removes the committed ``obj``: frees its replicas' space (unless ``free`` is
        False: its segment is gone), journals its removal (``persist`` False: its row stays,
        listing dormant replicas) and publishes the removed event."""
        if free:
            self.segments.free(obj.replicas)
        self.objects.drop(obj)
        if persist:
            self.journal.mark_deleted(obj.key)
        else:
            self.journal.unmark(obj.key)
        self._removing = obj  # block_of answers for it while its event is recorded
        try:
            self.on_event(pb.KV_EVENT_REMOVED, obj.key, obj.size, reason)
        finally:
            self._removing = None

    def _evict(self, obj: ObjectState, tier: int) -> None:
        """Evicts ``obj``'s copies in ``tier``; the object leaves the store when no copy in
        another tier keeps it."""
        if all(r.tier == tier for r in obj.replicas):
            self._delete(obj, pb.KV_EVENT_REASON_EVICT)
            self.counters.evictions += 1
            return
        self.segments.free(self.objects.strip_tier(obj, tier))
        self.journal.mark(obj)
        if tier == MEMORY:
            self.counters.memory_evictions += 1
        self.on_event(pb.KV_EVENT_REMOVED, obj.key, obj.size, pb.KV_EVENT_REASON_TIER, tier)

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
        address: str = "",
        tier: int = pb.STORAGE_TIER_MEMORY,
    ) -> int:
        """Mounts (or idempotently remounts) a segment; returns how many replicas of ``held``
        and of dormant objects were restored on it. ``keeps_bytes`` False says the segment's
        memory is new (zeroed): nothing remembered on it survives. ``address``: the node's
        KVNodeService address, which re-replication and tier moves ask to copy. ``tier``:
        memory, or disk (the tier below, :mod:`.tiers`)."""
        restored = self.membership.mount(
            segment_id,
            node_id,
            size,
            endpoints,
            held,
            keeps_bytes=keeps_bytes,
            address=address,
            tier=tier,
        )
        self.flush()
        return restored

    def unmount(self, segment_id: str) -> int:
        """Removes a segment and every replica in it; returns how many objects lost their last
        replica (deleted, event reason ``KV_EVENT_REASON_UNMOUNT``)."""
        removed = self.membership.unmount(segment_id)
        self.flush()
        return removed

    def heartbeat(self, node_id: str, segment_ids: Sequence[str]) -> bool:
        """Records a heartbeat; returns True when the node must remount (the master does not
        know it or some of its segments, e.g. after a master restart or after it was declared
        dead).

        ``segment_ids`` is the node's full set: a segment the master holds for this node that
        is not listed is gone (e.g. the node process restarted with new segment ids) and is
        dropped with its replicas (event reason ``KV_EVENT_REASON_NODE_DEAD``)."""
        remount = self.membership.heartbeat(node_id, segment_ids)
        self.flush()
        return remount

    def alive_nodes(self) -> int:
        return self.segments.alive_nodes()

    def node_address(self, node_id: str) -> str:
        """The KVNodeService address ``node_id`` mounted with ("" = unknown)."""
        return self.segments.address_of(node_id)

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
        spaces: Sequence[tuple[str, str, Mapping[str, str]]] = (),
        space_of: Sequence[int] = (),
    ) -> list[PutStartOutcome]:
        """Allocates each ``(key, size)``. ``inline``, when given, holds each item's bytes
        for objects up to ``inline_max_bytes`` (b"" = not inlined); ``checksums`` each
        item's BLAKE3-16 (b"" = none); ``blocks`` each item's KV block metadata (None =
        none), kept with the object for its stored event. ``spaces``: the namespaces (root,
        digest, labels) named, ``space_of`` each item's (1 + index; 0 = none)."""
        cfg = self.cfg
        n_rep = check_put(cfg, len(items), replicas, ttl_ms, inline, checksums, blocks, space_of)
        strategy = self.segments.strategy(placement)
        if strategy is None:
            raise errors.InvalidArgument(f"options.placement={placement} is not a known strategy")
        now = self.clock.mono()
        named = self.namespaces.intern_all(spaces, now)
        out = []
        for i, (key, size) in enumerate(items):
            data = inline[i] if inline else b""
            checksum = checksums[i] if checksums else b""
            block = blocks[i] if blocks else None
            problem = item_problem(cfg, key, size, data, checksum, block)
            at = space_of[i] if space_of else 0
            if not problem and at > len(named):
                problem = f"namespace {at} names none of the request's {len(named)} namespaces"
            if problem:
                out.append(PutStartOutcome(key, pb.KV_INVALID, problem))
                continue
            ns = named[at - 1] if at else None
            if ns is not None and ns.fp.quarantine is not None:
                out.append(PutStartOutcome(key, pb.KV_QUARANTINED, "fingerprint quarantined"))
                continue
            old = self.objects.get(key)
            if old is not None:
                if old.ns is None and ns is not None:  # an unknown object's writer says whose
                    old.ns = ns
                    self.journal.mark(old)
                if not expired(old, now):
                    out.append(PutStartOutcome(key, OK, "already committed", already_exists=True))
                    continue
                if old.leased(now):
                    msg = "the expired previous copy is still being read"
                    out.append(PutStartOutcome(key, pb.KV_LEASED, msg))
                    continue
                self._delete(old, pb.KV_EVENT_REASON_TTL)
                self.counters.ttl_expired += 1
            writer = self.objects.pending(key)
            if writer is not None:
                msg = f"a put of this key by {writer.client_id!r} is in progress"
                out.append(PutStartOutcome(key, pb.KV_PUT_IN_PROGRESS, msg))
                continue
            alive = self.segments.alive_nodes()
            if alive < n_rep:
                msg = f"{n_rep} replicas requested, {alive} nodes alive"
                out.append(PutStartOutcome(key, pb.KV_NOT_ENOUGH_NODES, msg))
                continue
            locs = self.evictor.make_room(strategy, size, n_rep, now)
            if locs is None:
                msg = f"no room for {size} bytes on {n_rep} distinct nodes, even after eviction"
                out.append(PutStartOutcome(key, pb.KV_NO_SPACE, msg))
                continue
            self.objects.add_pending(
                ObjectState(
                    key,
                    size,
                    locs,
                    soft_pin=soft_pin,
                    ttl_ms=ttl_ms,
                    put_deadline=now + cfg.put_timeout_s,
                    client_id=client_id,
                    inline=data,
                    checksum=checksum,
                    want=n_rep,
                    block=block,
                    ns=ns,
                )
            )
            out.append(PutStartOutcome(key, OK, replicas=tuple(locs)))
        self.evictor.to_watermarks(now)
        self.flush()
        return out

    def put_end(self, client_id: str, keys: Sequence[str]) -> list[KeyOutcome]:
        check_batch(self.cfg, len(keys))
        now = self.clock.mono()
        out = []
        for key in keys:
            obj = self.objects.owned_pending(client_id, key)
            if isinstance(obj, KeyOutcome):
                out.append(obj)
                continue
            self.objects.take_pending(key)
            if not obj.replicas:
                msg = "every replica's node died during the put"
                out.append(KeyOutcome(key, pb.KV_NOT_ENOUGH_NODES, msg))
                continue
            self.objects.commit(obj, now)
            self.pins.committed(obj, self.quotas.memory_share)
            self.journal.mark(obj)
            self.on_event(pb.KV_EVENT_STORED, key, obj.size, pb.KV_EVENT_REASON_UNSPECIFIED)
            out.append(KeyOutcome(key, OK))
        self.objects.touch([o.key for o in out if o.code == OK])
        self.flush()
        return out

    def put_revoke(self, client_id: str, keys: Sequence[str]) -> list[KeyOutcome]:
        check_batch(self.cfg, len(keys))
        out = []
        for key in keys:
            obj = self.objects.owned_pending(client_id, key)
            if isinstance(obj, KeyOutcome):
                out.append(obj)
                continue
            self.objects.take_pending(key)
            self.segments.free(obj.replicas)
            out.append(KeyOutcome(key, OK))
        return out

    # ------------------------------------------------------------------ reads

    def get_replicas(
        self, client_id: str, keys: Sequence[str], lease_ms: int = 0
    ) -> list[GetOutcome]:
        check_batch(self.cfg, len(keys))
        return self._read(
            self.objects.get_replicas(
                client_id, keys, self._lease_s(lease_ms), self.clock.mono(), self.clock.wall_ms()
            )
        )

    def _read(self, out: list[GetOutcome]) -> list[GetOutcome]:
        """``out``, handed to a reader: the objects only disk copies hold are wanted back in
        memory (:meth:`.tiers.Tierer.read`)."""
        for got in out:
            if got.replicas and got.replicas[0].on_disk:  # memory copies come first
                obj = self.objects.get(got.key)
                if obj is not None:
                    self.tierer.read(obj)
        return out

    def _lease_s(self, lease_ms: int) -> float:
        """The read lease a get asking for ``lease_ms`` (0 = the default) is granted
        (seconds); InvalidArgument past ``max_lease_ms``."""
        if lease_ms > self.cfg.max_lease_ms:
            raise errors.InvalidArgument(
                f"lease_ms={lease_ms} exceeds max_lease_ms={self.cfg.max_lease_ms}"
            )
        return (lease_ms or self.cfg.default_lease_ms) / 1000

    def release(self, client_id: str, keys: Sequence[str]) -> list[KeyOutcome]:
        check_batch(self.cfg, len(keys))
        return self.objects.release(client_id, keys)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        check_batch(self.cfg, len(keys))
        return self.objects.exists(keys, self.clock.mono())

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """Number of leading keys that are committed (see
        :meth:`.objects.ObjectTable.longest_prefix`)."""
        check_batch(self.cfg, len(keys))
        return self.objects.longest_prefix(keys, self.clock.mono())

    def prefix_replicas(
        self, client_id: str, keys: Sequence[str], lease_ms: int = 0
    ) -> list[GetOutcome]:
        """The leading committed ``keys`` (as :meth:`longest_prefix`) with their replicas,
        read-leased to ``client_id`` as :meth:`get_replicas` leases them (see
        :meth:`.objects.ObjectTable.prefix_replicas`)."""
        check_batch(self.cfg, len(keys))
        return self._read(
            self.objects.prefix_replicas(
                client_id, keys, self._lease_s(lease_ms), self.clock.mono(), self.clock.wall_ms()
            )
        )

    def visible_keys(self) -> list[str]:
        """Every key a reader can see now (a KV event snapshot)."""
        return self.objects.visible_keys(self.clock.mono())

    def tiers_of(self, key: str) -> list[int]:
        """The tiers (pb.StorageTier) of the committed object ``key``'s copies, memory first
        ([] = no such object), also for the object being removed while its removed event is
        recorded."""
        removing = self._removing
        obj = removing if removing is not None and removing.key == key else self.objects.get(key)
        return [] if obj is None else sorted({r.tier for r in obj.replicas})

    def block_of(self, key: str) -> BlockMeta | None:
        """The KV block metadata the committed object ``key`` was put with (None = none),
        also for the object being removed while its removed event is recorded (its KV event
        names the engine's block hashes too)."""
        removing = self._removing
        obj = removing if removing is not None and removing.key == key else self.objects.get(key)
        return obj.block if obj is not None else None

    # ------------------------------------------------------------------ removal

    def remove(self, keys: Sequence[str], owner: str = "") -> list[KeyOutcome]:
        """Removes committed objects; with ``owner``, only those whose writer's client id
        starts with it (an identity's prefix; see :mod:`.auth`)."""
        check_batch(self.cfg, len(keys))
        now = self.clock.mono()
        out = []
        for key in keys:
            obj = self.objects.get(key)
            if obj is None:
                problem = key_problem(self.cfg, key)
                if problem:
                    out.append(KeyOutcome(key, pb.KV_INVALID, problem))
                elif self.objects.pending(key) is not None:
                    out.append(KeyOutcome(key, pb.KV_PUT_IN_PROGRESS, "the put is not finished"))
                else:
                    out.append(KeyOutcome(key, pb.KV_NOT_FOUND, "no such object"))
            elif owner and not obj.client_id.startswith(owner):
                out.append(KeyOutcome(key, pb.KV_NOT_OWNER, "another writer stored this object"))
            elif obj.leased(now):
                msg = f"leased by {len(obj.leases)} reader(s); retry later"
                out.append(KeyOutcome(key, pb.KV_LEASED, msg))
            else:
                self._delete(obj, pb.KV_EVENT_REASON_REMOVE)
                self.counters.removals += 1
                out.append(KeyOutcome(key, OK))
        self.flush()
        return out

    # ------------------------------------------------------------------ namespaces

    def drop_namespaces(
        self, digests: Sequence[str], roots: Sequence[str], dry: bool
    ) -> DropReport:
        report = self.invalidation.drop(digests, roots, dry)
        self.flush()
        return report

    def set_quarantine(self, digest: str, on: bool, reason: str, by: str) -> tuple[bool, int]:
        out = self.invalidation.set_quarantine(digest, on, reason, by)
        self.flush()
        return out

    # ------------------------------------------------------------------ housekeeping

    def tick(self) -> None:
        """Periodic pass: dead nodes, TTL expiry, put timeouts, dormant grace, watermarks."""
        cfg = self.cfg
        now = self.clock.mono()
        stalled = now - self._last_tick - cfg.tick_interval_ms / 1000
        self._last_tick = now
        if stalled > cfg.heartbeat_interval_ms / 1000:
            # The master did not run (stopped, swapped out, a long pause): heartbeats sent
            # meanwhile were not heard. That time does not count against the nodes.
            log.warning(
                "housekeeping ran %.1fs late; not counting it as missed heartbeats", stalled
            )
            self.counters.stalls += 1
            self.segments.forgive(stalled, now)
        dead_after = cfg.heartbeat_interval_ms * cfg.heartbeat_miss_limit / 1000
        for node in self.segments.overdue(now, dead_after):
            self.membership.node_dead(node)
        for obj in self.objects.expired_ttls(now):
            self._delete(obj, pb.KV_EVENT_REASON_TTL)
            self.counters.ttl_expired += 1
        for obj in self.objects.timed_out_puts(now):
            self.segments.free(obj.replicas)
            self.counters.put_timeouts += 1
            log.warning("put of %r by %r timed out; space reclaimed", obj.key, obj.client_id)
        self.membership.expire_dormant(now)
        self.invalidation.reap(now)
        self.evictor.to_watermarks(now)
        self.flush()

    # ------------------------------------------------------------------ re-replication

    def under_replicated(self) -> int:
        return self.repairer.under_replicated()

    def repair_jobs(self, limit: int) -> list[RepairJob]:
        """Up to ``limit`` copies to make (see :meth:`.repair.Repairer.jobs`), then up to
        ``max_tier_moves_per_tick`` moves between tiers (:meth:`.tiers.Tierer.jobs`)."""
        return self.repairer.jobs(limit) + self.tierer.jobs(self.cfg.max_tier_moves_per_tick)

    def repair_done(self, job: RepairJob, ok: bool) -> bool:
        """Records a copy's outcome; True when the target became a replica."""
        made = self.tierer.done(job, ok) if job.move else self.repairer.done(job, ok)
        if made and job.move:
            tier = job.target.tier
            self.on_event(pb.KV_EVENT_STORED, job.key, job.size, pb.KV_EVENT_REASON_TIER, tier)
        if made:
            self.journal.mark(job.obj)
            self.flush()
        return made

    # ------------------------------------------------------------------ stats

    def stats(self) -> StoreStats:
        return store_stats(self.objects, self.segments, self.counters, self.namespaces)
