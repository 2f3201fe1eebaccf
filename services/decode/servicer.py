"""DecodeService: validate, stream the engine's tokens; client cancel or deadline stops the
generation and frees its slot."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from prometheus_client import Counter, Gauge

from pdserve.engines.base import Engine
from pdserve.enums import FINISH_REASON
from pdserve.grpcutil import rpc
from pdserve.requests_codec import kvref_from_proto, logprobs_to_proto
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.request import check_request
from pdserve.services.worker.slots import SlotLimit
from pdserve.telemetry import REGISTRY
from pdserve.v1 import engine_pb2, engine_pb2_grpc

RUNNING = Gauge("pdserve_decode_running_requests", "Decode streams in progress", registry=REGISTRY)
REQUESTS = Counter(
    "pdserve_decode_requests_total",
    "Decode requests by outcome (finish reason, cancelled, or error name)",
    ["outcome"],
    registry=REGISTRY,
)
TOKENS = Counter("pdserve_decode_tokens_total", "Tokens streamed", registry=REGISTRY)
PROMPT_TOKENS = Counter(
    "pdserve_decode_prompt_tokens_total",
    "Prompt tokens of decode requests by source: loaded (from the store), prefix_cache (the "
    "engine's own cache) or recomputed",
    ["source"],
    registry=REGISTRY,
)

#: PROMPT_TOKENS sources, in the order of the counts (loaded, recomputed, prefix cached).
_SOURCES = ("loaded", "recomputed", "prefix_cache")


class DecodeServicer(engine_pb2_grpc.DecodeServiceServicer):
    def __init__(self, engine: Engine, cfg: WorkerConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        self.slots = SlotLimit(
            cfg.resolved_max_num_seqs() + cfg.max_queue, "max_num_seqs + max_queue"
        )

    @rpc
    async def Decode(
        self, request: engine_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.DecodeResponse]:
        req = check_request(request, self.engine, self.cfg)
        kv = kvref_from_proto(request.kv) if request.HasField("kv") else None
        first = request.first_token_id if request.HasField("first_token_id") else None
        outcome = "error"
        # (loaded, recomputed, prefix cached): sent on the last message only (DecodeResponse)
        counts = (0, 0, 0)
        async with self.slots.slot():
            RUNNING.inc()
            try:
                async for ev in self.engine.generate(
                    req.request_id,
                    req.prompt_token_ids,
                    req.sampling,
                    kv=kv,
                    first_token_id=first,
                    chunk_wait_ms=request.chunk_wait_ms,
                    cache_salt=req.cache_salt,
                    bypass_store=req.bypass_store,
                    priority=req.priority,
                ):
                    if ev.loaded_tokens or ev.recomputed_tokens or ev.prefix_cached_tokens:
                        counts = (ev.loaded_tokens, ev.recomputed_tokens, ev.prefix_cached_tokens)
                    TOKENS.inc(len(ev.token_ids))
                    last = (0, 0, 0)
                    if ev.finish is not None:
                        outcome = FINISH_REASON.names[int(ev.finish)]
                        last = counts
                        for source, n in zip(_SOURCES, last, strict=True):
                            PROMPT_TOKENS.labels(source).inc(n)
                    yield engine_pb2.DecodeResponse(
                        token_ids=ev.token_ids,
                        text=ev.text,
                        finish_reason=int(ev.finish or 0),
                        token_times_ms=ev.times_ms,
                        loaded_tokens=last[0],
                        recomputed_tokens=last[1],
                        prefix_cached_tokens=last[2],
                        logprobs=logprobs_to_proto(ev.logprobs) if ev.logprobs else None,
                    )
            except (asyncio.CancelledError, GeneratorExit):  # client cancel or deadline
                outcome = "cancelled"
                raise
            except Exception as exc:
                outcome = type(exc).__name__
                raise
            finally:
                RUNNING.dec()
                REQUESTS.labels(outcome).inc()
