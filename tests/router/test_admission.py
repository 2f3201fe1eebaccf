"""Admission control: bounded queue and SLO predictions."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.errors import ResourceExhausted
from pdserve.services.router.admission import DEFAULT_INFLIGHT, Admission


async def hold_slot(
    adm: Admission,
    name: str,
    got: list[str],
    release: asyncio.Event,
    entered: asyncio.Event | None = None,
) -> None:
    """One request: admitted, it records its name (and sets ``entered``), then keeps its
    in-flight slot until ``release``."""
    async with adm.admit(10, 1):
        got.append(name)
        if entered is not None:
            entered.set()
        await release.wait()


def test_queue_bound_and_fifo_slots():
    async def main():
        adm = Admission(max_inflight=1, max_queue=1)
        order = []
        entered = asyncio.Event()
        release = asyncio.Event()

        t1 = asyncio.ensure_future(hold_slot(adm, "a", order, release, entered))
        await entered.wait()
        t2 = asyncio.ensure_future(hold_slot(adm, "b", order, release))  # waits in the queue
        await asyncio.sleep(0.01)
        assert adm.waiting == 1 and adm.inflight == 1
        with pytest.raises(
            ResourceExhausted, match=r"queue full: 1 requests waiting \(max_queue=1\)"
        ):
            async with adm.admit(10, 1):
                pass
        release.set()
        await asyncio.gather(t1, t2)
        assert order == ["a", "b"] and adm.inflight == 0 and adm.pending_prefill_tokens == 0

    asyncio.run(main())


def test_ttft_slo_rejects_only_after_observations():
    adm = Admission(8, 8, slo_ttft_ms=500)
    adm.check(100_000, 1)  # nothing observed yet: admitted
    adm.observe_prefill(computed_tokens=1000, worker_ms=1000.0)  # 1 ms per token
    adm.observe_ttft(uncached_tokens=1000, ttft_ms=1050.0)  # base 50 ms
    assert adm.predicted_ttft_ms(200, 1) == pytest.approx(250.0)
    adm.check(200, 1)
    adm.pending_prefill_tokens = 600  # queued work on 2 workers: 300 each
    assert adm.predicted_ttft_ms(200, 2) == pytest.approx(550.0)
    with pytest.raises(ResourceExhausted, match="predicted time to first token 550 ms exceeds"):
        adm.check(200, 2)


def test_tpot_slo_rejects_while_running_slow():
    adm = Admission(8, 8, slo_tpot_ms=50)
    adm.observe_tpot(80.0)
    adm.check(10, 1)  # nothing running: the estimate is stale, admit
    adm.inflight = 3
    with pytest.raises(ResourceExhausted, match=r"time per output token is 80\.0 ms"):
        adm.check(10, 1)


def test_auto_limit_follows_capacity_and_wakes_waiters_in_order():
    async def main():
        capacity = [0]
        adm = Admission(0, 8, capacity=lambda: capacity[0])
        assert adm.limit() == DEFAULT_INFLIGHT  # nothing reported yet
        capacity[0] = 2
        assert adm.limit() == 2
        release = asyncio.Event()
        order: list[str] = []

        tasks = [asyncio.ensure_future(hold_slot(adm, n, order, release)) for n in "abcde"]
        await asyncio.sleep(0.01)
        assert order == ["a", "b"] and adm.waiting == 3
        tasks[2].cancel()  # "c" gives up while it waits: no slot taken, none lost
        await asyncio.sleep(0.01)
        capacity[0] = 3  # a worker joined; the pool tells admission
        adm.wake()
        await asyncio.sleep(0.01)
        assert order == ["a", "b", "d"] and adm.inflight == 3 and adm.waiting == 1
        release.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert order == ["a", "b", "d", "e"]
        assert adm.inflight == 0 and adm.waiting == 0 and adm.pending_prefill_tokens == 0

    asyncio.run(main())


def test_a_waiter_cancelled_as_its_slot_comes_hands_the_slot_on():
    async def main():
        adm = Admission(1, 8)
        entered = asyncio.Event()
        release = asyncio.Event()
        got: list[str] = []

        a = asyncio.ensure_future(hold_slot(adm, "a", got, release, entered))
        await entered.wait()
        b = asyncio.ensure_future(hold_slot(adm, "b", got, release))
        c = asyncio.ensure_future(hold_slot(adm, "c", got, release))
        await asyncio.sleep(0.01)
        hand_on = adm.wake

        def wake_then_cancel_b():
            hand_on()  # "a" left: "b" is handed the slot ...
            b.cancel()  # ... and cancelled before it runs: the slot must go on to "c"

        adm.wake = wake_then_cancel_b
        release.set()
        # a lost slot would leave "c" waiting for ever
        await asyncio.wait_for(asyncio.gather(a, b, c, return_exceptions=True), 5)
        assert got == ["a", "c"] and adm.inflight == 0 and adm.waiting == 0

    asyncio.run(main())


def test_a_cancelled_waiter_lets_the_next_one_take_a_free_slot():
    async def main():
        capacity = [1]
        adm = Admission(0, 8, capacity=lambda: capacity[0])
        release = asyncio.Event()
        got: list[str] = []

        a = asyncio.ensure_future(hold_slot(adm, "a", got, release))
        await asyncio.sleep(0.01)
        b = asyncio.ensure_future(hold_slot(adm, "b", got, release))
        c = asyncio.ensure_future(hold_slot(adm, "c", got, release))
        await asyncio.sleep(0.01)
        assert got == ["a"] and adm.waiting == 2
        capacity[0] = 2  # grown with no call to wake (a broken worker's cooldown ran out)
        b.cancel()  # "c", queued behind "b", takes the free slot now, not when "a" ends
        await asyncio.sleep(0.01)
        assert got == ["a", "c"] and adm.inflight == 2
        release.set()
        await asyncio.gather(a, b, c, return_exceptions=True)
        assert adm.inflight == 0 and adm.waiting == 0

    asyncio.run(main())
