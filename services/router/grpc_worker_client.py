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
            # NOTE: grpc.aio ends a locally cancelled call with CancelledError; only the
            # consumer's own cancellation may propagate as one.
            task = asyncio.current_task()
            if self._cancelled and (task is None or not task.cancelling()):
                raise WorkerCallError(
                    grpc.StatusCode.CANCELLED, "cancelled by the router"
                ) from None
            raise

    def cancel(self) -> None:
        if not self._call.done():
            self._cancelled = True
            self._call.cancel()
