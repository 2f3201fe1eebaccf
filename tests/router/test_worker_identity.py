"""With TLS the router talks to a worker only if the worker's server presents the certificate
of the identity that registered it in meta (``Instance.owner``): a certificate of the cluster
that is valid for the address (every one carries localhost) is not enough."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import grpcutil, identity
from pdserve.commands import certs
from pdserve.identity import TlsFiles
from pdserve.services.router.workers import Worker


def _files(d: Path, name: str) -> TlsFiles:
    return TlsFiles.load(str(d / "ca.crt"), str(d / f"{name}.crt"), str(d / f"{name}.key"))


async def _reachable(worker: Worker) -> bool:
    try:
        stub = health_pb2_grpc.HealthStub(worker.channel())
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        return True
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        return False
    finally:
        await worker.close()


@pytest.fixture
def tls_dir(tmp_path: Path):
    certs.make(tmp_path, ["worker:decode-0", "worker:decode-1", "router:router"])
    yield tmp_path
    identity.configure_files(None)


def test_the_router_reaches_only_the_worker_the_record_names(tls_dir: Path) -> None:
    async def main() -> None:
        identity.configure_files(_files(tls_dir, "decode-1"))  # the server: decode-1
        server = await grpcutil.start_server([], "127.0.0.1:0")
        identity.configure_files(_files(tls_dir, "router"))  # this process dials as router
        address = f"127.0.0.1:{server.port}"
        try:
            # decode-0's record pointing at decode-1's server (or anything at that address)
            assert not await _reachable(
                Worker("decode-0", address, "decode", owner="worker:decode-0")
            )
            assert await _reachable(Worker("decode-1", address, "decode", owner="worker:decode-1"))
            # a record without an owner (no TLS when registered): any cluster certificate
            assert await _reachable(Worker("decode-x", address, "decode"))
        finally:
            await server.stop(None)

    asyncio.run(main())
