"""Execute: one call on one worker, with the worker's in-flight accounting and the trace's
timestamps, and what its failure means. Whether to try again is the orchestrator's call."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from pdserve import errors
from pdserve.services.router.stream import DecodeSession, StreamChunk
from pdserve.services.router.trace import Trace
from pdserve.services.router.worker_client import WorkerCallError, WorkerClient
from pdserve.services.router.workers import Worker, WorkerPool
from pdserve.v1 import engine_pb2

#: Write plan: what a decode worker that cannot take a write-mode handle answers (before its
#: first token); the request falls back to the read plan.
WRITE_REFUSALS = {grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT}

#: Worker status codes that are the caller's fault or choice: passed through, never retried.
CALLER_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.FAILED_PRECONDITION,
}


class PrefillFailed(Exception):
    """Write mode: the parallel prefill failed everywhere, so no chunk will land."""


class WriteRefused(Exception):
    """Write mode: the decode worker cannot take a write-mode handle (``WRITE_REFUSALS``)."""

    def __init__(self, worker: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{worker}: {code.name} {details}")
        self.worker = worker
        self.code = code
        self.details = details


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (``time.monotonic()``); DEADLINE_EXCEEDED once passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise errors.DeadlineExceeded("request deadline passed")
    return left


def count_failure(pool: WorkerPool, w: Worker, exc: WorkerCallError) -> None:
    """Caller errors pass through (raised as the caller's status); a busy worker
    (RESOURCE_EXHAUSTED) is tried elsewhere without counting against it; anything else counts
    against the worker's breaker."""
    if exc.code in CALLER_CODES:
        raise errors.from_status(exc.code, exc.details or exc.code.name) from exc
    if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
        pool.record_failure(w)


async def prefill_once(
    client: WorkerClient,
    w: Worker,
    request: engine_pb2.PrefillRequest,
    *,
    uncached: int,
    trace: Trace,
    deadline: float,
) -> engine_pb2.PrefillResponse:
    """Prefill on ``w``, counting the call and its ``uncached`` tokens on the worker while it
    runs. Raises :class:`WorkerCallError`."""
    w.inflight += 1
    w.inflight_tokens += uncached
    trace.prefill_worker = w.id
    trace.prefill_start = time.monotonic()
    try:
        return await client.prefill(w, request, remaining(deadline))
    finally:
        w.inflight -= 1
        w.inflight_tokens -= uncached
        trace.prefill_end = time.monotonic()


class DecodeAttempt:
    """One Decode call on one worker, streamed into ``session``. ``prefill_tokens`` is the
    prompt work the worker does before its first token (the local plan), counted on the worker
    until that token arrives, for placement. ``started`` tells whether the worker answered."""

    def __init__(
        self,
        client: WorkerClient,
        w: Worker,
        session: DecodeSession,
        *,
        deadline: float,
        prefill_tokens: int = 0,
    ) -> None:
        self.client = client
        self.worker = w
        self.session = session
        self.deadline = deadline
        self.prefill_tokens = prefill_tokens
        self.started = False

    async def stream(self) -> AsyncIterator[StreamChunk]:
        """The client's chunks. Raises :class:`WorkerCallError`; in the write plan
        :class:`PrefillFailed` (the call was cancelled because the parallel prefill failed)
        or :class:`WriteRefused` (the worker refused the handle before its first token)."""
        w, session = self.worker, self.session
        session.trace.decode_worker = w.id
        session.trace.decode_start = time.monotonic()
        call = self.client.decode(w, session.request, remaining(self.deadline))
        session.watch(call)
        w.inflight += 1
        pending = self.prefill_tokens
        w.inflight_tokens += pending
        try:
            async for resp in call:
                if not self.started:  # the prompt is done: chunks and placement no longer matter
                    self.started = True
                    session.unwatch()
                    w.inflight_tokens -= pending
                    pending = 0
                yield session.on_response(resp)
        except WorkerCallError as exc:
            if session.prefill_failed and exc.code == grpc.StatusCode.CANCELLED:
                raise PrefillFailed() from exc
            if session.prefill is not None and not self.started and exc.code in WRITE_REFUSALS:
                raise WriteRefused(w.id, exc.code, exc.details) from exc
            raise
        finally:
            w.inflight -= 1
            w.inflight_tokens -= pending
            session.unwatch()
            call.cancel()
