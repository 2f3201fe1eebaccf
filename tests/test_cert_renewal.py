"""Certificates renewed in place (what ``pdserve up`` does at half their life): a process
loads the new files, its gRPC servers and SSL contexts present them to new handshakes, its
channels dial new connections with them, and it keeps serving after the first certificates
expired, which a channel made with those alone cannot."""

from __future__ import annotations

import asyncio
import datetime
import socket
import ssl
import threading
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import grpcutil, identity
from pdserve.commands import certs
from pdserve.config import ConfigError

SHORT = datetime.timedelta(seconds=4)


@pytest.fixture
def renewing(monkeypatch, tmp_path: Path):
    """An in-memory CA issuing ``worker:w`` (this process's identity) and ``admin:ops``."""
    monkeypatch.setattr(identity, "RELOAD_CHECK_S", 0.0)
    issuer = certs.Issuer.in_memory(tmp_path)
    issuer.issue("worker", "w", [], SHORT)
    issuer.issue("admin", "ops", [], SHORT)
    paths = (str(tmp_path / "ca.crt"), str(tmp_path / "w.crt"), str(tmp_path / "w.key"))
    identity.configure_files(identity.TlsFiles.load(*paths))
    yield issuer
    identity.configure_files(None)


def _serial(pem_or_der: bytes) -> int:
    if pem_or_der.startswith(b"-----"):
        return x509.load_pem_x509_certificate(pem_or_der).serial_number
    return x509.load_der_x509_certificate(pem_or_der).serial_number


def _file_serial(issuer: certs.Issuer, name: str) -> int:
    return _serial((issuer.out / f"{name}.crt").read_bytes())


def test_a_renewal_is_loaded_once_whole_and_only_for_the_same_identity(renewing):
    first = identity.tls()
    generation = identity.generation()
    assert identity.tls() is first  # nothing changed: the same files
    renewing.issue("worker", "w", [], SHORT)
    now = identity.tls()
    assert now is not first and _serial(now.cert) == _file_serial(renewing, "w")
    assert identity.generation() == generation + 1
    # a key written before its certificate (a renewal caught half-way) is not taken
    (renewing.out / "w.key").write_bytes((renewing.out / "ops.key").read_bytes())
    assert identity.tls() is now
    with pytest.raises(ConfigError, match="is not the key of"):
        identity.TlsFiles.load(*now.paths)
    # another identity's certificate in this process's files is refused: an identity is fixed
    (renewing.out / "w.crt").write_bytes((renewing.out / "ops.crt").read_bytes())
    assert identity.tls() is now and identity.tls().identity() == identity.Identity("worker", "w")
    assert identity.generation() == generation + 1


class _SeenClients(grpc.aio.ServerInterceptor):
    """Records the serial of the client certificate of each call."""

    def __init__(self) -> None:
        self.serials: list[int] = []

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        inner = handler.unary_unary

        async def unary(request, context):
            self.serials.append(_serial(context.auth_context()["x509_pem_cert"][0]))
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer
        )


def _served_serial(port: int) -> int:
    """The serial of the certificate the server on ``port`` presents to a new handshake."""
    ctx = identity.client_context(identity.tls())
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        return _serial(tls.getpeercert(binary_form=True))


def test_servers_and_channels_follow_renewals_past_the_first_certificates_expiry(renewing):
    async def main() -> None:
        seen = _SeenClients()
        server = await grpcutil.start_server([], "127.0.0.1:0", interceptors=[seen])
        address = f"127.0.0.1:{server.port}"
        first = identity.tls()
        frozen = grpc.ssl_channel_credentials(first.ca, first.key, first.cert)
        check = health_pb2.HealthCheckRequest()
        try:
            async with grpcutil.channel(address) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                await stub.Check(check, timeout=5)
                assert seen.serials == [_file_serial(renewing, "w")]
                # renewed every second, for longer than the first certificates lived
                deadline = time.monotonic() + SHORT.total_seconds() + 2
                while time.monotonic() < deadline:
                    renewing.issue("worker", "w", [], SHORT)
                    await asyncio.sleep(1.0)
                    await stub.Check(check, timeout=5)
                    now = _file_serial(renewing, "w")
                    assert seen.serials[-1] == now  # the channel dials with the new one
                    assert await asyncio.to_thread(_served_serial, server.port) == now
                # what renewal saves a channel from: the first certificate is expired now
                async with grpc.aio.secure_channel(address, frozen) as old:
                    with pytest.raises(grpc.aio.AioRpcError) as expired:
                        await health_pb2_grpc.HealthStub(old).Check(check, timeout=5)
                assert expired.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_a_server_ssl_context_presents_the_renewed_certificate(renewing):
    """The control wire's listener keeps its SSL context for its life: a renewal goes into
    it, so new connections get the new certificate."""
    ctx = identity.server_context(identity.tls())
    renewing.issue("worker", "w", [], SHORT)
    identity.tls()  # loads the renewal
    a, b = socket.socketpair()
    served: list[ssl.SSLSocket] = []
    t = threading.Thread(target=lambda: served.append(ctx.wrap_socket(a, server_side=True)))
    t.start()
    client = identity.client_context(identity.tls()).wrap_socket(b, server_hostname="localhost")
    t.join(5)
    try:
        assert _serial(client.getpeercert(binary_form=True)) == _file_serial(renewing, "w")
    finally:
        client.close()
        for s in served:
            s.close()
