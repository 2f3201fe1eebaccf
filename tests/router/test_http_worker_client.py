"""services/router/http_worker_client.py without engines: the completions body it sends a stock
vLLM engine for pdserve's sampling controls, and the router's health probe of such an engine
(``workers.py``; the engines themselves answer in tests/integrations/test_vllm_serve_store.py)."""

from __future__ import annotations

import grpc
import pytest

from pdserve.services.router.http_worker_client import completion_body
from pdserve.services.router.worker_client import WorkerCallError
from pdserve.services.router.workers import Worker
from pdserve.v1 import common_pb2


def test_the_body_carries_every_sampling_control_and_asks_for_token_ids():
    s = common_pb2.SamplingParams(
        max_tokens=7, temperature=0.0, top_p=0.9, top_k=5, seed=3, stop=["\n"], ignore_eos=True,
        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1,
        logit_bias={12: 2.0}, stop_token_ids=[2], min_tokens=2, skip_special_tokens=False,
    )  # fmt: skip
    body = completion_body("smollm2", [1, 2, 3], s)
    assert body["prompt"] == [1, 2, 3] and body["return_token_ids"] is True
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["top_k"]) == (
        7,
        0.0,
        body["top_p"],
        5,
    )
    assert body["top_p"] == pytest.approx(0.9) and body["seed"] == 3
    assert (body["stop"], body["ignore_eos"], body["stop_token_ids"]) == (["\n"], True, [2])
    assert body["logit_bias"] == {"12": 2.0} and body["min_tokens"] == 2
    assert body["skip_special_tokens"] is False
    assert body["repetition_penalty"] == pytest.approx(1.1)
    plain = completion_body("m", [1], common_pb2.SamplingParams(max_tokens=1))
    assert (plain["temperature"], plain["top_k"], plain["logit_bias"], "seed" in plain) == (
        1.0,
        -1,
        None,
        False,
    )
    schema = completion_body("m", [1], common_pb2.SamplingParams(json_schema='{"type": "object"}'))
    assert schema["structured_outputs"] == {"json": {"type": "object"}}


def test_logprobs_are_refused_by_name():
    with pytest.raises(WorkerCallError) as exc:
        completion_body("m", [1], common_pb2.SamplingParams(logprobs=2))
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in exc.value.details


def test_http_workers_are_told_by_their_address():
    assert Worker("d", "http://10.0.0.8:8100", "decode").http
    assert not Worker("d", "10.0.0.8:50070", "decode").http


def test_each_token_is_passed_on_as_it_comes_and_the_last_carries_the_usage():
    """A streamed completion's events: a token is yielded before the engine sends the next one
    (holding each for the next delayed every first token by an inter-token gap); the final one
    waits for the usage event, whose cached_tokens it carries once."""
    import asyncio
    import json

    from pdserve.services.router.http_worker_client import _events

    sent: list[str] = []

    def event(d: dict) -> bytes:
        return f"data: {json.dumps(d)}\n".encode()

    class Stream:
        """resp.content: hands out an event only when the consumer asks for it."""

        def __init__(self, lines: list[bytes]) -> None:
            self.lines = lines

        async def __aiter__(self):
            for line in self.lines:
                sent.append(line.decode())
                yield line
                await asyncio.sleep(0)

    class Resp:
        content = Stream(
            [
                event({"choices": [{"token_ids": [5], "text": "a", "finish_reason": None}]}),
                event({"choices": [{"token_ids": [6], "text": "b", "finish_reason": None}]}),
                event({"choices": [{"token_ids": [7], "text": "c", "finish_reason": "length"}]}),
                event({"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 64}}}),
                b"data: [DONE]\n",
            ]
        )

    async def main() -> list:
        out = []
        async for m in _events(Resp(), 0.0, 100):
            out.append((list(m.token_ids), len(sent)))
            last = m
        assert (last.prefix_cached_tokens, last.loaded_tokens, last.recomputed_tokens) == (
            64,
            0,
            36,
        )
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        return out

    # token 5 went on when only its own event had been read; the last after the usage event
    assert asyncio.run(main()) == [([5], 1), ([6], 2), ([7], 5)]


def test_an_http_workers_health_is_its_get_health_answering_200():
    """The router's health probe of a stock engine (``workers._healthy``): 200 on ``/health``
    is healthy; another status, or nothing listening, is not."""
    import asyncio

    from aiohttp import web

    from pdserve.procs import free_ports
    from pdserve.services.router.workers import _healthy

    async def probe() -> list[bool]:
        status = {"code": 200}

        async def health(_request: web.Request) -> web.Response:
            return web.Response(status=status["code"])

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        port, closed = free_ports(2)
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            up = Worker("e", f"http://127.0.0.1:{port}", "decode")
            seen = [await _healthy(up)]
            status["code"] = 503
            seen.append(await _healthy(up))
        finally:
            await runner.cleanup()
        seen.append(await _healthy(Worker("f", f"http://127.0.0.1:{closed}", "decode")))
        return seen

    assert asyncio.run(probe()) == [True, False, False]
