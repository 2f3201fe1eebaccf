"""The connection limits of every gRPC server (pdserve/grpc_limits.py): the first-frame deadline
closes idle TCP connections, the cap closes connections past it at once, a real client is
still answered, and an HTTP/2 connection outlives the deadline. Over real sockets against an
in-process server."""

from __future__ import annotations

import asyncio
import resource
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import grpc_limits, grpcutil
from pdserve.config_fields import ConfigError
from pdserve.grpc_limits import ConnectionLimits, GrpcLimitsConfig
from pdserve.identity import SecurityConfig
from pdserve.v1 import meta_pb2, meta_pb2_grpc


def test_limits_become_grpc_core_channel_args():
    opts = dict(ConnectionLimits(100, 1.5).options())
    assert opts["grpc.server_handshake_timeout_ms"] == 1500
    assert opts["grpc.max_allowed_incoming_connections"] == 100
    assert "grpc.max_allowed_incoming_connections" not in dict(ConnectionLimits(0, 1).options())


def test_the_cap_is_never_above_half_the_fd_limit(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 1024))
    assert ConnectionLimits(4096).effective_cap() == 512
    assert ConnectionLimits(100).effective_cap() == 100
    assert ConnectionLimits(0).effective_cap() == 0  # no cap asked: none


@pytest.mark.parametrize(
    ("cap", "timeout", "field"),
    [(-1, 5.0, "grpc_max_connections"), (10, 0.0, "grpc_handshake_timeout_s")],
)
def test_bad_limits_are_config_errors_naming_the_field(cap, timeout, field):
    with pytest.raises(ConfigError, match=field):
        ConnectionLimits(cap, timeout)


def test_every_service_config_carries_the_limits_and_configure_takes_them(monkeypatch):
    assert issubclass(SecurityConfig, GrpcLimitsConfig)

    @dataclass
    class Cfg(GrpcLimitsConfig):
        pass

    monkeypatch.setattr(grpc_limits, "_limits", ConnectionLimits())
    got = grpc_limits.configure(Cfg(grpc_max_connections=7, grpc_handshake_timeout_s=2.5))
    assert got == grpc_limits.limits() == ConnectionLimits(7, 2.5)
    with pytest.raises(ConfigError, match="grpc_max_connections"):
        grpc_limits.configure(Cfg(grpc_max_connections=-3))
    assert grpc_limits.limits() == ConnectionLimits(7, 2.5)  # a bad config changes nothing


def test_the_soft_fd_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 256:
        pytest.skip(f"the hard fd limit here ({hard}) leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        assert grpc_limits.raise_fd_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
        assert grpc_limits.raise_fd_limit() == hard  # already raised: nothing to do
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 256), hard))


# --- over real sockets ------------------------------------------------------------------


def _idle(port: int, n: int) -> list[socket.socket]:
    """``n`` TCP connections to ``port`` that never send a byte."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.setblocking(False)
        socks.append(s)
    return socks


def _closed(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (what it sent before is read and dropped)."""
    try:
        while True:
            if s.recv(65536) == b"":
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


async def _until(count, want: int, deadline_s: float) -> float:
    """Seconds until ``count()`` reaches ``want``; fails with the last count at the deadline."""
    start = time.monotonic()
    while (got := count()) < want:
        assert time.monotonic() - start < deadline_s, f"{got} of {want} after {deadline_s}s"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def _health(address: str) -> float:
    """Seconds a real client takes to be answered SERVING (its channel reconnects while
    refused)."""
    start = time.monotonic()
    async with grpcutil.channel(address) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=15, wait_for_ready=True
        )
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    return time.monotonic() - start


def test_idle_connections_past_the_cap_are_closed_at_once_and_the_rest_at_the_deadline():
    cap, n, deadline = 20, 50, 1.0

    async def main() -> None:
        server = await grpcutil.start_server(
            [], "127.0.0.1:0", limits=ConnectionLimits(cap, deadline)
        )
        socks = _idle(server.port, n)
        try:
            refused = await _until(lambda: sum(map(_closed, socks)), n - cap, deadline / 2)
            assert refused < deadline
            assert sum(map(_closed, socks)) == n - cap  # the first `cap` are held, for now
            # a real client: refused while the cap is full, answered once the deadline frees it
            assert await _health(server.address) < 10
            await _until(lambda: sum(map(_closed, socks)), n, 10)
        finally:
            for s in socks:
                s.close()
            await server.stop(0)

    asyncio.run(main())


def test_idle_connections_under_the_cap_do_not_delay_a_real_client():
    async def main() -> None:
        server = await grpcutil.start_server([], "127.0.0.1:0", limits=ConnectionLimits(500, 30.0))
        socks = _idle(server.port, 300)
        try:
            assert await _health(server.address) < 5  # answered, not after the 30 s deadline
            assert sum(map(_closed, socks)) == 0
        finally:
            for s in socks:
                s.close()
            await server.stop(0)

    asyncio.run(main())


class _PeerPort(meta_pb2_grpc.MetaServiceServicer):
    """Heartbeat answers with the caller's TCP port (as ``ttl_ms``)."""

    @grpcutil.rpc
    async def Heartbeat(self, request, context):
        return meta_pb2.MetaHeartbeatResponse(ttl_ms=int(context.peer().rsplit(":", 1)[1]))


def test_an_http2_connection_outlives_the_deadline():
    """The deadline is the first frames': a channel that sent them keeps its connection."""

    async def main() -> list[int]:
        server = await grpcutil.start_server(
            [
                (
                    meta_pb2_grpc.add_MetaServiceServicer_to_server,
                    _PeerPort(),
                    "pdserve.v1.MetaService",
                )
            ],
            "127.0.0.1:0",
            limits=ConnectionLimits(10, 0.3),
        )
        ports = []
        try:
            async with grpcutil.channel(server.address) as ch:
                stub = meta_pb2_grpc.MetaServiceStub(ch)
                for _ in range(2):
                    resp = await stub.Heartbeat(meta_pb2.MetaHeartbeatRequest(), timeout=5)
                    ports.append(resp.ttl_ms)
                    await asyncio.sleep(1.0)  # time passing is the test: 3 deadlines
        finally:
            await server.stop(0)
        return ports

    first, second = asyncio.run(main())
    assert first == second  # one connection throughout


@pytest.mark.slow
def test_a_service_takes_the_limits_from_its_flags_and_raises_its_fd_limit(tmp_path):
    """A real ``pdserve kvstore master`` started under a soft fd limit of 256: it raises the
    limit to the hard one, and its gRPC port holds at most ``--grpc-max-connections``."""
    from pdserve import procs

    cap, n, deadline = 20, 60, 3.0
    args = procs.service_args(
        "kvstore-master",
        port=0,
        metrics_port=-1,
        state_dir=tmp_path / "state",
        grpc_max_connections=cap,
        grpc_handshake_timeout_s=deadline,
    )
    low = ["sh", "-c", 'ulimit -Sn 256 && exec "$@"', "sh"]
    proc = procs.start_service("kv-master-limits", args, tmp_path, prefix=low, timeout=60)
    try:
        limits = (Path(f"/proc/{proc.pid}/limits")).read_text().splitlines()
        soft, hard = next(ln for ln in limits if ln.startswith("Max open files")).split()[3:5]
        assert soft == hard != "256"
        port = int(proc.info["grpc"].rsplit(":", 1)[1])

        async def main() -> None:
            socks = _idle(port, n)
            try:
                refused = await _until(lambda: sum(map(_closed, socks)), n - cap, deadline)
                assert refused < deadline and sum(map(_closed, socks)) == n - cap
                assert await _health(f"127.0.0.1:{port}") < 15
                await _until(lambda: sum(map(_closed, socks)), n, 15)
            finally:
                for s in socks:
                    s.close()

        asyncio.run(main())
    finally:
        proc.stop()
