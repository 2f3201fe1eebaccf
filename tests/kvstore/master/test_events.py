"""EventHub: slow watchers lose the oldest events; publishing never blocks."""

from __future__ import annotations

import asyncio

from pdserve.services.kvstore.master.events import EventHub
from pdserve.v1 import kvstore_pb2 as pb


def test_bounded_queue_drops_oldest() -> None:
    async def main() -> None:
        hub = EventHub(queue_size=3)
        slow, fast = hub.subscribe(), hub.subscribe()
        got_fast = []
        for i in range(5):
            hub.publish(pb.KV_EVENT_STORED, f"k{i}", i, pb.KV_EVENT_REASON_UNSPECIFIED, 0)
            ev = await fast.next()
            got_fast.append(ev.key)
        assert got_fast == [f"k{i}" for i in range(5)]
        assert hub.dropped == 2  # the slow subscriber's two oldest
        hub.close()
        got_slow = []
        while (ev := await slow.next()) is not None:
            got_slow.append(ev.key)
        assert got_slow == ["k2", "k3", "k4"]
        hub.unsubscribe(slow)
        hub.unsubscribe(fast)
        assert not hub.subscribers

    asyncio.run(main())
