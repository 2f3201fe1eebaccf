"""A peer that stops answering without closing its connection (a killed container's host, a
cut link, a frozen process) fails the calls on it with UNAVAILABLE after the keepalive's
unanswered ping, instead of leaving them waiting for their deadline: a real server process,
frozen with SIGSTOP, and a real channel from :func:`pdserve.grpcutil.channel`."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve import grpcutil

pytestmark = pytest.mark.slow

_SERVER = """
import asyncio
from pdserve import grpcutil

async def main():
    server = await grpcutil.start_server([], "127.0.0.1:0")
    print(server.port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_a_frozen_peer_fails_an_open_stream_within_keepalive() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        took, err = asyncio.run(_frozen_stream(port, proc.pid))
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert "ping timeout" in (err.details() or ""), err.details()
    # the bound the options promise (a ping at most KEEPALIVE_S after the freeze, then
    # PING_TIMEOUT_S unanswered); gRPC's default ping timeout alone would take 60 s more
    bound = grpcutil.KEEPALIVE_S + grpcutil.PING_TIMEOUT_S
    assert took < bound + 10, f"the stream failed {took:.1f} s after the freeze (bound {bound} s)"


async def _frozen_stream(port: int, pid: int) -> tuple[float, grpc.aio.AioRpcError]:
    """Opens a reflection stream (answered once), freezes the server, and waits (at most 120 s)
    for the stream's next read to fail: (seconds after the freeze, the error)."""
    async with grpcutil.channel(f"127.0.0.1:{port}") as ch:
        call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        assert (await call.read()).list_services_response.service
        os.kill(pid, signal.SIGSTOP)
        frozen = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(call.read(), 120)
        return time.monotonic() - frozen, info.value
