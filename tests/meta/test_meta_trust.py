"""Meta refuses what is not the caller's (issue 15): a real ``pdserve meta`` with mutual TLS
(certificates made here with ``pdserve certs``' code), called by several identities. A fake
decode worker from a node certificate, a takeover of another identity's instance, a caller
without a certificate, junk registrations past the caps, anonymous writes to the Mooncake
HTTP endpoint: each is refused with its status, and the same operation succeeds for the
identity it belongs to."""

from __future__ import annotations

import asyncio
import base64
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve import grpcutil, identity
from pdserve.commands import certs
from pdserve.discovery import Discovery, MetaClient
from pdserve.procs import ProcessStartError, ServiceProcess, service_args, start_service
from pdserve.v1 import common_pb2, meta_pb2, meta_pb2_grpc

DECODE = common_pb2.ROLE_DECODE
IDENTITIES = [
    "meta:meta",
    "worker:decode",
    "worker:decode-0",
    "worker:prefill-0",
    "node:n1",
    "router:r1",
    "admin:ops",
]
DENIED = grpc.StatusCode.PERMISSION_DENIED
#: gRPC's default message limit in pdserve (grpcutil.DEFAULT_MAX_MESSAGE_BYTES).
MESSAGE_LIMIT = 16 * 1024 * 1024


@pytest.fixture(scope="module")
def certdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("meta-certs")
    certs.make(d, IDENTITIES)
    return d


def tls_flags(d: Path, name: str = "meta") -> list[str]:
    return [f"--tls-ca={d / 'ca.crt'}", f"--tls-cert={d / name}.crt", f"--tls-key={d / name}.key"]


def files(d: Path, name: str) -> identity.TlsFiles:
    loaded = identity.TlsFiles.load(
        str(d / "ca.crt"), str(d / f"{name}.crt"), str(d / f"{name}.key")
    )
    assert loaded is not None
    return loaded


def stub_as(address: str, d: Path, name: str | None) -> meta_pb2_grpc.MetaServiceStub:
    """MetaService as identity ``name`` (None: TLS without a client certificate)."""
    if name is None:
        creds = grpc.ssl_channel_credentials(root_certificates=(d / "ca.crt").read_bytes())
    else:
        f = files(d, name)
        creds = grpc.ssl_channel_credentials(f.ca, f.key, f.cert)
    return meta_pb2_grpc.MetaServiceStub(grpc.aio.secure_channel(address, creds))


def decode(iid: str, address: str = "127.0.0.1:9000") -> meta_pb2.Instance:
    return meta_pb2.Instance(instance_id=iid, role=DECODE, address=address, model="m")


async def refused(call, code: grpc.StatusCode, message: str = "") -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, err.value.details()
    assert message in (err.value.details() or ""), err.value.details()


@pytest.mark.slow
def test_identities_own_their_instances(start_meta, backend: str, certdir: Path) -> None:
    meta = start_meta(0, 0, *tls_flags(certdir), "--max-instances-per-identity", "3")
    addr = meta.info["grpc"]
    assert meta.info["http"].startswith("https://")

    async def main(meta: ServiceProcess) -> None:
        w1, w2, n1, r1, ops = (
            stub_as(addr, certdir, n) for n in ("decode", "decode-0", "n1", "r1", "ops")
        )
        reg = meta_pb2.RegisterRequest(instance=decode("decode-0"), ttl_ms=60_000)
        # a storage node's certificate announcing a fake decode worker
        await refused(n1.Register(reg), DENIED, "node:n1 may not register a ROLE_DECODE")
        # a prefill worker's certificate announcing itself as a decode worker (to take user
        # traffic), and a worker announcing another's name
        p0 = stub_as(addr, certdir, "prefill-0")
        hijack = meta_pb2.RegisterRequest(instance=decode("prefill-0"), ttl_ms=60_000)
        await refused(p0.Register(hijack), DENIED, "may not register a ROLE_DECODE")
        await refused(p0.Register(reg), DENIED, "may not register a ROLE_DECODE")
        # a node announces only itself (its certificate's name), as at the KV master
        other = meta_pb2.Instance(
            instance_id="n2", role=common_pb2.ROLE_KVSTORE_NODE, address="127.0.0.1:9001"
        )
        await refused(n1.Register(meta_pb2.RegisterRequest(instance=other, ttl_ms=60_000)), DENIED)
        other.instance_id = "n1"
        mine = (await n1.Register(meta_pb2.RegisterRequest(instance=other, ttl_ms=60_000))).lease_id
        await n1.Deregister(meta_pb2.DeregisterRequest(lease_id=mine))
        lease = (await w1.Register(reg)).lease_id
        (d0,) = (await r1.ListInstances(meta_pb2.ListInstancesRequest())).instances
        assert (d0.owner, d0.lease_id) == ("worker:decode", lease)  # the lease id is public
        # another worker takes over decode-0: re-register, heartbeat, deregister
        fake = meta_pb2.RegisterRequest(instance=decode("decode-0", "10.6.6.6:1"), ttl_ms=60_000)
        await refused(w2.Register(fake), DENIED, "worker:decode-0 may not re-register")
        beat = meta_pb2.MetaHeartbeatRequest(lease_id=lease, load=common_pb2.Load(kv_usage=1))
        await refused(w2.Heartbeat(beat), DENIED, "belongs to worker:decode")
        bye = meta_pb2.DeregisterRequest(lease_id=lease)
        await refused(w2.Deregister(bye), DENIED, "belongs to worker:decode")
        # the owner does the same
        await w1.Heartbeat(meta_pb2.MetaHeartbeatRequest(lease_id=lease))
        await w1.Register(reg)
        if backend == "etcd":  # the owner is stored with the record: it survives a restart
            port = int(addr.rsplit(":", 1)[1])
            meta.stop()
            await asyncio.to_thread(start_meta, port, 0, *tls_flags(certdir))
            await refused(
                w2.Register(fake, wait_for_ready=True), DENIED, "belongs to worker:decode"
            )
        listed = await r1.ListInstances(meta_pb2.ListInstancesRequest(), wait_for_ready=True)
        (d0,) = listed.instances
        assert (d0.address, d0.owner) == ("127.0.0.1:9000", "worker:decode")
        # per-identity cap: w1 has decode-0 and may add two more; w2 is not affected
        if backend == "memory":
            for k in (1, 2):
                await w1.Register(
                    meta_pb2.RegisterRequest(instance=decode(f"decode-x{k}"), ttl_ms=60_000)
                )
            more = meta_pb2.RegisterRequest(instance=decode("decode-x3"), ttl_ms=60_000)
            await refused(
                w1.Register(more),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "worker:decode holds its max_instances_per_identity (3)",
            )
            await w2.Register(
                meta_pb2.RegisterRequest(instance=decode("decode-0-b"), ttl_ms=60_000)
            )
        # an admin may remove anything
        (d0,) = (await ops.ListInstances(meta_pb2.ListInstancesRequest(model="m"))).instances[:1]
        await ops.Deregister(meta_pb2.DeregisterRequest(lease_id=d0.lease_id))
        # no certificate, another CA's certificate, plaintext: the handshake fails
        await refused(
            stub_as(addr, certdir, None).ListInstances(meta_pb2.ListInstancesRequest(), timeout=5),
            grpc.StatusCode.UNAVAILABLE,
        )
        plain = meta_pb2_grpc.MetaServiceStub(grpc.aio.insecure_channel(addr))
        await refused(
            plain.ListInstances(meta_pb2.ListInstancesRequest(), timeout=5),
            grpc.StatusCode.UNAVAILABLE,
        )

    asyncio.run(main(meta))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["memory"])  # the handshake does not depend on it
def test_a_certificate_of_another_ca_is_refused(start_meta, certdir: Path, tmp_path: Path) -> None:
    meta = start_meta(0, -1, *tls_flags(certdir))
    certs.make(tmp_path, ["worker:decode"])  # same identity, another CA

    async def main() -> None:
        stub = stub_as(meta.info["grpc"], tmp_path, "decode")
        reg = meta_pb2.RegisterRequest(instance=decode("decode-0"), ttl_ms=60_000)
        await refused(stub.Register(reg, timeout=5), grpc.StatusCode.UNAVAILABLE)

    asyncio.run(main())


@pytest.mark.slow
def test_one_worker_certificate_holds_one_instance(start_meta, certdir: Path) -> None:
    """Issue 56: a decode certificate registered a second instance under its own name and took
    half the router's requests. Meta's default bound refuses it; a re-registration of the
    same instance (a restart, a lost lease) and a pool's shared certificate still pass."""
    addr = start_meta(0, -1, *tls_flags(certdir)).info["grpc"]

    async def main() -> None:
        d0, pool = stub_as(addr, certdir, "decode-0"), stub_as(addr, certdir, "decode")
        first = (await d0.Register(register("decode-0"))).lease_id
        await refused(
            d0.Register(register("decode-0-b", "127.0.0.1:9001")),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "worker:decode-0 already holds 1 live decode instance(s) ('decode-0'); "
            "max_instances_per_identity_by_role allows 1 per identity",
        )
        again = (await d0.Register(register("decode-0", "127.0.0.1:9002"))).lease_id
        await d0.Heartbeat(meta_pb2.MetaHeartbeatRequest(lease_id=again))
        for iid in ("decode-a", "decode-b"):  # every pod of a StatefulSet holds worker:decode
            await pool.Register(register(iid))
        listed = (await d0.ListInstances(meta_pb2.ListInstancesRequest())).instances
        assert [(i.instance_id, i.address, i.owner) for i in listed] == [
            ("decode-0", "127.0.0.1:9002", "worker:decode-0"),
            ("decode-a", "127.0.0.1:9000", "worker:decode"),
            ("decode-b", "127.0.0.1:9000", "worker:decode"),
        ]
        assert first != again
        await d0.Deregister(meta_pb2.DeregisterRequest(lease_id=again))
        await d0.Register(register("decode-0-b"))  # its room is free once it left

    asyncio.run(main())


def register(iid: str, address: str = "127.0.0.1:9000") -> meta_pb2.RegisterRequest:
    return meta_pb2.RegisterRequest(instance=decode(iid, address), ttl_ms=60_000)


@pytest.fixture
def as_worker(certdir: Path) -> Iterator[None]:
    """This test process presents worker:decode's certificate on grpcutil's channels."""
    identity.configure_files(files(certdir, "decode"))
    try:
        yield
    finally:
        identity.configure_files(None)


@pytest.mark.slow
def test_meta_client_and_discovery_work_under_tls(start_meta, certdir: Path, as_worker) -> None:
    meta = start_meta(0, -1, *tls_flags(certdir))
    addr = meta.info["grpc"]

    async def main() -> None:
        disc = Discovery(addr, role=DECODE)
        await disc.start()
        client = MetaClient(addr)
        await client.register(decode("decode-0"), ttl_ms=1000)
        await disc.wait_for(lambda xs: [i.owner for i in xs] == ["worker:decode"], 10)
        await asyncio.sleep(1.2)  # heartbeats (as w1) keep it past its TTL
        assert [i.instance_id for i in await client.list()] == ["decode-0"]
        assert client.registrations == 1
        await client.deregister()
        await disc.wait_for(lambda xs: xs == [], 5)
        await client.close()
        await disc.close()

    asyncio.run(main())


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["memory"])  # caps and pages live above the backend
def test_junk_registrations_are_capped_and_lists_come_in_pages(start_meta) -> None:
    meta = start_meta(0, -1)  # plaintext: no per-identity cap, the total cap applies
    addr = meta.info["grpc"]
    labels = {f"label-{k:02d}": "x" * 240 for k in range(30)}  # ~7.7 KiB records

    async def main() -> None:
        async with grpcutil.channel(addr) as ch:
            stub = meta_pb2_grpc.MetaServiceStub(ch)
            gate = asyncio.Semaphore(32)

            async def register(k: int) -> grpc.StatusCode:
                inst = meta_pb2.Instance(
                    instance_id=f"junk-{k:05d}", role=DECODE, address="10.0.0.1:1", labels=labels
                )
                assert inst.ByteSize() <= 8192
                async with gate:
                    try:
                        await stub.Register(meta_pb2.RegisterRequest(instance=inst, ttl_ms=60_000))
                    except grpc.aio.AioRpcError as exc:
                        assert "max_instances (4096)" in exc.details(), exc.details()
                        return exc.code()
                return grpc.StatusCode.OK

            codes = await asyncio.gather(*(register(k) for k in range(5000)))
            assert codes.count(grpc.StatusCode.OK) == 4096
            assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 904
            ids, total, token, pages = [], 0, "", 0
            while True:
                req = meta_pb2.ListInstancesRequest(page_size=100_000, page_token=token)
                resp = await stub.ListInstances(req)
                size = resp.ByteSize()
                assert size <= 4.1 * 1024 * 1024 < MESSAGE_LIMIT, size
                ids += [i.instance_id for i in resp.instances]
                total, token, pages = total + size, resp.next_page_token, pages + 1
                if not token:
                    break
            assert ids == sorted(set(ids)) and len(ids) == 4096
            assert total > MESSAGE_LIMIT  # one answer with everything would not get through
            assert pages >= 8
            await refused(
                stub.ListInstances(meta_pb2.ListInstancesRequest(page_token="bogus")),
                grpc.StatusCode.INVALID_ARGUMENT,
                "page_token 'bogus' is not one meta issued",
            )
        client = MetaClient(addr, call_timeout_s=30)
        assert len(await client.list(DECODE)) == 4096
        await client.close()

    asyncio.run(main())


def http(method: str, url: str, *, body: bytes | None = None, auth: str = "", ctx=None):
    req = urllib.request.Request(url, data=body, method=method)
    if auth:
        req.add_header("Authorization", auth)
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["memory"])  # the HTTP checks do not depend on it
def test_http_metadata_takes_a_token_and_serves_https(
    start_meta, certdir: Path, tmp_path: Path
) -> None:
    (tmp_path / "token").write_text("tok-81c2\n")
    meta = start_meta(
        0,
        0,
        *tls_flags(certdir),
        f"--http-token-file={tmp_path / 'token'}",
        "--http-max-keys=2",
        "--http-max-value-bytes=1000",
    )
    url = meta.info["http"]
    assert url.startswith("https://")
    ctx = ssl.create_default_context(cafile=str(certdir / "ca.crt"))  # no client certificate
    seg = b'{"name": "seg-a"}'
    bearer, basic = "Bearer tok-81c2", "Basic " + base64.b64encode(b"pdserve:tok-81c2").decode()
    # anonymous requests, reads too: 401, saying how to authenticate
    code, body = http("PUT", f"{url}?key=seg-a", body=seg, ctx=ctx)
    assert code == 401 and b"http_token" in body
    code, body = http("DELETE", f"{url}?key=seg-a", ctx=ctx)
    assert code == 401 and b"Authorization: Bearer" in body
    assert http("PUT", f"{url}?key=seg-a", body=seg, auth="Bearer nope", ctx=ctx)[0] == 401
    assert http("GET", f"{url}?key=seg-a", ctx=ctx)[0] == 401
    assert http("GET", f"{url}?key=seg-a", auth=bearer, ctx=ctx) == (404, b"metadata not found")
    # with the token, as a header (Bearer) or URL credentials (Basic)
    assert http("PUT", f"{url}?key=seg-a", body=seg, auth=bearer, ctx=ctx)[0] == 200
    assert http("PUT", f"{url}?key=seg-b", body=seg, auth=basic, ctx=ctx)[0] == 200
    assert http("GET", f"{url}?key=seg-a", auth=basic, ctx=ctx) == (200, seg)
    # caps: keys (overwriting stays possible) and value size
    code, body = http("PUT", f"{url}?key=seg-c", body=seg, auth=bearer, ctx=ctx)
    assert code == 507 and b"http_max_keys (2)" in body
    assert http("PUT", f"{url}?key=seg-b", body=b"[1]", auth=bearer, ctx=ctx)[0] == 200
    code, body = http(
        "PUT", f"{url}?key=seg-a", body=b'"' + b"x" * 2000 + b'"', auth=bearer, ctx=ctx
    )
    assert code == 413 and b"http_max_value_bytes (1000 bytes)" in body
    assert http("DELETE", f"{url}?key=seg-a", auth=bearer, ctx=ctx) == (200, b"metadata deleted")
    # plain HTTP on the HTTPS port gets no answer
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        http("GET", url.replace("https://", "http://") + "?key=seg-b")


async def _enable_etcd_auth(endpoint: str, d: Path, password: str) -> None:
    from etcd3aio import Etcd3Client

    tls = {"ca_cert": (d / "ca.crt").read_bytes()}
    tls |= {"cert_chain": (d / "meta.crt").read_bytes(), "cert_key": (d / "meta.key").read_bytes()}
    async with Etcd3Client([endpoint], **tls) as client:
        await client.auth.user_add("root", password)
        await client.auth.role_add("root")
        await client.auth.user_grant_role("root", "root")
        await client.auth.auth_enable()


@pytest.mark.slow
@pytest.mark.etcd
def test_etcd_backend_over_tls_with_a_user(etcd_tls: tuple[str, Path], tmp_path: Path) -> None:
    endpoint, d = etcd_tls
    asyncio.run(_enable_etcd_auth(endpoint, d, "pw-5e1"))
    (tmp_path / "etcd-password").write_text("pw-5e1\n")
    tls = [f"--etcd-ca={d / 'ca.crt'}", f"--etcd-cert={d / 'meta.crt'}"]
    tls.append(f"--etcd-key={d / 'meta.key'}")

    def meta(*extra: str, endpoints: str = endpoint) -> ServiceProcess:
        args = service_args(
            "meta",
            *tls,
            *extra,
            port=0,
            http_port=0,
            http_metadata=True,
            backend="etcd",
            etcd_endpoints=endpoints,
        )
        return start_service("meta-etcd-tls", args, tmp_path, timeout=60)

    # two endpoints (the same etcd twice): the certificate is checked against one name
    proc = meta(
        "--etcd-user=root",
        f"--etcd-password-file={tmp_path / 'etcd-password'}",
        "--etcd-server-name=localhost",
        endpoints=f"{endpoint},{endpoint}",
    )
    try:

        async def main() -> None:
            client = MetaClient(proc.info["grpc"])
            await client.register(decode("decode-0"), ttl_ms=2000)
            await asyncio.sleep(1.0)  # a heartbeat or two through etcd
            assert [i.instance_id for i in await client.list()] == ["decode-0"]
            await client.deregister()
            await client.close()

        asyncio.run(main())
        url = proc.info["http"]
        assert http("PUT", f"{url}?key=k", body=b"{}")[0] == 200
        assert http("GET", f"{url}?key=k") == (200, b"{}")
    finally:
        proc.stop()
    with pytest.raises(ProcessStartError, match="as user 'root'"):
        meta("--etcd-user=root", "--etcd-password=wrong")
    with pytest.raises(ProcessStartError, match="cannot use etcd"):
        meta()  # TLS but no user: etcd refuses the unauthenticated calls


def test_config_checks() -> None:
    from pdserve.config import ConfigError
    from pdserve.services.meta.server import MetaConfig

    for kw, message in [
        ({"http_token": "a", "http_token_file": "f"}, "give http_token or http_token_file"),
        ({"etcd_cert": "c"}, "both etcd_cert and etcd_key"),
        ({"etcd_cert": "c", "etcd_key": "k"}, "etcd_cert needs etcd_ca"),
        ({"etcd_ca": "a", "etcd_endpoints": ["h1:2379", "h2:2379"]}, "etcd_server_name"),
        ({"etcd_password": "p"}, "etcd_password needs etcd_user"),
        ({"max_instances": 0}, "max_instances must be positive"),
        ({"max_record_bytes": 8 << 20}, "max_record_bytes must be <="),
    ]:
        with pytest.raises(ConfigError, match=message):
            MetaConfig(**kw).validate()


def test_stored_etcd_records_without_an_owner_still_load() -> None:
    from pdserve.services.meta.backends.etcd import _decode

    before = b'{"instanceId": "d0", "role": "ROLE_DECODE", "address": "h:1", "leaseId": "7f"}'
    assert (_decode(before).instance_id, _decode(before).owner) == ("d0", "")  # no owner
    later = b'{"instanceId": "d0", "owner": "worker:decode", "aFieldOfALaterVersion": 1}'
    assert _decode(later).owner == "worker:decode"
