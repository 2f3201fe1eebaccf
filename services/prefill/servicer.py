"""PrefillService: validate, run the engine's prefill, answer with the first token and handle."""

from __future__ import annotations

import time

import grpc
from prometheus_client import Counter, Histogram

from pdserve.engines.base import Engine
from pdserve.grpcutil import rpc
from pdserve.requests_codec import kvref_to_proto, logprobs_to_proto
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.request import check_request
from pdserve.services.worker.slots import SlotLimit
from pdserve.telemetry import REGISTRY, init_labels
from pdserve.v1 import engine_pb2, engine_pb2_grpc

REQUESTS = init_labels(
    Counter(
        "pdserve_prefill_requests_total",
        "Prefill requests by outcome",
        ["outcome"],
        registry=REGISTRY,
    ),
    ("ok",),
)
PROMPT_TOKENS = Counter(
    "pdserve_prefill_prompt_tokens_total",
    "Prompt tokens prefilled, by source (cached = loaded from the store)",
    ["source"],
    registry=REGISTRY,
)
LATENCY = Histogram("pdserve_prefill_seconds", "Prefill wall time in the worker", registry=REGISTRY)


class PrefillServicer(engine_pb2_grpc.PrefillServiceServicer):
    def __init__(self, engine: Engine, cfg: WorkerConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        self.slots = SlotLimit(max(1, cfg.max_queue), "max_queue")

    @rpc
    async def Prefill(
        self, request: engine_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.PrefillResponse:
        t0 = time.perf_counter()
        req = check_request(request, self.engine, self.cfg)
        try:
            async with self.slots.slot():
                out = await self.engine.prefill(
                    req.request_id,
                    req.prompt_token_ids,
                    req.sampling,
                    publish_incrementally=request.publish_incrementally,
                    cache_salt=req.cache_salt,
                    bypass_store=req.bypass_store,
                    priority=req.priority,
                )
        except Exception as exc:
            REQUESTS.labels(type(exc).__name__).inc()
            raise
        elapsed = time.perf_counter() - t0
        REQUESTS.labels("ok").inc()
        PROMPT_TOKENS.labels("cached").inc(out.cached_tokens)
        PROMPT_TOKENS.labels("computed").inc(out.computed_tokens)
        LATENCY.observe(elapsed)
        return engine_pb2.PrefillResponse(
            first_token_id=out.first_token_id,
            kv=kvref_to_proto(out.kv),
            cached_tokens=out.cached_tokens,
            computed_tokens=out.computed_tokens,
            worker_ms=elapsed * 1000.0,
            first_token_is_eos=out.first_token_is_eos,
            first_token_logprobs=(
                logprobs_to_proto([out.first_logprob]) if out.first_logprob else None
            ),
        )
