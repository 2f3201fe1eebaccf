"""The decode servicer without processes: the prompt counts go on the last message only
(DecodeResponse in engine.proto), whichever event the engine put them on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pdserve.engines.base import TokenEvent
from pdserve.requests import Finish
from pdserve.services.decode.servicer import DecodeServicer
from pdserve.services.worker.config import WorkerConfig
from pdserve.v1 import common_pb2, engine_pb2


def test_prompt_counts_are_sent_on_the_last_message_only() -> None:
    async def generate(*_args, **_kw):
        yield TokenEvent([1], "a", [1.0], loaded_tokens=16, recomputed_tokens=4)  # too early
        yield TokenEvent([2], "b", [2.0])
        yield TokenEvent([3], "c", [3.0], finish=Finish.LENGTH)

    engine = SimpleNamespace(generate=generate, max_model_len=64)
    servicer = DecodeServicer(engine, WorkerConfig(model="tiny"))
    request = engine_pb2.DecodeRequest(
        request_id="r",
        model="tiny",
        prompt_token_ids=list(range(5, 25)),
        sampling=common_pb2.SamplingParams(max_tokens=3),
    )

    async def main():
        return [m async for m in servicer.Decode(request, None)]

    msgs = asyncio.run(main())
    counts = [(m.loaded_tokens, m.recomputed_tokens, m.prefix_cached_tokens) for m in msgs]
    assert counts == [(0, 0, 0), (0, 0, 0), (16, 4, 0)]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
