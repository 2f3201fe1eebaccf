"""pdserve.failover: a channel over a list of servers follows the one that answers (a refused
connection or a deadline moves it on), in blocking and asyncio code."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import failover, grpcutil


def _dead_address() -> str:
    with socket.socket() as s:  # a port nothing listens on (a standby binds nothing)
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_addresses_are_checked() -> None:
    assert failover.addresses("a:1, b:2") == ["a:1", "b:2"]
    for bad in ("a:1,b", "a:1,:2", "a:1,b:x"):
        with pytest.raises(ValueError, match="expected host:port"):
            failover.addresses(bad)


def test_calls_move_on_to_the_server_that_answers() -> None:
    async def main() -> None:
        server = await grpcutil.start_server([], "127.0.0.1:0")
        listed = f"{_dead_address()},127.0.0.1:{server.port}"
        check = health_pb2.HealthCheckRequest()
        try:
            # asyncio: a call without a deadline fails fast on the dead one; the next goes on
            async with grpcutil.channel(listed) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Check(check)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                await asyncio.sleep(0.05)  # the done-callback moved the channel on
                assert (await stub.Check(check, timeout=5)).status == 1

            # blocking: a call with a deadline waits for its connection, then moves on
            def blocking() -> int:
                with grpcutil.sync_channel(listed) as ch:
                    stub = health_pb2_grpc.HealthStub(ch)
                    with pytest.raises(grpc.RpcError) as err:
                        stub.Check(check, timeout=0.5)
                    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    return stub.Check(check, timeout=5).status

            assert await asyncio.to_thread(blocking) == 1
        finally:
            await server.stop(None)

    asyncio.run(main())
