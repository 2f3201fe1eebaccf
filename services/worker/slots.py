"""The cap on the requests one worker holds at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from pdserve.errors import ResourceExhausted


class SlotLimit:
    """Caps the requests a worker holds at once (running + waiting); beyond it,
    RESOURCE_EXHAUSTED naming the limit. ``changed`` is set whenever a request takes or frees
    a slot: the meta heartbeat waits on it to report the new load at once."""

    def __init__(self, limit: int, limit_name: str) -> None:
        self.limit = limit
        self.limit_name = limit_name
        self.active = 0
        self.changed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self.active >= self.limit:
            raise ResourceExhausted(
                f"worker is full: {self.active} requests in flight ({self.limit_name} = {self.limit})"
            )
        self.active += 1
        self.changed.set()
        try:
            yield
        finally:
            self.active -= 1
            self.changed.set()
