"""RouterService: validate, call the orchestrator, map errors (thin)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from pdserve import tenants
from pdserve.errors import InvalidArgument, NotFound
from pdserve.grpcutil import rpc
from pdserve.requests import TokenLogprob
from pdserve.requests_codec import logprobs_to_proto
from pdserve.services.router.frontend import Frontend, proto_n
from pdserve.services.router.request import GenRequest, check_model, check_text_size
from pdserve.telemetry import REQUEST_ID_HEADER, request_id_var
from pdserve.v1 import router_pb2, router_pb2_grpc


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.fe = frontend

    async def _validated(
        self, request, context: grpc.aio.ServicerContext
    ) -> tuple[Frontend, GenRequest]:
        """The frontend of the request's model and the validated request; its id is the
        request's ``request_id``, else the caller's ``x-request-id`` metadata, else a fresh
        one, and goes back as ``x-request-id``."""
        if not request.request_id:
            for key, value in context.invocation_metadata() or ():
                if key == REQUEST_ID_HEADER and isinstance(value, str):
                    request.request_id = value
        fe = self.fe.for_model(request.model)
        req = await asyncio.to_thread(fe.from_proto, request)  # tokenizing: off the loop
        request_id_var.set(req.request_id)
        await context.send_initial_metadata(((REQUEST_ID_HEADER, req.request_id),))
        return fe, req

    @rpc
    async def Generate(self, request, context: grpc.aio.ServicerContext):
        n = proto_n(request)
        fe, req = await self._validated(request, context)
        ids: list[list[int]] = [[] for _ in range(n)]
        parts: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        finish = [0] * n
        out = router_pb2.GenerateResponse(request_id=req.request_id)
        chunks = fe.generate_n([req], n, timeout_s=context.time_remaining())
        async with contextlib.aclosing(chunks):
            async for i, c in chunks:
                if c.prompt_tokens and i == 0:
                    out.prompt_tokens = c.prompt_tokens
                    out.cached_tokens = c.cached_tokens
                if c.token_ids and not out.ttft_ms:
                    out.ttft_ms = c.times_ms[0]
                ids[i].extend(c.token_ids)
                logprobs[i].extend(c.logprobs)
                parts[i].append(c.text)
                if c.finish:
                    finish[i] = c.finish
                if c.times_ms:
                    out.total_ms = max(out.total_ms, c.times_ms[-1])
        choices = [
            router_pb2.GenerateChoice(
                index=i,
                text="".join(parts[i]),
                token_ids=ids[i],
                finish_reason=finish[i],
                logprobs=logprobs_to_proto(logprobs[i]) if logprobs[i] else None,
            )
            for i in range(n)
        ]
        first = choices[0]
        out.token_ids.extend(first.token_ids)
        out.text = first.text
        out.finish_reason = first.finish_reason
        if first.HasField("logprobs"):
            out.logprobs.CopyFrom(first.logprobs)
        if n > 1:
            out.choices.extend(choices)
        return out

    @rpc
    async def GenerateStream(self, request, context: grpc.aio.ServicerContext):
        n = proto_n(request)
        fe, req = await self._validated(request, context)
        chunks = fe.generate_n([req], n, timeout_s=context.time_remaining())
        async with contextlib.aclosing(chunks):
            async for i, c in chunks:
                yield router_pb2.GenerateStreamResponse(
                    request_id=req.request_id,
                    index=i,
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
        return router_pb2.ListModelsResponse(models=[m.model_info() for m in self.fe.every_model()])

    @rpc
    async def Tokenize(self, request, context: grpc.aio.ServicerContext):
        # Generate's rules: text too long to fit the context refused before tokenizing, and
        # tokenizing off the event loop, so /health and other calls keep being answered.
        fe = self.fe.for_model(request.model)
        limits = fe.current_limits()
        check_model(request.model, limits)
        check_text_size(len(request.text), limits, "text")
        return await asyncio.to_thread(_tokenize, fe, request)

    @rpc
    async def Abort(self, request, context: grpc.aio.ServicerContext):
        if not request.request_id:
            raise InvalidArgument("request_id must be set", param="request_id")
        # a tenant aborts its own requests only: another's with the same id are not seen
        tenant = tenants.current.get()
        found = [m.orchestrator.abort(request.request_id, tenant) for m in self.fe.every_model()]
        if not any(found):
            raise NotFound(f"request_id {request.request_id!r:.140}: no such running request")
        return router_pb2.AbortResponse()

    @rpc
    async def GetServerInfo(self, request, context: grpc.aio.ServicerContext):
        return self.fe.server_info()


def _tokenize(fe: Frontend, request: router_pb2.TokenizeRequest) -> router_pb2.TokenizeResponse:
    tok = fe.tokenizer
    ids = tok.encode(request.text, add_special_tokens=request.add_special_tokens)
    return router_pb2.TokenizeResponse(token_ids=ids, tokens=tok.token_strings(ids))
