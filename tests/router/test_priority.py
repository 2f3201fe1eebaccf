"""``priority`` on the router's side, without a network: checked as vLLM's (an int32, lower
first, default 0) and carried into every request the router sends a worker."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidArgument
from pdserve.requests import Sampling
from pdserve.services.router import worker_requests as build
from pdserve.services.router.http_worker_client import completion_body
from pdserve.services.router.request import GenRequest, check_priority
from pdserve.v1 import common_pb2


def test_priority_is_an_int32() -> None:
    assert check_priority(None) == 0
    assert (check_priority(-(2**31)), check_priority(2**31 - 1), check_priority(7)) == (
        -(2**31),
        2**31 - 1,
        7,
    )
    for bad in (2**31, -(2**31) - 1, 1.0, "1", True, [1]):
        with pytest.raises(InvalidArgument, match="priority must be an integer") as err:
            check_priority(bad)
        assert err.value.param == "priority"


def test_every_worker_request_carries_the_priority() -> None:
    req = GenRequest("r1", [5, 6, 7], Sampling(max_tokens=4), priority=-3)
    assert build.prefill_request(req, "m", publish=False).priority == -3
    first = build.decode_request(req, "m")
    assert first.priority == -3
    resumed = build.resumed_request(first, [9])
    assert resumed is not None and resumed.priority == -3


def test_external_engines_get_it_only_when_set() -> None:
    s = common_pb2.SamplingParams(max_tokens=2)
    assert "priority" not in completion_body("m", [1], s)
    assert completion_body("m", [1], s, priority=-2)["priority"] == -2
