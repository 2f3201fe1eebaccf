"""Tenants' shares of the pool: how many bytes of each tier a tenant may hold before its
objects are the first to go (docs/architecture.md, "Tenant shares and pins").

A tenant is the router's tenant name that the writer of a chunk put into its
``KVNamespace.tenant`` (:mod:`.namespaces`; "" = no tenant, which has a share too: the
default). ``kvstore_master.tenant_shares`` gives a tenant its share of the memory tier and of
the disk tier, each a fraction of the tier's capacity (alive segments, now) or bytes; tenants
not listed get ``default_tenant_share`` (1 = the whole tier: no limit).

Eviction (:mod:`.eviction`) asks :meth:`Quotas.order` for its candidates: objects of tenants
over their share of the tier come first, the most over first (bytes over its share, updated
as each copy goes), then the rest in the evictor's own order. So a tenant within its share
loses nothing to another tenant's flood while an over-share tenant has something to evict.
Pinned objects (:mod:`.pins`) are never candidates. Usage counts replica bytes in the tier
(an object with two memory copies holds twice its size there), as the tier's capacity does.

Plain and single-threaded, like the master state; no network, no protobuf messages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from pdserve import errors
from pdserve.services.kvstore.master.namespaces import tenant_problem
from pdserve.services.kvstore.master.objects import ObjectTable
from pdserve.services.kvstore.master.pins import PinReport, PinTable
from pdserve.services.kvstore.master.segments import SegmentTable
from pdserve.services.kvstore.master.shares import DISK, MEMORY, Shares
from pdserve.services.kvstore.master.types import ObjectState

#: Eviction reasons counted per tenant (``pdserve_kvstore_master_tenant_evictions_total``).
OVER_SHARE = "over_share"
NORMAL = "normal"


@dataclass(frozen=True)
class TenantReport:
    """One tenant's use of the pool (``TenantUsage``; bytes, counts)."""

    tenant: str
    memory_bytes: int
    disk_bytes: int
    memory_share_bytes: int
    disk_share_bytes: int
    pinned_bytes: int
    evictions_over_share: int
    evictions_normal: int


class Quotas:
    """Shares, usage and the over-share-first eviction order (see the module docstring)."""

    def __init__(
        self, shares: Shares, objects: ObjectTable, segments: SegmentTable, pins: PinTable
    ) -> None:
        self.shares = shares
        self.objects = objects
        self.segments = segments
        self.pins = pins
        #: (tenant, reason) -> copies evicted since start.
        self.evictions: dict[tuple[str, str], int] = {}
        # The eviction pass under way: (tier, usage by tenant, share by tenant), live.
        self._live: tuple[int, dict[str, int], dict[str, int]] | None = None

    def share(self, tenant: str, tier: int) -> int:
        """``tenant``'s share of ``tier`` now (bytes)."""
        return self.shares.of(tenant, tier).of(self.segments.capacity(tier))

    def memory_share(self, tenant: str) -> int:
        """``tenant``'s share of the memory tier now (bytes): what its pins may hold."""
        return self.share(tenant, MEMORY)

    def pin(
        self, tenant: str, name: str, keys: Sequence[str], now_ms: int
    ) -> tuple[PinReport, int, int]:
        """Pins ``keys`` for ``tenant`` within its memory share (:meth:`.pins.PinTable.pin`);
        returns the pin, the tenant's pinned bytes in all and its memory share (bytes)."""
        share = self.memory_share(tenant)
        pin, total = self.pins.pin(tenant, name, keys, share, now_ms)
        return pin, total, share

    def usage(self, tier: int) -> dict[str, int]:
        """Bytes each tenant's copies hold in ``tier`` (one pass over the objects)."""
        return _usage_of(self.objects.values(), tier)

    def order(
        self,
        base: Iterable[ObjectState],
        tier: int,
        evictable: Callable[[ObjectState], bool],
        whole_tier: bool,
    ) -> Iterator[ObjectState]:
        """The eviction order of ``base`` (the evictor's order of the objects with a copy in
        ``tier``, not yet checked: ``evictable`` says whether one may go now; ``whole_tier``:
        ``base`` is every such object of the pool, not one segment's), without the pinned
        objects, over-share tenants' first when some share is limited."""
        self._live = None
        holds = self.pins.holds
        if not self.shares.limited:
            return (o for o in base if not holds(o) and evictable(o))
        return self._over_share_first(base, tier, evictable, whole_tier)

    def _over_share_first(
        self,
        base: Iterable[ObjectState],
        tier: int,
        evictable: Callable[[ObjectState], bool],
        whole_tier: bool,
    ) -> Iterator[ObjectState]:
        objs = list(base)
        usage = _usage_of(objs, tier) if whole_tier else self.usage(tier)
        share = {t: self.share(t, tier) for t in usage}
        self._live = (tier, usage, share)
        queues: dict[str, deque[ObjectState]] = {t: deque() for t in usage if usage[t] > share[t]}
        if queues:
            for obj in objs:
                q = queues.get(obj.ns.tenant if obj.ns is not None else "")
                if q is not None:
                    q.append(obj)
        holds = self.pins.holds
        taken: set[int] = set()
        while True:
            # NOTE: usage drops as the caller evicts (:meth:`evicted`), so this picks anew
            live = [
                (usage[t] - share[t], t) for t, q in queues.items() if q and usage[t] > share[t]
            ]
            if not live:
                break
            obj = queues[max(live)[1]].popleft()
            if not holds(obj) and evictable(obj):
                taken.add(id(obj))
                yield obj
        for obj in objs:
            if id(obj) not in taken and not holds(obj) and evictable(obj):
                yield obj

    def evicted(self, obj: ObjectState, tier: int) -> None:
        """``obj``'s copies in ``tier`` are about to be evicted: counted for its tenant, as
        over its share or normal, and taken off the pass's usage."""
        t = obj.tenant
        reason = NORMAL
        live = self._live
        if live is not None and live[0] == tier:
            _, usage, share = live
            if usage.get(t, 0) > share.get(t, 0):
                reason = OVER_SHARE
            usage[t] = usage.get(t, 0) - obj.size * sum(1 for r in obj.replicas if r.tier == tier)
        self.evictions[(t, reason)] = self.evictions.get((t, reason), 0) + 1

    def report(self, tenant: str | None = None) -> list[TenantReport]:
        """Each tenant's use (only ``tenant``'s when given; InvalidArgument for a malformed
        name), by name: every tenant with objects, a share, a pin or an eviction, and ""
        (no tenant) always."""
        problem = tenant_problem("tenant", tenant) if tenant else ""
        if problem:
            raise errors.InvalidArgument(problem)
        memory, disk = self.usage(MEMORY), self.usage(DISK)
        names = {"", *memory, *disk, *self.shares.by_tenant, *self.pins.tenants()}
        names |= {t for t, _ in self.evictions}
        if tenant is not None:
            names = {tenant}
        return [
            TenantReport(
                t,
                memory.get(t, 0),
                disk.get(t, 0),
                self.share(t, MEMORY),
                self.share(t, DISK),
                self.pins.pinned_bytes(t),
                self.evictions.get((t, OVER_SHARE), 0),
                self.evictions.get((t, NORMAL), 0),
            )
            for t in sorted(names)
        ]


def _usage_of(objs: Iterable[ObjectState], tier: int) -> dict[str, int]:
    """Bytes each tenant's copies among ``objs`` hold in ``tier``."""
    out: dict[str, int] = {}
    for obj in objs:
        n = 0
        for r in obj.replicas:
            if r.tier == tier:
                n += 1
        if n:
            t = obj.ns.tenant if obj.ns is not None else ""
            out[t] = out.get(t, 0) + n * obj.size
    return out
