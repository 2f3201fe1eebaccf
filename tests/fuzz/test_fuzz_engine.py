"""Fuzzing real torch prefill and decode workers (PrefillService, DecodeService)."""

from __future__ import annotations

import grpc
import pytest
from tools.fuzz.engine import Engine
from tools.fuzz.grpc_surface import grpc_call
from tools.fuzz.runner import fuzz


@pytest.mark.slow
def test_engine(workers, fuzz_cases: int) -> None:
    assert fuzz(Engine(*workers, "tiny"), fuzz_cases).cases > 0


@pytest.mark.slow
@pytest.mark.parametrize("op", ["PrefillService.Prefill", "DecodeService.Decode"])
def test_engine_serves_a_denormal_temperature_greedily(workers, op: str) -> None:
    """temperature=1e-45 is valid (>= 0); logits / 1e-45 overflowed float32 and the torch
    sampler raised (INTERNAL). Below 1e-5 the engines now sample greedily, as vLLM does."""
    surface = Engine(*workers, "tiny")
    request = surface.bases[op](0)
    request.sampling.temperature = 1e-45
    channel, method = surface.routes[op]
    code, details, _ = grpc_call(channel, method, request.SerializeToString())
    assert code == grpc.StatusCode.OK, details
