"""The worker client for stock ``vllm serve`` engines the router did not start: a worker whose
address is an ``http://`` URL is an OpenAI-compatible vLLM engine carrying pdserve's KV
connector (docs/vllm-connector.md), called through vLLM's completions API.

- Prefill: one token, ``kv_transfer_params: {"do_remote_decode": true}`` (vLLM's
  disaggregated-serving protocol); the engine saves the prompt's chunks and its partial last
  chunk and names that chunk in its answer's ``kv_transfer_params``.
- Decode after prefill (the read plan): the prompt with prefill's token appended, the tail
  named in ``kv_transfer_params``, ``max_tokens`` one less; the engine loads the prompt from
  the store and computes only the appended token. Prefill's token is streamed first, its text
  decoded here in the prompt's context.
- Decode alone (the local plan): the plain request; the engine loads what the store holds.

Token ids come back with vLLM's ``return_token_ids``. Not carried: logprobs, and the write
plan (a stock engine cannot wait for chunks that are still being written; the router falls
back to the read plan, as for any worker that refuses a write-mode handle).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from pdserve.requests_codec import sampling_from_proto
from pdserve.services.router.tokenizer import Tokenizer
from pdserve.services.router.worker_client import DecodeCall, WorkerCallError, WorkerClient
from pdserve.services.router.workers import Worker
from pdserve.v1 import common_pb2, engine_pb2

#: vLLM's finish reasons -> FinishReason.
_FINISH = {
    "length": common_pb2.FINISH_REASON_LENGTH,
    "stop": common_pb2.FINISH_REASON_STOP,  # a stop string or token id; EOS: stop_reason None
    "abort": common_pb2.FINISH_REASON_CANCELLED,
}
#: HTTP statuses of a vLLM engine -> gRPC codes (the router's error vocabulary).
_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


def completion_body(
    model: str, prompt: list[int], p: common_pb2.SamplingParams, priority: int = 0
) -> dict[str, Any]:
    """vLLM's completions body for ``prompt`` with the sampling controls of ``p`` (read with
    their documented defaults by :func:`~pdserve.requests_codec.sampling_from_proto`) and
    vLLM's ``priority`` (sent when not 0); INVALID_ARGUMENT for what a stock engine is not
    asked here (logprobs)."""
    s = sampling_from_proto(p, default_max_tokens=0)
    if s.logprobs is not None:
        raise WorkerCallError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "logprobs are not carried to external vLLM engines (pdserve's own workers give them)",
        )
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k or -1,
        "stop": list(s.stop),
        "ignore_eos": s.ignore_eos,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
        "logit_bias": {str(t): b for t, b in s.logit_bias} or None,
        "stop_token_ids": list(s.stop_token_ids),
        "min_tokens": s.min_tokens,
        "skip_special_tokens": s.skip_special_tokens,
        "return_token_ids": True,
    }
    if s.seed is not None:
        body["seed"] = s.seed
    if priority:
        body["priority"] = priority
    if s.json_object:
        body["structured_outputs"] = {"json_object": True}
    elif s.json_schema:
        body["structured_outputs"] = {"json": json.loads(s.json_schema)}
    return body


class HttpWorkerClient(WorkerClient):
    """Calls ``http://`` workers (stock vLLM engines); ``tokenizer``: the router's, for the text
    of prefill's token."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._session: Any = None

    def session(self) -> Any:
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def prefill(
        self, worker: Worker, request: engine_pb2.PrefillRequest, timeout: float | None
    ) -> engine_pb2.PrefillResponse:
        prompt = list(request.prompt_token_ids)
        body = completion_body(request.model, prompt, request.sampling, request.priority)
        body.update(max_tokens=1, min_tokens=min(1, request.sampling.min_tokens))
        body["kv_transfer_params"] = {"do_remote_decode": True}
        t0 = time.perf_counter()
        data = await self._post(worker, body, timeout)
        ids = (data.get("choices") or [{}])[0].get("token_ids") or []
        if not ids:
            raise WorkerCallError(grpc.StatusCode.INTERNAL, f"{worker.address}: no token ids")
        ours = (data.get("kv_transfer_params") or {}).get("pdserve") or {}
        cached = _cached(data.get("usage"))
        return engine_pb2.PrefillResponse(
            first_token_id=ids[0],
            kv=common_pb2.KVHandle(
                tail_key=str(ours.get("load_tail_key", "")), num_tokens=len(prompt)
            ),
            cached_tokens=cached,
            computed_tokens=len(prompt) - cached,
            worker_ms=(time.perf_counter() - t0) * 1e3,
            first_token_is_eos=ids[0] == self.tokenizer.eos_token_id,
        )

    def decode(
        self, worker: Worker, request: engine_pb2.DecodeRequest, timeout: float | None
    ) -> DecodeCall:
        return _HttpDecodeCall(self, worker, request, timeout)

    async def _post(self, worker: Worker, body: dict[str, Any], timeout: float | None) -> Any:
        import aiohttp

        try:
            async with asyncio.timeout(timeout):
                async with self.session().post(
                    f"{worker.address}/v1/completions", json=body
                ) as resp:
                    await _check(resp, worker)
                    return await resp.json()
        except TimeoutError:
            raise WorkerCallError(grpc.StatusCode.DEADLINE_EXCEEDED, worker.address) from None
        except aiohttp.ClientError as exc:
            raise WorkerCallError(grpc.StatusCode.UNAVAILABLE, f"{worker.address}: {exc}") from exc


async def _check(resp: Any, worker: Worker) -> None:
    if resp.status != 200:
        text = (await resp.text())[:500]
        code = _STATUS.get(resp.status, grpc.StatusCode.INTERNAL)
        raise WorkerCallError(code, f"{worker.address}: HTTP {resp.status}: {text}")


def _cached(usage: Any) -> int:
    details = (usage or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


class _HttpDecodeCall(DecodeCall):
    """One streamed completion as DecodeResponse messages."""

    def __init__(
        self,
        client: HttpWorkerClient,
        worker: Worker,
        request: engine_pb2.DecodeRequest,
        timeout: float | None,
    ) -> None:
        self.client, self.worker, self.request, self.timeout = client, worker, request, timeout
        self._task: asyncio.Task | None = None
        self._cancelled = False

    def __aiter__(self) -> AsyncIterator[engine_pb2.DecodeResponse]:
        return self._messages()

    def cancel(self) -> None:
        self._cancelled = True

    async def _messages(self) -> AsyncIterator[engine_pb2.DecodeResponse]:
        import aiohttp

        req, tok = self.request, self.client.tokenizer
        prompt = list(req.prompt_token_ids)
        s = req.sampling
        body = completion_body(req.model, prompt, s, req.priority)
        first = req.first_token_id if req.HasField("first_token_id") else None
        t0 = time.perf_counter()
        if first is not None:
            # prefill's token first, as pdserve's decode workers stream it
            ctx = prompt[-6:]
            text = tok.decode([*ctx, first])[len(tok.decode(ctx)) :]
            eos = first == tok.eos_token_id and not s.ignore_eos
            ends = eos or s.max_tokens <= 1
            finish = common_pb2.FINISH_REASON_UNSPECIFIED
            if ends:
                finish = common_pb2.FINISH_REASON_EOS if eos else common_pb2.FINISH_REASON_LENGTH
            yield engine_pb2.DecodeResponse(
                token_ids=[first],
                text="" if finish == common_pb2.FINISH_REASON_EOS else text,
                finish_reason=finish,
                token_times_ms=[0.0],
            )
            if ends:
                return
            body.update(prompt=[*prompt, first], max_tokens=s.max_tokens - 1)
            body["min_tokens"] = max(0, s.min_tokens - 1)
            if req.HasField("kv") and req.kv.tail_key:
                body["kv_transfer_params"] = {
                    "pdserve": {"load_tail_key": req.kv.tail_key, "load_tail_tokens": len(prompt)}
                }
        elif req.HasField("kv"):  # a write-mode handle: a stock engine cannot wait for chunks
            raise WorkerCallError(
                grpc.StatusCode.UNIMPLEMENTED, "external vLLM engines take no write-mode handle"
            )
        body.update(stream=True, stream_options={"include_usage": True})
        url = f"{self.worker.address}/v1/completions"
        try:
            async with asyncio.timeout(self.timeout):
                async with self.client.session().post(url, json=body) as resp:
                    await _check(resp, self.worker)
                    async for message in _events(resp, t0, len(body["prompt"])):
                        if self._cancelled:
                            raise WorkerCallError(
                                grpc.StatusCode.CANCELLED, "cancelled by the router"
                            )
                        yield message
        except TimeoutError:
            raise WorkerCallError(grpc.StatusCode.DEADLINE_EXCEEDED, url) from None
        except aiohttp.ClientError as exc:
            raise WorkerCallError(grpc.StatusCode.UNAVAILABLE, f"{url}: {exc}") from exc


async def _events(
    resp: Any, t0: float, prompt_len: int
) -> AsyncIterator[engine_pb2.DecodeResponse]:
    """The SSE events of a streamed completion as DecodeResponse messages, each as it comes
    but the final one (its finish reason set), which waits for the usage event after it to
    carry the prompt's counts. (Holding every message until the next one arrived delayed the
    first token by an inter-token gap: 35-45 ms on these CPUs.)"""
    pending: engine_pb2.DecodeResponse | None = None
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        usage = event.get("usage")
        for choice in event.get("choices") or []:
            if pending is not None:
                yield pending
                pending = None
            ids = choice.get("token_ids") or []
            reason = choice.get("finish_reason") or ""
            finish = _FINISH.get(reason, 0)
            if reason == "stop" and choice.get("stop_reason") is None:
                finish = common_pb2.FINISH_REASON_EOS
            message = engine_pb2.DecodeResponse(
                token_ids=ids,
                text=choice.get("text") or "",
                finish_reason=finish,
                token_times_ms=[(time.perf_counter() - t0) * 1e3] * len(ids),
            )
            if finish:
                pending = message
            else:
                yield message
        if usage and pending is not None:
            # vLLM's cached_tokens is its own prefix cache and its connector's loads together,
            # not split: reported once, as the engine's cache (it was counted twice here)
            cached = _cached(usage)
            pending.prefix_cached_tokens = cached
            pending.recomputed_tokens = prompt_len - cached
    if pending is not None:
        yield pending


class DispatchingWorkerClient(WorkerClient):
    """pdserve's own workers over gRPC, ``http://`` workers (stock vLLM engines) over HTTP."""

    def __init__(self, grpc_client: WorkerClient, http_client: HttpWorkerClient) -> None:
        self.grpc, self.http = grpc_client, http_client

    def _for(self, worker: Worker) -> WorkerClient:
        return self.http if worker.http else self.grpc

    async def prefill(
        self, worker: Worker, request: engine_pb2.PrefillRequest, timeout: float | None
    ) -> engine_pb2.PrefillResponse:
        return await self._for(worker).prefill(worker, request, timeout)

    def decode(
        self, worker: Worker, request: engine_pb2.DecodeRequest, timeout: float | None
    ) -> DecodeCall:
        return self._for(worker).decode(worker, request, timeout)
