"""Fuzzing the router's public API (OpenAI HTTP and RouterService) in front of fake workers,
and the bugs the fuzzing found, as fixed cases."""

from __future__ import annotations

import json

import grpc
import pytest
from tools.fuzz.cases import Case
from tools.fuzz.grpc_surface import grpc_call
from tools.fuzz.http import http_call
from tools.fuzz.router import RouterGrpc, RouterHttp
from tools.fuzz.runner import fuzz

from pdserve import grpcutil
from pdserve.v1 import router_pb2

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_router_http(router, fuzz_cases: int) -> None:
    assert fuzz(RouterHttp(router[1], "tiny"), fuzz_cases).cases > 0


def test_router_grpc(router, fuzz_cases: int) -> None:
    assert fuzz(RouterGrpc(router[0], "tiny"), fuzz_cases).cases > 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # nested past json's recursion limit: RecursionError, was a 500
        (b"[" * 100_000 + b"]" * 100_000, None),
        # stream_options not an object: AttributeError after validation, was a 500
        ({**CHAT, "stream_options": "yes"}, "stream_options"),
        ({**CHAT, "stream": True, "stream_options": [1]}, "stream_options"),
        # errors about max_completion_tokens named max_tokens
        ({**CHAT, "max_completion_tokens": []}, "max_completion_tokens"),
        ({**CHAT, "max_completion_tokens": 10**6}, "max_completion_tokens"),
        # a prompt too long for the context was blamed on "prompt" in a chat request
        ({**CHAT, "messages": [{"role": "user", "content": "x " * 9000}]}, "messages"),
    ],
)
def test_router_http_refuses_what_it_once_failed_on(router, body, param) -> None:
    surface = RouterHttp(router[1], "tiny")
    case = Case("POST /v1/chat/completions", body, param)
    surface.check(case)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, reply = http_call(router[1], "POST", "/v1/chat/completions", raw)
    assert status == 400, reply
    assert json.loads(reply)["error"]["param"] == param


def test_router_grpc_keeps_its_status_for_what_it_once_lost(router) -> None:
    surface = RouterGrpc(router[0], "tiny")
    channel, method = surface.routes["RouterService.Generate"]
    sampling = router_pb2.GenerateRequest().sampling

    def call(**kw) -> tuple[grpc.StatusCode, str]:
        request = router_pb2.GenerateRequest(**kw)
        surface.check(Case("RouterService.Generate", request))
        code, details, _ = grpc_call(channel, method, request.SerializeToString())
        return code, details

    # A 1 MiB model name, echoed in full, overflowed gRPC's trailer limit: the client saw
    # RESOURCE_EXHAUSTED "received metadata size exceeds hard limit" instead of NOT_FOUND.
    code, details = call(model="m" * (1 << 20), prompt="hi")
    assert code == grpc.StatusCode.NOT_FOUND and len(details) < 1000, details
    # Too long a prompt given as token ids was blamed on "prompt".
    code, details = call(prompt_token_ids=[1] * 5000)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in details
    # No sampling at all: the default max_tokens (256) above the router's limit (64) was
    # refused, blaming a max_tokens the caller never set.
    code, details = call(prompt="hi", sampling=sampling)
    assert code == grpc.StatusCode.OK, details
    assert grpcutil.MAX_ERROR_CHARS < 1000


def test_a_denormal_temperature_is_greedy_and_a_default_above_the_limit_is_capped() -> None:
    """temperature=1e-45 is sampled greedily (it overflowed the torch engine's sampler: a 503
    through the router), as vLLM does below 1e-5. And a default max_tokens above the limit
    is capped, not refused."""
    from pdserve.services.router import request as rq

    limits = rq.Limits(
        "m", vocab_size=512, max_model_len=512, max_tokens_limit=16, default_max_tokens=256
    )
    sampling = rq.make_sampling(
        limits,
        3,
        max_tokens=None,
        temperature=1e-45,
        top_p=None,
        top_k=None,
        seed=None,
        stop=[],
        ignore_eos=False,
    )
    assert sampling.greedy and sampling.max_tokens == 16
