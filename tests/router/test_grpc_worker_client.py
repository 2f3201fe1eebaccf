"""The router's gRPC worker client when a call ends under it: the pool closes a worker's
channel when meta drops the worker (its lease ended: a frozen host, a cut link). grpc.aio ends
the calls on that channel with CancelledError, as it does when the awaiting task is cancelled;
the client tells the two apart, so a worker that left is a worker failure (UNAVAILABLE: retry
or resume elsewhere), and only the request's own cancellation propagates as one."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve import grpcutil
from pdserve.services.router.grpc_worker_client import GrpcWorkerClient
from pdserve.services.router.worker_client import WorkerCallError
from pdserve.services.router.workers import Worker
from pdserve.v1 import engine_pb2, engine_pb2_grpc


class _Stuck(engine_pb2_grpc.PrefillServiceServicer, engine_pb2_grpc.DecodeServiceServicer):
    """Prefill never answers; Decode sends one token, then nothing (a frozen worker)."""

    def __init__(self) -> None:
        self.prefilling = asyncio.Event()

    async def Prefill(self, request, context):
        self.prefilling.set()
        await asyncio.Event().wait()

    async def Decode(self, request, context):
        yield engine_pb2.DecodeResponse(token_ids=[7])
        await asyncio.Event().wait()


async def _server(stuck: _Stuck | None = None) -> grpcutil.Server:
    stuck = stuck or _Stuck()
    return await grpcutil.start_server(
        [
            (engine_pb2_grpc.add_PrefillServiceServicer_to_server, stuck, "pdserve.v1.Prefill"),
            (engine_pb2_grpc.add_DecodeServiceServicer_to_server, stuck, "pdserve.v1.Decode"),
        ],
        "127.0.0.1:0",
    )


async def _closed_soon(worker: Worker, after: asyncio.Event) -> None:
    await after.wait()
    await worker.close()  # what WorkerPool does when meta says the worker left


def test_a_decode_stream_whose_channel_closes_fails_unavailable() -> None:
    async def main() -> None:
        server = await _server()
        worker = Worker("decode-0", f"127.0.0.1:{server.port}", "decode")
        got, first = [], asyncio.Event()
        closer = asyncio.ensure_future(_closed_soon(worker, first))
        try:
            call = GrpcWorkerClient().decode(worker, engine_pb2.DecodeRequest(), timeout=30)
            with pytest.raises(WorkerCallError) as err:
                async for msg in call:
                    got.append(list(msg.token_ids))
                    first.set()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
            assert got == [[7]]
        finally:
            await closer
            await server.stop(None)

    asyncio.run(main())


def test_a_prefill_whose_channel_closes_fails_unavailable() -> None:
    async def main() -> None:
        stuck = _Stuck()
        server = await _server(stuck)
        worker = Worker("prefill-0", f"127.0.0.1:{server.port}", "prefill")
        try:
            call = asyncio.ensure_future(
                GrpcWorkerClient().prefill(worker, engine_pb2.PrefillRequest(), timeout=30)
            )
            await stuck.prefilling.wait()
            await worker.close()
            with pytest.raises(WorkerCallError) as err:
                await call
            assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_the_requests_own_cancellation_still_propagates() -> None:
    async def main() -> None:
        server = await _server()
        worker = Worker("decode-0", f"127.0.0.1:{server.port}", "decode")
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in GrpcWorkerClient().decode(
                worker, engine_pb2.DecodeRequest(), timeout=30
            ):
                first.set()

        task = asyncio.ensure_future(consume())
        try:
            await first.wait()
            task.cancel()  # the client went away
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await worker.close()
            await server.stop(None)

    asyncio.run(main())
