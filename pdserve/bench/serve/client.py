"""The streaming OpenAI client that drives a workload: one request and its record
(:class:`Client`), a workload at its arrival times (:func:`run_requests`), and a run with its
warm-up (:func:`send_workload`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.bench.serve.http import auth_headers
from pdserve.bench.serve.status import say

if TYPE_CHECKING:
    import aiohttp
    from tqdm import tqdm

    from pdserve.bench.serve.metrics import RequestRecord
    from pdserve.bench.serve.workloads import Request


def completion_payload(model: str, req: Request) -> dict[str, Any]:
    """The streamed greedy ``/v1/completions`` body of ``req`` (measured and history rows)."""
    return {
        "model": model,
        "prompt": list(req.prompt_token_ids),
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The data of each server-sent event of ``resp`` (its ``data:`` lines, stripped; the
    closing ``[DONE]`` included)."""
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data:"):
            yield line[5:].strip()


@dataclass(frozen=True)
class Client:
    """Streams completions from ``base`` (one aiohttp session for the whole run)."""

    session: aiohttp.ClientSession
    base: str
    model: str
    t0: float

    def payload(self, req: Request) -> dict[str, Any]:
        return completion_payload(self.model, req)

    async def send(self, index: int, req: Request) -> RequestRecord:
        """One request; never raises for HTTP or stream errors (they go in the record).
        Times are seconds since ``t0``."""
        import aiohttp

        from pdserve.bench.serve.metrics import RequestRecord

        chunks: list[float] = []
        state: dict[str, Any] = {"last": None, "usage": None, "error": None, "text": []}
        send_s = time.perf_counter() - self.t0
        try:
            async with self.session.post(
                f"{self.base}/v1/completions", json=self.payload(req)
            ) as resp:
                if resp.status != 200:
                    body = (await resp.text())[:300]
                    state["error"] = f"HTTP {resp.status}: {body}"
                else:
                    await self._read_stream(resp, chunks, state)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            state["error"] = f"{type(exc).__name__}: {exc}"
        end_s = time.perf_counter() - self.t0
        usage = state["usage"] or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        error = state["error"]
        if error is None and not chunks:
            error = "the stream carried no generated text"
        return RequestRecord(
            index=index,
            send_s=send_s,
            end_s=end_s,
            chunk_s=tuple(chunks),
            last_chunk_s=state["last"],
            prompt_tokens=int(usage.get("prompt_tokens") or len(req.prompt_token_ids)),
            output_tokens=int(usage.get("completion_tokens") or len(chunks)),
            cached_tokens=int(cached) if isinstance(cached, int) else None,
            error=error,
            text="".join(state["text"]),
        )

    async def _read_stream(
        self, resp: aiohttp.ClientResponse, chunks: list[float], state: dict[str, Any]
    ) -> None:
        """Records the arrival of each SSE event with generated text (``chunks``) and its text
        (``state["text"]``), the last event with choices (``state["last"]``), the usage and an
        in-stream error."""
        async for data in sse_data(resp):
            if data == b"[DONE]":
                break
            now = time.perf_counter() - self.t0
            event = json.loads(data)
            if not isinstance(event, dict):
                continue
            if "error" in event:
                err = event["error"]
                state["error"] = (
                    f"in stream: {err.get('message') if isinstance(err, dict) else err}"
                )
                break
            if choices := event.get("choices"):
                state["last"] = now
                choice = choices[0]
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text:
                    chunks.append(now)
                    state["text"].append(text)
            if event.get("usage"):
                state["usage"] = event["usage"]


async def run_requests(
    client: Client,
    requests: Sequence[Request],
    max_concurrency: int | None,
    bar: tqdm | None,
) -> list[RequestRecord]:
    """Sends ``requests`` at their times (see :mod:`pdserve.bench.serve.workloads`): open-loop ones
    at ``t0 + t_s``, dependent ones ``t_s`` after their parent finished. With
    ``max_concurrency`` a request waits for a slot before it is sent (its send time is taken
    when it goes out, as in vLLM)."""
    children: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        if r.after is not None:
            children.setdefault(r.after, []).append(i)
    records: list[RequestRecord | None] = [None] * len(requests)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(i: int, at: float) -> None:
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with sem if sem is not None else contextlib.nullcontext():
            records[i] = await client.send(i, requests[i])
        if bar is not None:
            bar.update(1)
        now = time.perf_counter()
        await asyncio.gather(*(one(j, now + requests[j].t_s) for j in children.get(i, [])))

    roots = [one(i, client.t0 + r.t_s) for i, r in enumerate(requests) if r.after is None]
    await asyncio.gather(*roots)
    return [r for r in records if r is not None]


async def send_workload(
    base: str,
    model: str,
    requests: Sequence[Request],
    args: argparse.Namespace,
    label: str,
    before_measuring: Callable[[], None],
    vocab: int,
    key: str = "",
    warmup: int | None = None,
) -> list[RequestRecord]:
    """``warmup`` warm-up requests (default ``args.warmup``; token ids below ``vocab``), then
    ``before_measuring()``, then the measured workload (every request with API key ``key``)."""
    import aiohttp
    from tqdm import tqdm

    from pdserve.bench.serve import workloads as wl

    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    session = aiohttp.ClientSession(timeout=timeout, connector=connector, headers=auth_headers(key))
    async with session:
        warmup = args.warmup if warmup is None else warmup
        if warmup > 0 and requests:
            import numpy as np

            rng = np.random.default_rng([args.seed, 999])
            n = len(requests[0].prompt_token_ids)
            warm = Client(session, base, model, time.perf_counter())
            for k in range(warmup):
                ids = tuple(int(t) for t in rng.integers(wl.TOKEN_LOW, vocab, n))
                rec = await warm.send(-1 - k, wl.Request(0.0, ids, min(4, requests[0].max_tokens)))
                if rec.error:
                    say(f"warm-up request failed: {rec.error}")
        before_measuring()
        client = Client(session, base, model, time.perf_counter())
        with tqdm(total=len(requests), desc=label, disable=args.disable_tqdm) as bar:
            return await run_requests(client, requests, args.max_concurrency, bar)
