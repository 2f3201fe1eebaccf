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


def test_a_client_of_a_master_or_meta_reaches_only_that_role(tls_dir: Path) -> None:
    """Every certificate of the cluster is valid for localhost; a channel made for a role (a
    master's clients, meta's) requires that role's name in the server's certificate, so a
    node's certificate on a master's port is refused."""
    from cryptography import x509

    san = x509.load_pem_x509_certificate((tls_dir / "decode-1.crt").read_bytes()).extensions
    names = san.get_extension_for_class(x509.SubjectAlternativeName).value
    assert identity.role_name("worker") in names.get_values_for_type(x509.DNSName)

    async def reach(role: str, address: str) -> bool:
        async with grpcutil.channel(address, role=role) as ch:
            try:
                await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                return True
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                return False

    async def main() -> None:
        identity.configure_files(_files(tls_dir, "decode-1"))  # a worker's server
        server = await grpcutil.start_server([], "127.0.0.1:0")
        identity.configure_files(_files(tls_dir, "router"))
        address = f"127.0.0.1:{server.port}"
        try:
            assert not await reach("master", address)
            assert not await reach("meta", address)
            assert await reach("worker", address)
            assert not await asyncio.to_thread(_sync_reaches, address, "master")
        finally:
            await server.stop(None)

    asyncio.run(main())


def _sync_reaches(address: str, role: str) -> bool:
    with grpcutil.sync_channel(address, role=role) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return True
        except grpc.RpcError:
            return False
