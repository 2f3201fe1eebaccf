"""A gRPC call refused on its API key (pdserve/auth.py RequireKey) is answered before its
request message is read: the server takes in at most a flow-control window of it (8 MiB at
most), not the whole message as for a unary request. Bytes the server's socket received, from ``ss``."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess

import grpc
import pytest

from pdserve import auth, grpcutil
from pdserve.tenants import Tenants
from pdserve.v1 import meta_pb2, meta_pb2_grpc

KEY = "k" * 20
MIB = 1024 * 1024

pytestmark = [
    pytest.mark.slow,  # runs `ss`
    pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)"),
]


class _Servicer(meta_pb2_grpc.MetaServiceServicer):
    @grpcutil.rpc
    async def Heartbeat(self, request, context):
        return meta_pb2.MetaHeartbeatResponse(ttl_ms=len(request.lease_id))

    @grpcutil.rpc
    async def WatchInstances(self, request, context):
        yield meta_pb2.InstanceEvent(type=meta_pb2.INSTANCE_EVENT_JOINED)


def _received(port: int) -> int:
    """Bytes the server's established connections on ``port`` have received."""
    out = subprocess.run(
        ["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(int(n) for n in re.findall(r"bytes_received:(\d+)", out))


def test_a_call_without_the_key_is_refused_before_its_message_is_read():
    big = meta_pb2.MetaHeartbeatRequest(lease_id="x" * (15 * MIB))

    async def main() -> dict[str, tuple[str, int]]:
        failures = auth.KeyFailures(1, 60.0, global_limit=0)
        server = await grpcutil.start_server(
            [(meta_pb2_grpc.add_MetaServiceServicer_to_server, _Servicer(), "x")],
            "127.0.0.1:0",
            interceptors=[auth.RequireKey(Tenants.configured(KEY), failures)],
        )
        seen = {}
        try:
            async with grpcutil.channel(server.address) as ch:
                stub = meta_pb2_grpc.MetaServiceStub(ch)
                for name, meta in (
                    ("none", ()),
                    ("wrong", auth.bearer("wrong")),
                    ("wrong again", auth.bearer("wrong")),  # past its budget of 1
                    ("right", auth.bearer(KEY)),
                ):
                    before = _received(server.port)
                    try:
                        resp = await stub.Heartbeat(big, metadata=meta, timeout=30)
                        code = f"OK {resp.ttl_ms}"
                    except grpc.aio.AioRpcError as exc:
                        code = exc.code().name
                    seen[name] = (code, _received(server.port) - before)
                with pytest.raises(grpc.aio.AioRpcError) as exc:  # a streaming method
                    async for _ in stub.WatchInstances(meta_pb2.WatchInstancesRequest()):
                        pass
                assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "missing API key" in exc.value.details()
        finally:
            await server.stop(0)
        return seen

    seen = asyncio.run(main())
    assert seen["right"] == (f"OK {15 * MIB}", pytest.approx(15 * MIB, rel=0.01))
    expect = {
        "none": "UNAUTHENTICATED",
        "wrong": "UNAUTHENTICATED",
        "wrong again": "RESOURCE_EXHAUSTED",
    }
    for name, code in expect.items():
        assert seen[name][0] == code, seen
        # at most a flow-control window (gRPC's grows to 8 MiB on a busy connection), not the
        # whole 15 MiB message, which a unary handler reads (and Python holds) first
        assert seen[name][1] < 9 * MIB, seen
