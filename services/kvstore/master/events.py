"""Fan-out of stored/removed events to WatchEvents subscribers.

Publishing never blocks the master: each subscriber has a bounded queue; when it is full the
oldest event is dropped and counted (a slow watcher loses events, the master never waits).
"""

from __future__ import annotations

import asyncio
import collections

from pdserve.v1 import kvstore_pb2 as pb


class Subscription:
    def __init__(self, maxlen: int) -> None:
        self._events: collections.deque[pb.KVEvent] = collections.deque()
        self._maxlen = maxlen
        self._ready = asyncio.Event()
        self.closed = False

    def push(self, event: pb.KVEvent) -> bool:
        """Queues ``event``; returns False when it had to drop the oldest one."""
        dropped = False
        if len(self._events) >= self._maxlen:
            self._events.popleft()
            dropped = True
        self._events.append(event)
        self._ready.set()
        return not dropped

    async def next(self) -> pb.KVEvent | None:
        """The next event, or None once the hub is closed and the queue is empty."""
        while not self._events:
            if self.closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        return self._events.popleft()

    def close(self) -> None:
        self.closed = True
        self._ready.set()


class EventHub:
    def __init__(self, queue_size: int) -> None:
        self.queue_size = queue_size
        self.subscribers: set[Subscription] = set()
        #: Events dropped for slow subscribers, all subscribers together.
        self.dropped = 0

    def publish(self, type_: int, key: str, size: int, reason: int, time_ms: int) -> None:
        if not self.subscribers:
            return
        event = pb.KVEvent(type=type_, key=key, size=size, reason=reason, time_ms=time_ms)
        for sub in self.subscribers:
            if not sub.push(event):
                self.dropped += 1

    def subscribe(self) -> Subscription:
        sub = Subscription(self.queue_size)
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self.subscribers.discard(sub)

    def close(self) -> None:
        for sub in self.subscribers:
            sub.close()
