"""RouterService: validate, call the orchestrator, map errors (thin)."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.engines.base import TokenLogprob
from pdserve.errors import InvalidArgument, NotFound
from pdserve.grpcutil import rpc
from pdserve.logprobs import to_proto as logprobs_to_proto
from pdserve.services.router.frontend import Frontend
from pdserve.services.router.request import GenRequest, check_model
from pdserve.telemetry import REQUEST_ID_HEADER, request_id_var
from pdserve.v1 import router_pb2, router_pb2_grpc


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.fe = frontend

    async def _validated(self, request, context: grpc.aio.ServicerContext) -> GenRequest:
        """The validated request; its id is the request's ``request_id``, else the caller's
        ``x-request-id`` metadata, else a fresh one, and goes back as ``x-request-id``."""
        if not request.request_id:
            for key, value in context.invocation_metadata() or ():
                if key == REQUEST_ID_HEADER and isinstance(value, str):
                    request.request_id = value
        req = await asyncio.to_thread(self.fe.from_proto, request)  # tokenizing: off the loop
        request_id_var.set(req.request_id)
        await context.send_initial_metadata(((REQUEST_ID_HEADER, req.request_id),))
        return req

    @rpc
    async def Generate(self, request, context: grpc.aio.ServicerContext):
        req = await self._validated(request, context)
        ids: list[int] = []
        parts: list[str] = []
        logprobs: list[TokenLogprob] = []
        out = router_pb2.GenerateResponse(request_id=req.request_id)
        async for c in self.fe.orchestrator.generate(req, timeout_s=context.time_remaining()):
            if c.prompt_tokens:
                out.prompt_tokens = c.prompt_tokens
                out.cached_tokens = c.cached_tokens
            if c.token_ids and not ids:
                out.ttft_ms = c.times_ms[0]
            ids.extend(c.token_ids)
            logprobs.extend(c.logprobs)
            parts.append(c.text)
            if c.finish:
                out.finish_reason = c.finish
            if c.times_ms:
                out.total_ms = c.times_ms[-1]
        out.token_ids.extend(ids)
        out.text = "".join(parts)
        if logprobs:
            out.logprobs.CopyFrom(logprobs_to_proto(logprobs))
        return out

    @rpc
    async def GenerateStream(self, request, context: grpc.aio.ServicerContext):
        req = await self._validated(request, context)
        async for c in self.fe.orchestrator.generate(req, timeout_s=context.time_remaining()):
            yield router_pb2.GenerateStreamResponse(
                request_id=req.request_id,
                token_ids=c.token_ids,
                text=c.text,
                token_times_ms=c.times_ms,
                finish_reason=c.finish,
                prompt_tokens=c.prompt_tokens,
                cached_tokens=c.cached_tokens,
                logprobs=logprobs_to_proto(c.logprobs) if c.logprobs else None,
            )

    @rpc
    async def ListModels(self, request, context: grpc.aio.ServicerContext):
        return router_pb2.ListModelsResponse(models=[self.fe.model_info()])

    @rpc
    async def Tokenize(self, request, context: grpc.aio.ServicerContext):
        check_model(request.model, self.fe.limits)
        ids = self.fe.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        return router_pb2.TokenizeResponse(
            token_ids=ids, tokens=self.fe.tokenizer.token_strings(ids)
        )

    @rpc
    async def Abort(self, request, context: grpc.aio.ServicerContext):
        if not request.request_id:
            raise InvalidArgument("request_id must be set", param="request_id")
        if not self.fe.orchestrator.abort(request.request_id):
            raise NotFound(f"request_id {request.request_id!r:.140}: no such running request")
        return router_pb2.AbortResponse()

    @rpc
    async def GetServerInfo(self, request, context: grpc.aio.ServicerContext):
        return self.fe.server_info()
