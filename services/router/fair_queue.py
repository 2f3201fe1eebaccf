"""Weighted fair queueing across tenants, priority order within a tenant: which waiting request
the router's admission control (:mod:`~pdserve.services.router.admission`) lets in next.

Each tenant has a share (``share=`` in the tenants file, :mod:`pdserve.tenants`; 1 when unset)
and a virtual finish tag ``F``. Admitting one of its requests costs it ``1 / share`` of
virtual time: the request starts at ``S = max(V, F)`` and finishes at ``S + 1 / share``,
which becomes the tenant's ``F``; the queue's virtual time ``V`` moves to that ``S``. The next
request admitted is the head of the tenant whose head would finish first (ties: the one that
arrived first). So backlogged tenants are admitted in proportion to their shares (2:1 shares,
2:1 admissions), and a tenant that floods only moves its own ``F`` ahead: another tenant's
request arriving meanwhile starts at ``V`` and goes next, whatever the flood has queued. A
tenant idle for a while starts at ``V``, not at its old ``F``: no credit is saved up.
Requests admitted without waiting (a free slot, nobody queued) are charged the same way
(:meth:`FairQueue.charge`), so what a tenant used before saturation counts too.

Within a tenant, requests go by ``priority`` (lower first, vLLM's rule), then by arrival.
Priorities do not cross tenants: a tenant's urgent request jumps its own queue, never another
tenant's share.

The engine orders its waiting prompts by the priority the router sends it, so that priority
carries the tenant's fairness position too (:func:`engine_priority`): the caller's priority
first, then the tenant's rank, how many whole fair shares of the router's slots it used when
this one was admitted (the admission control's ``used`` over its ``fair_slots``). A light
tenant's prompt (rank 0) prefills before those of a flood past its share (rank 1 and up) at
the same caller priority, and within a tenant a lower priority still goes first. Ranks are
coarse on purpose: the engine batches only the prompts of its best waiting priority into a
step, and a rank per request in flight would cut a flood's prompts into steps of one.

Plain logic, no asyncio: the admission control queues futures in it and tests drive it
deterministically.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

#: Ranks per caller priority in :func:`engine_priority` (0..RANK_STRIDE - 1).
RANK_STRIDE = 256
#: Caller priorities in [-PRIORITY_BOUND, PRIORITY_BOUND) keep their order in the engine.
PRIORITY_BOUND = 2**31 // RANK_STRIDE


def engine_priority(priority: int, rank: int) -> int:
    """The int32 priority the engine gets for a request of caller ``priority`` (lower first)
    whose tenant's rank was ``rank`` when it was admitted (the module docstring): ``priority *
    RANK_STRIDE + rank``. Order between caller priorities is kept within ±PRIORITY_BOUND (2^23;
    beyond, they saturate there); ranks past RANK_STRIDE - 1 count as RANK_STRIDE - 1."""
    p = min(max(priority, -PRIORITY_BOUND), PRIORITY_BOUND - 1)
    return p * RANK_STRIDE + min(max(rank, 0), RANK_STRIDE - 1)


@dataclass(order=True)
class _Entry(Generic[T]):
    priority: int
    seq: int
    tenant: str = field(compare=False)
    item: T = field(compare=False)
    removed: bool = field(default=False, compare=False)


class FairQueue(Generic[T]):
    """Items queued per tenant; :meth:`pop` hands out the next by the module's rule."""

    def __init__(self, share: Callable[[str], float] | None = None) -> None:
        """``share(tenant)``: the tenant's weight (> 0); 1 for every tenant when None."""
        self._share = share or (lambda tenant: 1.0)
        #: Per tenant, a heap of (priority, arrival) with lazily removed entries.
        self._heaps: dict[str, list[_Entry[T]]] = {}
        self._live: dict[str, int] = {}
        self._finish: dict[str, float] = {}
        self._by_item: dict[int, _Entry[T]] = {}
        self._seq = itertools.count()
        #: Virtual time: the start tag of the request admitted last.
        self.vtime = 0.0

    def __len__(self) -> int:
        return len(self._by_item)

    def queued(self, tenant: str) -> int:
        """Items of ``tenant`` waiting."""
        return self._live.get(tenant, 0)

    def waiting_tenants(self) -> list[str]:
        """The tenants with items waiting."""
        return [tenant for tenant, n in self._live.items() if n]

    def push(self, tenant: str, item: T, priority: int = 0) -> None:
        """Queues ``item`` for ``tenant`` (each item at most once)."""
        assert id(item) not in self._by_item, "item queued twice"
        entry = _Entry(priority, next(self._seq), tenant, item)
        heapq.heappush(self._heaps.setdefault(tenant, []), entry)
        self._live[tenant] = self._live.get(tenant, 0) + 1
        self._by_item[id(item)] = entry

    def remove(self, item: T) -> bool:
        """Takes ``item`` out unserved (a cancelled waiter); False when it is not queued."""
        entry = self._by_item.pop(id(item), None)
        if entry is None:
            return False
        entry.removed = True
        self._live[entry.tenant] -= 1
        return True

    def peek_tenant(self, eligible: Callable[[str], bool] | None = None) -> str | None:
        """The tenant whose head :meth:`pop` would hand out, None when empty; ``eligible``:
        among the tenants it says yes to only (None when none of them has items waiting)."""
        best: tuple[float, int] | None = None
        chosen = None
        for tenant, heap in self._heaps.items():
            head = self._head(heap)
            if head is None or (eligible is not None and not eligible(tenant)):
                continue
            key = (self._start(tenant) + 1.0 / self._share(tenant), head.seq)
            if best is None or key < best:
                best, chosen = key, tenant
        return chosen

    def pop(self, tenant: str | None = None) -> tuple[str, T]:
        """The next item and its tenant, the tenant charged for it; ``tenant``: that tenant's
        head instead. IndexError when there is none."""
        if tenant is None:
            tenant = self.peek_tenant()
        if tenant is None or self._head(self._heaps.get(tenant, [])) is None:
            raise IndexError("pop from an empty FairQueue")
        entry = heapq.heappop(self._heaps[tenant])
        del self._by_item[id(entry.item)]
        self._live[tenant] -= 1
        self.charge(tenant)
        return tenant, entry.item

    def charge(self, tenant: str) -> None:
        """Counts one admission of ``tenant`` (:meth:`pop` does; the admission control calls
        it for a request admitted without waiting)."""
        start = self._start(tenant)
        self._finish[tenant] = start + 1.0 / self._share(tenant)
        self.vtime = start

    def _start(self, tenant: str) -> float:
        return max(self.vtime, self._finish.get(tenant, 0.0))

    def _head(self, heap: list[_Entry[T]]) -> _Entry[T] | None:
        while heap and heap[0].removed:
            heapq.heappop(heap)
        return heap[0] if heap else None
