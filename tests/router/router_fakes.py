"""In-process fake Prefill/Decode gRPC workers with scriptable failures and delays, and an
in-process router on free ports in front of them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve import grpcutil
from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc

VOCAB = 512


def next_token(t: int) -> int:
    """The fake model: a deterministic successor function (never 0, the tiny model's EOS
    is elsewhere)."""
    return (t * 7 + 3) % 500 + 10


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    out, t = [], prompt[-1]
    for _ in range(n):
        t = next_token(t)
        out.append(t)
    return out


def fake_logprobs(tokens: list[int], top: int) -> common_pb2.OutputLogProbs:
    """The fake model's logprobs: token t has log probability -(t % 7 + 1) / 10, its
    alternatives t + 1, t + 2, ... one nat less each."""
    out = common_pb2.OutputLogProbs()
    for t in tokens:
        lp = -((t % 7) + 1) / 10
        out.token_ids.append(t)
        out.token_logprobs.append(lp)
        out.top_logprobs.append(
            common_pb2.TopLogProbs(
                token_ids=[t + j for j in range(top)], values=[lp - j for j in range(top)]
            )
        )
    return out


@dataclass
class FakePrefill(engine_pb2_grpc.PrefillServiceServicer):
    fail: int = 0  # fail this many calls with UNAVAILABLE
    fail_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    delay_s: float = 0.0
    calls: list[engine_pb2.PrefillRequest] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)

    async def Prefill(self, request, context):
        self.calls.append(request)
        if self.fail > 0:
            self.fail -= 1
            await context.abort(self.fail_code, "fake prefill failure")
        t0 = time.monotonic()
        await asyncio.sleep(self.delay_s)
        self.ends.append(time.monotonic())
        first = next_token(request.prompt_token_ids[-1])
        lps = None
        if request.sampling.HasField("logprobs"):
            lps = fake_logprobs([first], request.sampling.logprobs)
        return engine_pb2.PrefillResponse(
            first_token_logprobs=lps,
            first_token_id=first,
            kv=common_pb2.KVHandle(num_tokens=len(request.prompt_token_ids), chunk_size=4),
            computed_tokens=len(request.prompt_token_ids),
            worker_ms=(time.monotonic() - t0) * 1000.0,
        )


@dataclass
class FakeDecode(engine_pb2_grpc.DecodeServiceServicer):
    fail: int = 0
    fail_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    #: answer a write-mode handle (kv without first_token_id) with this status
    refuse_write: grpc.StatusCode | None = None
    fail_after: int = -1  # abort with UNAVAILABLE after streaming this many tokens (once)
    token_delay_s: float = 0.0
    calls: list[engine_pb2.DecodeRequest] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    active: int = 0
    cancelled: int = 0

    async def Decode(self, request, context):
        self.calls.append(request)
        self.starts.append(time.monotonic())
        if self.fail > 0:
            self.fail -= 1
            await context.abort(self.fail_code, "fake decode failure")
        write = request.HasField("kv") and not request.HasField("first_token_id")
        if write and self.refuse_write is not None:
            await context.abort(self.refuse_write, "fake decode takes no write-mode handle")
        t0 = time.monotonic()
        self.active += 1
        done = False
        try:
            n = request.sampling.max_tokens
            if request.HasField("first_token_id"):
                toks = [request.first_token_id, *expected_tokens([request.first_token_id], n - 1)]
            else:
                toks = expected_tokens(list(request.prompt_token_ids), n)
            for i, t in enumerate(toks):
                if i == self.fail_after:
                    self.fail_after = -1
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "fake decode died")
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                last = i == len(toks) - 1
                lps = None
                echoed = i == 0 and request.HasField("first_token_id")
                if request.sampling.HasField("logprobs") and not echoed:
                    lps = fake_logprobs([t], request.sampling.logprobs)
                yield engine_pb2.DecodeResponse(
                    logprobs=lps,
                    token_ids=[t],
                    text=f"<{t}>",
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                    token_times_ms=[(time.monotonic() - t0) * 1000.0],
                    loaded_tokens=len(request.prompt_token_ids) if request.HasField("kv") else 0,
                )
            done = True
        finally:
            self.active -= 1
            if not done:
                self.cancelled += 1


async def start_fake(servicer) -> grpcutil.Server:
    if isinstance(servicer, FakePrefill):
        add, name = (
            engine_pb2_grpc.add_PrefillServiceServicer_to_server,
            "pdserve.v1.PrefillService",
        )
    else:
        add, name = engine_pb2_grpc.add_DecodeServiceServicer_to_server, "pdserve.v1.DecodeService"
    return await grpcutil.start_server([(add, servicer, name)], "127.0.0.1:0")


@contextlib.asynccontextmanager
async def fake_cluster(prefills: list[FakePrefill], decodes: list[FakeDecode], tiny: Path, **cfg):
    """Starts the fake workers and an in-process router; yields (running, servers)."""
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.router.server import serve

    servers = [await start_fake(s) for s in [*prefills, *decodes]]
    addrs = [s.address for s in servers]
    settings = {"chunk_size": 4, "kv_dtype": "float32", "local_prefill_threshold": 0, **cfg}
    config = RouterConfig(
        port=0,
        http_port=0,
        model=str(tiny),
        served_name="tiny",
        prefill=addrs[: len(prefills)],
        decode=addrs[len(prefills) :],
        **settings,
    )
    config.validate()
    stop = asyncio.Event()
    started: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(serve(config, stop, started=started.set_result))
    running = await asyncio.wait_for(started, 30)
    try:
        yield running, servers
    finally:
        stop.set()
        await task
        for s in servers:
            await s.stop(0)
