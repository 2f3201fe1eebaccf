"""Weighted fair queueing across tenants and priority within one (services/router/fair_queue.py),
alone and inside the admission control, deterministically, without a network."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from pdserve.errors import ResourceExhausted
from pdserve.services.router.admission import Admission
from pdserve.services.router.fair_queue import FairQueue
from pdserve.telemetry import REGISTRY
from pdserve.tenants import TenantLimits, Tenants


def _metric(name: str, tenant: str) -> float:
    return REGISTRY.get_sample_value(name, {"tenant": tenant}) or 0.0


def _drain(q: FairQueue[str], n: int) -> list[str]:
    return [q.pop()[1] for _ in range(n)]


def test_a_light_tenant_goes_next_past_a_flood_with_equal_shares() -> None:
    q: FairQueue[str] = FairQueue()
    q.charge("heavy")  # the flood holds the one slot: it was admitted first
    for i in range(50):
        q.push("heavy", f"h{i}")
    q.push("light", "l0")
    assert q.queued("heavy") == 50 and q.queued("light") == 1 and len(q) == 51
    assert q.pop() == ("light", "l0")
    assert _drain(q, 50) == [f"h{i}" for i in range(50)]  # then the flood, in arrival order
    with pytest.raises(IndexError):
        q.pop()


def test_with_nothing_admitted_yet_equal_tenants_alternate() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(5):
        q.push("heavy", f"h{i}")
    q.push("light", "l0")
    q.push("light", "l1")
    # heavy arrived first so goes first on the tie, then the two alternate
    assert _drain(q, 5) == ["h0", "l0", "h1", "l1", "h2"]


def test_shares_two_to_one_admit_two_to_one() -> None:
    shares = {"a": 2.0, "b": 1.0}
    q: FairQueue[str] = FairQueue(lambda t: shares[t])
    for i in range(60):
        q.push("a", f"a{i}")
        q.push("b", f"b{i}")
    first = _drain(q, 30)
    counts = Counter(item[0] for item in first)
    assert counts == {"a": 20, "b": 10}
    # and at every point the split stays within one request of 2:1
    for k in range(1, 31):
        a = sum(1 for item in first[:k] if item[0] == "a")
        assert abs(a - 2 * k / 3) <= 1, (k, first[:k])


def test_an_idle_tenant_saves_no_credit() -> None:
    q: FairQueue[str] = FairQueue()
    for _ in range(20):  # "b" alone for a while: admitted at once, charged each time
        q.charge("b")
    for i in range(4):
        q.push("a", f"a{i}")  # "a" was idle all along, then floods
        q.push("b", f"b{i}")
    # "a" does not get 20 turns in a row for its idle time: the two alternate
    assert _drain(q, 4) == ["a0", "b0", "a1", "b1"]


def test_priority_orders_within_a_tenant_only() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a", "a-late", priority=5)
    q.push("a", "a-normal")
    q.push("a", "a-urgent", priority=-3)
    q.push("a", "a-normal2")
    q.push("b", "b-normal", priority=10)
    # a's urgent one first within a; b's turn comes whatever its priority number
    assert _drain(q, 5) == ["a-urgent", "b-normal", "a-normal", "a-normal2", "a-late"]


def test_removed_items_are_skipped_and_not_charged() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a", "a0")
    q.push("a", "a1")
    q.push("b", "b0")
    assert q.remove("a0") and not q.remove("a0") and not q.remove("zz")
    assert q.queued("a") == 1 and len(q) == 2
    assert _drain(q, 2) == ["a1", "b0"]


async def _holder(
    adm: Admission, tenant: str, name: str, got: list[str], go: asyncio.Event, *, priority: int = 0
) -> None:
    """One request of ``tenant``: admitted, it records ``name``, then holds its slot until
    ``go``."""
    async with adm.admit(1, 1, tenant=tenant, priority=priority):
        got.append(name)
        await go.wait()


async def _until(cond, what: str) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never: {what}")


def test_admission_lets_the_light_tenant_in_before_the_flood() -> None:
    async def main() -> None:
        tenants = Tenants(limits={"heavy": TenantLimits(share=1.0)})
        adm = Admission(max_inflight=1, max_queue=100, tenants=tenants)
        got: list[str] = []
        gates = {name: asyncio.Event() for name in ["h-first", *[f"h{i}" for i in range(10)]]}
        gates["l0"] = asyncio.Event()
        tasks = [asyncio.ensure_future(_holder(adm, "heavy", "h-first", got, gates["h-first"]))]
        await _until(lambda: got == ["h-first"], "the first request holds the slot")
        for i in range(10):
            tasks.append(asyncio.ensure_future(_holder(adm, "heavy", f"h{i}", got, gates[f"h{i}"])))
        await _until(lambda: adm.waiting == 10, "ten heavy requests wait")
        tasks.append(asyncio.ensure_future(_holder(adm, "light", "l0", got, gates["l0"])))
        await _until(lambda: adm.waiting == 11, "the light request waits")
        assert _metric("pdserve_router_tenant_queued", "heavy") == 10
        assert _metric("pdserve_router_tenant_queued", "light") == 1
        before = _metric("pdserve_router_tenant_admitted_total", "light")
        gates["h-first"].set()
        await _until(lambda: len(got) == 2, "the next request is admitted")
        assert got[1] == "l0"
        assert _metric("pdserve_router_tenant_admitted_total", "light") == before + 1
        for gate in gates.values():
            gate.set()
        await asyncio.gather(*tasks)
        assert got[2:] == [f"h{i}" for i in range(10)] and adm.inflight == 0

    asyncio.run(main())


def test_admission_orders_a_tenants_queue_by_priority() -> None:
    async def main() -> None:
        adm = Admission(max_inflight=1, max_queue=100)
        got: list[str] = []
        go = asyncio.Event()
        first = asyncio.ensure_future(_holder(adm, "a", "first", got, go))
        await _until(lambda: got == ["first"], "the first request holds the slot")
        tasks = [
            asyncio.ensure_future(_holder(adm, "a", name, got, go, priority=p))
            for name, p in (("p0", 0), ("p5", 5), ("p-1", -1), ("p0b", 0))
        ]
        await _until(lambda: adm.waiting == 4, "four wait")
        go.set()
        await asyncio.gather(first, *tasks)
        assert got == ["first", "p-1", "p0", "p0b", "p5"]

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_the_fair_queue() -> None:
    async def main() -> None:
        adm = Admission(max_inflight=1, max_queue=100)
        got: list[str] = []
        go = asyncio.Event()
        first = asyncio.ensure_future(_holder(adm, "a", "first", got, go))
        await _until(lambda: got == ["first"], "the first request holds the slot")
        gone = asyncio.ensure_future(_holder(adm, "b", "gone", got, go))
        stays = asyncio.ensure_future(_holder(adm, "c", "stays", got, go))
        await _until(lambda: adm.waiting == 2, "two wait")
        gone.cancel()
        await _until(lambda: adm.waiting == 1, "the cancelled one left")
        assert _metric("pdserve_router_tenant_queued", "b") == 0
        go.set()
        await asyncio.gather(first, stays)
        assert got == ["first", "stays"] and adm.inflight == 0

    asyncio.run(main())


def test_a_flood_fills_its_own_queue_not_another_tenants() -> None:
    async def main() -> None:
        adm = Admission(max_inflight=1, max_queue=2)
        got: list[str] = []
        go = asyncio.Event()
        tasks = [asyncio.ensure_future(_holder(adm, "heavy", "h0", got, go))]
        await _until(lambda: got == ["h0"], "the first request holds the slot")
        tasks += [asyncio.ensure_future(_holder(adm, "heavy", f"h{i}", got, go)) for i in (1, 2)]
        await _until(lambda: adm.waiting == 2, "heavy's queue is full")
        with pytest.raises(ResourceExhausted, match=r"queue full: 2 requests of tenant 'heavy'"):
            adm.check(1, 1, "heavy")
        tasks.append(asyncio.ensure_future(_holder(adm, "light", "l0", got, go)))
        await _until(lambda: adm.waiting == 3, "light still queues")
        go.set()
        await asyncio.gather(*tasks)
        assert got == ["h0", "l0", "h1", "h2"]

    asyncio.run(main())


def test_peek_and_pop_among_eligible_tenants_or_one_tenant() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a", "a0")
    q.push("b", "b0")
    q.push("b", "b1")
    assert q.peek_tenant() == "a" and q.peek_tenant(lambda t: t != "a") == "b"
    assert q.peek_tenant(lambda t: False) is None and q.waiting_tenants() == ["a", "b"]
    assert q.pop("b") == ("b", "b0")  # b's head, a still first in the fair order
    assert q.pop() == ("a", "a0")
    with pytest.raises(IndexError):
        q.pop("a")
    assert q.waiting_tenants() == ["b"]
