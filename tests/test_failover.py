"""pdserve.failover: a channel over a list of servers follows the one that answers (a refused
connection or a deadline moves it on), in blocking and asyncio code; a call with a deadline
tries every server until one accepts it, leaving out one that let a deadline pass lately."""

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

            # blocking: a call with a deadline tries the next server when one refuses
            def blocking() -> int:
                with grpcutil.sync_channel(listed) as ch:
                    stub = health_pb2_grpc.HealthStub(ch)
                    status = stub.Check(check, timeout=5).status
                    assert ch._switch.index == 1  # the next calls go straight there
                    return status

            assert await asyncio.to_thread(blocking) == 1
        finally:
            await server.stop(None)

    asyncio.run(main())


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_server_that_let_a_deadline_pass_is_left_out_of_the_tries_for_a_while() -> None:
    clock = _Clock()
    switch = failover._Switch(["a:1", "b:2", "c:3"], ["A", "B", "C"], clock)
    assert switch.next_try(set()) == (0, "A")
    switch.failed(0, grpc.StatusCode.DEADLINE_EXCEEDED)  # a paused leader
    assert switch.current() == (1, "B")
    # b refuses (a standby): c, then nobody (pause and try b and c again), never a
    assert switch.next_try({1}) == (2, "C")
    assert switch.next_try({1, 2}) is None
    clock.now += failover.HUNG_S
    assert switch.next_try({1, 2}) == (0, "A")  # a may answer again
    # every server let a deadline pass lately: each is tried anyway
    for i in range(3):
        switch.failed(i, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert switch.next_try(set()) is not None
    switch.answered(2)
    assert switch.current() == (2, "C") and switch.hung_until[2] == 0.0
    # a refusal moves the channel on but leaves the server in the tries
    switch.failed(2, grpc.StatusCode.UNAVAILABLE)
    assert switch.current() == (0, "A") and switch.hung_until[2] == 0.0
    # other codes change nothing
    switch.failed(0, grpc.StatusCode.NOT_FOUND)
    assert switch.current() == (0, "A")


class _Error(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_only_a_call_that_reached_no_server_is_tried_elsewhere() -> None:
    refused = "failed to connect to all addresses; last error: UNKNOWN: Connection refused"
    assert failover.unreached(_Error(grpc.StatusCode.UNAVAILABLE, refused))
    assert not failover.unreached(_Error(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    assert not failover.unreached(_Error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    # a try that failed after reaching its server ends the call with that failure
    switch = failover._Switch(["a:1", "b:2"], ["A", "B"], _Clock())
    tries = failover._Tries(switch, 5.0)
    reset = _Error(grpc.StatusCode.UNAVAILABLE, "Socket closed")
    with pytest.raises(_Error):
        tries.failed(0, reset)
    tries.failed(1, _Error(grpc.StatusCode.UNAVAILABLE, refused))  # tries on
    assert tries.refused == {1}


def test_a_call_reaches_a_server_that_starts_listening_before_its_deadline() -> None:
    """Both servers refuse (the leader died, the standby has not won yet); the standby starts
    listening while the call waits: the call gets its answer, in blocking and asyncio code."""
    check = health_pb2.HealthCheckRequest()

    async def main() -> None:
        late = _dead_address()
        listed = f"{_dead_address()},{late}"
        loop = asyncio.get_running_loop()
        servers = []

        async def listen_soon() -> None:
            await asyncio.sleep(0.5)
            servers.append(await grpcutil.start_server([], late))

        try:
            task = asyncio.create_task(listen_soon())
            async with grpcutil.channel(listed) as ch:
                assert (await health_pb2_grpc.HealthStub(ch).Check(check, timeout=30)).status == 1
            await task

            def blocking() -> int:
                with grpcutil.sync_channel(f"{_dead_address()},{late}") as ch:
                    return health_pb2_grpc.HealthStub(ch).Check(check, timeout=30).status

            assert await loop.run_in_executor(None, blocking) == 1
        finally:
            for server in servers:
                await server.stop(None)

    asyncio.run(main())


def test_a_call_no_server_accepts_fails_unavailable_at_its_deadline() -> None:
    check = health_pb2.HealthCheckRequest()
    listed = f"{_dead_address()},{_dead_address()}"
    with grpcutil.sync_channel(listed) as ch, pytest.raises(grpc.RpcError) as err:
        health_pb2_grpc.HealthStub(ch).Check(check, timeout=0.3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert failover.unreached(err.value)


def test_a_hung_server_is_left_for_the_other_one() -> None:
    """A server that accepts TCP and never answers (a SIGSTOPped leader): the call's deadline
    passes; the next call goes to the other server, later ones do not go back to it, and
    neither do the calls of the process's other channels to these servers."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)  # the kernel completes handshakes; nothing ever answers
    check = health_pb2.HealthCheckRequest()

    async def main() -> None:
        server = await grpcutil.start_server([], "127.0.0.1:0")
        listed = f"127.0.0.1:{hung.getsockname()[1]},127.0.0.1:{server.port}"
        try:
            async with grpcutil.channel(listed) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Check(check, timeout=0.5)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                for _ in range(3):
                    assert (await stub.Check(check, timeout=5)).status == 1
            # another channel of this process to the same servers knows it too: its first
            # call does not go to the hung one (it would not get an answer)
            async with grpcutil.channel(listed) as other:
                assert (await health_pb2_grpc.HealthStub(other).Check(check, timeout=1)).status == 1
        finally:
            await server.stop(None)

    try:
        asyncio.run(main())
    finally:
        hung.close()
