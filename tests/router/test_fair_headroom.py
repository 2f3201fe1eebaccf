"""Headroom for tenants below their fair share and the engine priority that carries a tenant's
fairness rank (services/router/admission.py, fair_queue.py), deterministically, without a
network; then the mapped priority in the worker requests of an in-process router."""

from __future__ import annotations

import asyncio
import itertools
import math

import pytest
from router_fakes import FakeDecode, FakePrefill, fake_cluster

from pdserve import grpcutil
from pdserve.config import ConfigError
from pdserve.services.router.admission import Admission, Ticket
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.fair_queue import PRIORITY_BOUND, RANK_STRIDE, engine_priority
from pdserve.tenants import TenantLimits, Tenants
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

I32 = 2**31


class _Requests:
    """Requests held in flight on an admission control until released, by name."""

    def __init__(self, adm: Admission) -> None:
        self.adm = adm
        self.got: list[str] = []
        self.tickets: dict[str, Ticket] = {}
        self._gates: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def send(self, tenant: str, name: str, priority: int = 0) -> None:
        gate = self._gates[name] = asyncio.Event()

        async def one() -> None:
            async with self.adm.admit(1, 1, tenant=tenant, priority=priority) as ticket:
                self.got.append(name)
                self.tickets[name] = ticket
                await gate.wait()

        self._tasks[name] = asyncio.ensure_future(one())

    async def release(self, name: str) -> None:
        self._gates[name].set()
        await self._tasks.pop(name)

    async def release_all(self) -> None:
        """Releases every request, those still waiting as they are admitted."""
        for gate in self._gates.values():
            gate.set()
        await asyncio.gather(*self._tasks.values())
        self._tasks.clear()


async def _settle() -> None:
    """Lets every task that can run do so (admissions and wake-ups are synchronous steps)."""
    for _ in range(20):
        await asyncio.sleep(0)


def _two_tenants(shares: dict[str, float] | None = None) -> Tenants:
    shares = shares or {"heavy": 1.0, "light": 1.0}
    return Tenants(limits={t: TenantLimits(share=s) for t, s in shares.items()})


class _Clock:
    """Seconds that pass only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_tenant_with_nothing_in_flight_is_admitted_beyond_the_limit() -> None:
    async def main() -> None:
        clock = _Clock()
        adm = Admission(2, 100, tenants=_two_tenants(), fair_headroom=1, clock=clock)
        r = _Requests(adm)
        for i in range(5):  # the flood: two hold the slots, three wait
            r.send("heavy", f"h{i}")
        await _settle()
        assert r.got == ["h0", "h1"] and adm.waiting == 3
        clock.now += 1000  # the flood has held both slots for a long while
        r.send("light", "l0")
        await _settle()
        assert r.got[-1] == "l0" and adm.inflight == 3  # at once, beside the flood
        r.send("light", "l1")  # the headroom is taken: it waits
        await _settle()
        assert r.got[-1] == "l0" and adm.waiting == 4
        await r.release("h0")  # back to the limit: the flood's slot went to the light tenant
        await _settle()  # (its l1 waits: a waiting tenant's use is what it holds, its share)
        assert adm.inflight == 2 and r.got[-1] == "l0"
        # a slot under the limit: fair queueing (equal tags, the flood queued first), then
        # the light tenant holds nothing again and takes the headroom
        await r.release("l0")
        await _settle()
        assert r.got[-2:] == ["h2", "l1"] and adm.inflight == 3
        await r.release_all()
        assert r.got == ["h0", "h1", "l0", "h2", "l1", "h3", "h4"] and adm.inflight == 0

    asyncio.run(main())


def test_a_light_tenants_burst_goes_beside_a_flood_that_has_held_its_slots() -> None:
    async def main() -> None:
        clock = _Clock()
        adm = Admission(2, 100, tenants=_two_tenants(), fair_headroom=3, clock=clock)
        r = _Requests(adm)
        for i in range(4):
            r.send("heavy", f"h{i}")
        await _settle()
        clock.now += 1000
        r.send("light", "w")  # the light tenant's history: a request of 5 s, then 5 s idle
        await _settle()
        clock.now += 5
        await r.release("w")
        clock.now += 5
        for i in range(3):  # three at once: more than its share of 1 slot, within headroom
            r.send("light", f"l{i}")
        await _settle()
        assert r.got == ["h0", "h1", "w", "l0", "l1", "l2"] and adm.inflight == 5
        assert adm.used("light") < 0.3 and adm.used("heavy") == 2  # heavy has some waiting
        assert [r.tickets[f"l{i}"].engine_priority for i in range(3)] == [0, 0, 0]
        r.send("light", "l3")  # past the headroom: it waits, and light counts what it holds
        await _settle()
        assert adm.used("light") == 3 and adm.waiting == 3
        await r.release("l0")  # so a freed headroom slot is for neither tenant now
        await _settle()
        assert adm.inflight == 4 and r.got[-1] == "l2"
        await r.release_all()
        assert sorted(r.got) == ["h0", "h1", "h2", "h3", "l0", "l1", "l2", "l3", "w"]

    asyncio.run(main())


def test_a_tenants_use_is_the_lesser_of_what_it_holds_and_its_recent_average() -> None:
    async def main() -> None:
        clock = _Clock()
        adm = Admission(8, 100, tenants=_two_tenants(), clock=clock)
        r = _Requests(adm)
        for i in range(3):
            r.send("heavy", f"h{i}")
        await _settle()
        assert adm.used("heavy") == 3  # no history yet: what it holds
        clock.now += 10  # one window: its average is 1 - 1/e of the way to 3
        assert adm.used("heavy") == pytest.approx(3 * (1 - math.exp(-1)))
        clock.now += 1000
        assert adm.used("heavy") == pytest.approx(3.0)
        await r.release("h0")
        await r.release("h1")
        assert adm.used("heavy") == 1  # holding fewer now counts at once
        assert adm.used("light") == 0
        await r.release("h2")
        clock.now += 10  # idle a whole window: it starts again with no history
        for i in range(3, 6):
            r.send("heavy", f"h{i}")
        await _settle()
        assert adm.used("heavy") == 3
        await r.release_all()

    asyncio.run(main())


def test_headroom_is_bounded_and_goes_to_a_waiting_tenant_when_it_frees() -> None:
    tenants = _two_tenants({"heavy": 1.0, "a": 1.0, "b": 1.0})

    async def main() -> None:
        clock = _Clock()
        adm = Admission(3, 100, tenants=tenants, fair_headroom=1, clock=clock)
        r = _Requests(adm)
        for i in range(4):
            r.send("heavy", f"h{i}")
        await _settle()
        clock.now += 1000
        r.send("a", "a0")
        r.send("b", "b0")
        await _settle()
        # a takes the one extra slot; b, below its share too, waits for headroom
        assert r.got == ["h0", "h1", "h2", "a0"] and adm.inflight == 4 and adm.waiting == 2
        await r.release("a0")  # the headroom frees: b is below its share, heavy is not
        await _settle()
        assert r.got[-1] == "b0" and adm.inflight == 4
        await r.release_all()
        assert r.got[-1] == "h3" and adm.inflight == 0

    asyncio.run(main())


def test_one_tenant_alone_never_exceeds_the_limit() -> None:
    async def main() -> None:
        adm = Admission(1, 100, fair_headroom=5)  # every caller the anonymous tenant
        r = _Requests(adm)
        r.send("", "first")
        r.send("", "second")
        await _settle()
        assert r.got == ["first"] and adm.inflight == 1 and adm.waiting == 1
        await r.release_all()
        assert r.got == ["first", "second"]

    asyncio.run(main())


def test_the_fair_share_counts_the_tenants_holding_or_waiting_by_share() -> None:
    async def main() -> None:
        adm = Admission(6, 100, tenants=_two_tenants({"a": 2.0, "b": 1.0}))
        assert adm.fair_slots("a") == 6  # alone
        r = _Requests(adm)
        r.send("b", "b0")
        await _settle()
        assert adm.fair_slots("a") == 4 and adm.fair_slots("b") == 6
        # headroom is for a tenant beside another: a is (b holds a slot), b alone is not
        assert adm.below_share("a") and not adm.below_share("b")
        await r.release_all()

    asyncio.run(main())


def test_engine_priority_keeps_the_callers_order_then_ranks() -> None:
    assert engine_priority(0, 0) == 0
    assert engine_priority(0, 3) == 3
    assert engine_priority(-5, 0) == -5 * RANK_STRIDE
    # a lower caller priority goes first whatever the ranks (within the bound)
    values = [-PRIORITY_BOUND, -1000, -1, 0, 1, 7, PRIORITY_BOUND - 1]
    ranks = [0, 1, RANK_STRIDE - 1, 10**6]
    for p, q in itertools.combinations(values, 2):
        assert max(engine_priority(p, r) for r in ranks) < min(engine_priority(q, r) for r in ranks)
    # int32 at the extremes; beyond the bound caller priorities saturate, never wrap
    assert engine_priority(-I32, 0) == -I32
    assert engine_priority(I32 - 1, 10**6) == I32 - 1
    assert engine_priority(-I32, 5) == engine_priority(-PRIORITY_BOUND - 1, 5) == -I32 + 5
    assert engine_priority(3, -1) == 3 * RANK_STRIDE  # no negative rank


def test_a_tickets_engine_priority_ranks_its_tenant_by_fair_shares_used() -> None:
    tenants = _two_tenants({"heavy": 1.0, "light": 1.0, "big": 2.0})

    async def main() -> None:
        clock = _Clock()
        adm = Admission(4, 100, tenants=tenants, fair_headroom=1, clock=clock)
        r = _Requests(adm)
        r.send("light", "l0")
        await _settle()
        for i in range(2):
            r.send("heavy", f"h{i}")
        await _settle()
        clock.now += 1000
        r.send("heavy", "h2")
        r.send("heavy", "h3", priority=-1)
        await _settle()
        # beside light, heavy's fair share is 2 slots: having used 2 for a long while, its third
        # request is past it
        ranks = {name: t.engine_priority for name, t in r.tickets.items()}
        assert ranks == {"l0": 0, "h0": 0, "h1": 0, "h2": 1} and adm.waiting == 1
        await r.release("l0")
        await _settle()  # h3 goes with heavy alone holding slots: its fair share is all 4
        assert r.tickets["h3"].engine_priority == engine_priority(-1, 0) == -RANK_STRIDE
        await r.release_all()
        adm = Admission(6, 100, tenants=tenants, clock=clock)
        r = _Requests(adm)
        r.send("heavy", "h0")
        for i in range(4):
            r.send("big", f"b{i}")
        await _settle()
        clock.now += 1000
        r.send("big", "b4")
        await _settle()
        # share 2 of 3 beside heavy: 4 of the 6 slots are big's fair share
        assert [r.tickets[f"b{i}"].engine_priority for i in range(5)] == [0, 0, 0, 0, 1]
        await r.release_all()

    asyncio.run(main())


def test_the_workers_get_the_callers_priority_with_the_rank(tiny_model_dir) -> None:
    async def main() -> None:
        p, d = FakePrefill(), FakeDecode()
        async with fake_cluster([p], [d], tiny_model_dir) as (router, _):
            req = router_pb2.GenerateRequest(
                prompt_token_ids=[5, 6, 7, 8, 9, 10, 11, 12, 13],
                sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0),
                priority=-2,
            )
            async with grpcutil.channel(f"127.0.0.1:{router.grpc_port}") as ch:
                resp = await router_pb2_grpc.RouterServiceStub(ch).Generate(req, timeout=20)
            assert len(resp.token_ids) == 3
        # nothing else in flight: rank 0 under the caller's priority, in both phases
        assert p.calls[0].priority == d.calls[0].priority == engine_priority(-2, 0) == -512

    asyncio.run(main())


def test_a_negative_fair_headroom_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"fair_headroom must be >= 0 \(0 = none\), got -1"):
        RouterConfig(decode=["127.0.0.1:1"], fair_headroom=-1).validate()
    RouterConfig(decode=["127.0.0.1:1"], fair_headroom=0).validate()
