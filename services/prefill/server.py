"""``pdserve prefill`` server: the worker service's skeleton (pdserve.services.worker.serve) with the
PrefillService servicer."""

from __future__ import annotations

import asyncio

from pdserve.services.prefill.config import PrefillConfig
from pdserve.services.prefill.servicer import PrefillServicer
from pdserve.services.worker.serve import WorkerSpec
from pdserve.services.worker.serve import serve as serve_worker
from pdserve.v1 import common_pb2, engine_pb2_grpc

SPEC = WorkerSpec(
    service="prefill",
    role=common_pb2.ROLE_PREFILL,
    add_servicer=engine_pb2_grpc.add_PrefillServiceServicer_to_server,
    grpc_name="pdserve.v1.PrefillService",
    make_servicer=PrefillServicer,
)


async def serve(cfg: PrefillConfig, stop: asyncio.Event) -> None:
    await serve_worker(SPEC, cfg, stop)
