"""``pdserve decode`` server: the worker service's skeleton (pdserve.services.worker.serve) with the
DecodeService servicer."""

from __future__ import annotations

import asyncio

from pdserve.services.decode.config import DecodeConfig
from pdserve.services.decode.servicer import DecodeServicer
from pdserve.services.worker.serve import WorkerSpec
from pdserve.services.worker.serve import serve as serve_worker
from pdserve.v1 import common_pb2, engine_pb2_grpc

SPEC = WorkerSpec(
    service="decode",
    role=common_pb2.ROLE_DECODE,
    add_servicer=engine_pb2_grpc.add_DecodeServiceServicer_to_server,
    grpc_name="pdserve.v1.DecodeService",
    make_servicer=DecodeServicer,
)


async def serve(cfg: DecodeConfig, stop: asyncio.Event) -> None:
    await serve_worker(SPEC, cfg, stop)
