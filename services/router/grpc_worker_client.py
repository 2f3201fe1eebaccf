"""The worker client over gRPC (the workers' PrefillService and DecodeService)."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.services.router.worker_client import DecodeCall, WorkerCallError, WorkerClient
from pdserve.services.router.workers import Worker
from pdserve.v1 import engine_pb2


class GrpcWorkerClient(WorkerClient):
    async def prefill(
        self, worker: Worker, request: engine_pb2.PrefillRequest, timeout: float | None
    ) -> engine_pb2.PrefillResponse:
        try:
            return await worker.prefill_stub().Prefill(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise WorkerCallError(exc.code(), exc.details() or "") from exc
        except asyncio.CancelledError:
            if (err := _ended_under_us(by_router=False)) is None:
                raise
            raise err from None

    def decode(
        self, worker: Worker, request: engine_pb2.DecodeRequest, timeout: float | None
    ) -> DecodeCall:
        return _GrpcDecodeCall(worker.decode_stub().Decode(request, timeout=timeout))


class _GrpcDecodeCall(DecodeCall):
    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call
        self._messages = call.__aiter__()
        self._cancelled = False

    def __aiter__(self) -> _GrpcDecodeCall:
        return self

    async def __anext__(self) -> engine_pb2.DecodeResponse:
        try:
            return await self._messages.__anext__()
        except grpc.aio.AioRpcError as exc:
            raise WorkerCallError(exc.code(), exc.details() or "") from exc
        except asyncio.CancelledError:
            if (err := _ended_under_us(by_router=self._cancelled)) is None:
                raise
            raise err from None

    def cancel(self) -> None:
        if not self._call.done():
            self._cancelled = True
            self._call.cancel()


def _ended_under_us(*, by_router: bool) -> WorkerCallError | None:
    """What a call that grpc.aio ended with CancelledError ends as. grpc.aio raises it both
    when the awaiting task is cancelled (the client went away, an abort: None, the
    cancellation propagates) and when the call itself was cancelled under the task: by the
    router (``by_router``: CANCELLED), or by its channel closing: the pool closes a worker's
    channel when meta drops the worker (its lease ended: a frozen host, a cut link). That is
    the worker failing, not the request: UNAVAILABLE, so the router retries or resumes the
    stream on another worker. (Propagated as a cancellation it ended the request as
    "cancelled" while the client's stream stayed open, unanswered, until its deadline.)"""
    task = asyncio.current_task()
    if task is not None and task.cancelling() > 0:
        return None
    if by_router:
        return WorkerCallError(grpc.StatusCode.CANCELLED, "cancelled by the router")
    return WorkerCallError(
        grpc.StatusCode.UNAVAILABLE, "the worker's channel closed under the call (it left)"
    )
