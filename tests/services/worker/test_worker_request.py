"""services/worker/request.py: the checks every worker request gets, whichever the role."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.errors import InvalidArgument, ModelNotFound
from pdserve.requests import Sampling
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.request import check_request
from pdserve.v1 import common_pb2, engine_pb2

ENGINE = SimpleNamespace(max_model_len=100)


def _cfg(**kw) -> WorkerConfig:
    return WorkerConfig(model="m", **kw)


@pytest.mark.parametrize("cls", [engine_pb2.PrefillRequest, engine_pb2.DecodeRequest])
def test_both_roles_check_alike(cls) -> None:
    req = check_request(
        cls(
            request_id="r1",
            model="m",
            prompt_token_ids=[1, 2, 3],
            sampling=common_pb2.SamplingParams(max_tokens=5, temperature=0.0),
            cache_salt="tenant",
        ),
        ENGINE,
        _cfg(),
    )
    assert req.request_id == "r1" and req.prompt_token_ids == [1, 2, 3]
    assert req.cache_salt == "tenant"
    assert req.sampling == Sampling(max_tokens=5, temperature=0.0)
    with pytest.raises(ModelNotFound):
        check_request(cls(request_id="r", model="other", prompt_token_ids=[1]), ENGINE, _cfg())
    with pytest.raises(InvalidArgument, match="cache_salt"):
        check_request(cls(model="m", prompt_token_ids=[1], cache_salt="a/b"), ENGINE, _cfg())


def test_max_tokens_zero_is_what_the_limit_and_context_leave() -> None:
    def max_tokens(prompt_len: int, **kw) -> int:
        request = engine_pb2.DecodeRequest(model="m", prompt_token_ids=[1] * prompt_len)
        return check_request(request, ENGINE, _cfg(**kw)).sampling.max_tokens

    assert max_tokens(10) == 90  # the context's room
    assert max_tokens(10, max_tokens_limit=20) == 20
    assert max_tokens(100) == 1  # no room: at least 1, the engine refuses it
