"""The running generations by abort id, and how RouterService.Abort ends one: its worker
calls are cancelled and its stream ends with a FINISH_REASON_CANCELLED chunk."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.services.router.stream import StreamChunk
from pdserve.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(eq=False)
class AbortHandle:
    """A running generation as :meth:`Running.abort` sees it: the task consuming it, whether
    that task waits for its next chunk now, and whether an abort was asked."""

    task: asyncio.Task | None
    waiting: bool = False
    requested: bool = False


class Running:
    """Generations in progress, by abort id (GenRequest.abort_id, else request_id): several
    share one id when a request fans out to ``n`` generations."""

    def __init__(self) -> None:
        self.by_id: dict[str, list[AbortHandle]] = {}

    def __len__(self) -> int:
        """The generations running now."""
        return sum(len(v) for v in self.by_id.values())

    async def track(
        self, key: str, request_id: str, inner: AsyncIterator[StreamChunk]
    ) -> AsyncIterator[StreamChunk]:
        """``inner``'s chunks, abortable under ``key`` while they stream."""
        handle = AbortHandle(asyncio.current_task())
        self.by_id.setdefault(key, []).append(handle)
        try:
            while not handle.requested:
                handle.task = asyncio.current_task()  # n > 1: the HTTP API's pump tasks
                handle.waiting = True
                try:
                    chunk = await anext(inner)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    # Abort cancels this task only while it waits here: take that cancel back
                    if handle.requested and handle.task is not None and not handle.task.uncancel():
                        break
                    raise
                finally:
                    handle.waiting = False
                yield chunk
            await inner.aclose()
            log.info("request %s aborted", request_id)
            yield StreamChunk([], "", [], common_pb2.FINISH_REASON_CANCELLED)
        finally:
            entries = self.by_id.get(key, [])
            if handle in entries:
                entries.remove(handle)
            if not entries:
                self.by_id.pop(key, None)
            await inner.aclose()

    def abort(self, key: str) -> bool:
        """Aborts the running generation(s) under ``key``; False when none runs."""
        handles = self.by_id.get(key)
        if not handles:
            return False
        for h in list(handles):
            h.requested = True
            if h.waiting and h.task is not None:
                h.task.cancel()
        return True
