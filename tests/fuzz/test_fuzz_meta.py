"""Fuzzing a real meta process: MetaService and the /metadata HTTP endpoint, and the bugs
the fuzzing found, as fixed cases."""

from __future__ import annotations

import urllib.parse

import grpc
import pytest
from tools.fuzz.cases import Case
from tools.fuzz.grpc_surface import grpc_call
from tools.fuzz.http import http_call
from tools.fuzz.meta import Meta
from tools.fuzz.runner import fuzz

from pdserve.v1 import meta_pb2


def surface(meta) -> Meta:
    return Meta(meta.info["grpc"], urllib.parse.urlsplit(meta.info["http"]).netloc)


@pytest.mark.slow
def test_meta(meta, fuzz_cases: int) -> None:
    assert fuzz(surface(meta), fuzz_cases).cases > 0


@pytest.mark.slow
def test_meta_regressions(meta) -> None:
    s = surface(meta)
    # A PUT body nested past json's recursion limit was a 500 (RecursionError).
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000):
        s.check(Case("PUT /metadata", body, None, "fz-deep"))
        status, reply = http_call(s.http, "PUT", "/metadata?key=fz-deep", body)
        assert status == 400 and b"JSON" in reply, reply
    # NOT_FOUND for a 1 MiB lease id echoed it whole: the client lost the status to gRPC's
    # trailer limit (RESOURCE_EXHAUSTED "received metadata size exceeds hard limit").
    channel, method = s.routes["MetaService.Deregister"]
    request = meta_pb2.DeregisterRequest(lease_id="l" * (1 << 20))
    s.check(Case("MetaService.Deregister", request, "lease_id"))
    code, _details, _ = grpc_call(channel, method, request.SerializeToString())
    assert code == grpc.StatusCode.NOT_FOUND
