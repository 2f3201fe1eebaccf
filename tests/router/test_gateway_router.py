"""The gateway's tenant header through an in-process router (fake workers, real sockets): over
HTTP and gRPC, from a configured peer and over mutual TLS with a gateway certificate, the
request is the named tenant's exactly as with the tenant's own key (the same cache salt on the
worker, aborted by the tenant's key); from anyone else, or naming no tenant, 403 /
PERMISSION_DENIED naming the header."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import aiohttp
import grpc
import pytest
from router_fakes import FakeDecode, FakePrefill, fake_cluster

from pdserve import auth
from pdserve.commands import certs
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

KA, KB = "a" * 16 + "-alpha-key", "b" * 16 + "-beta-key"
HEADER = "x-pdserve-tenant"
BODY = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 2}


def _keys(tmp_path: Path) -> str:
    path = tmp_path / "tenants"
    path.write_text(f"alpha {KA}\nbeta {KB}\n")
    return str(path)


async def _post(http: aiohttp.ClientSession, headers: dict[str, str]) -> tuple[int, dict]:
    async with http.post("/v1/completions", json=BODY, headers=headers) as resp:
        return resp.status, await resp.json()


def _request(rid: str = "", n: int = 2) -> router_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=n, ignore_eos=True)
    return router_pb2.GenerateRequest(
        model="tiny", prompt_token_ids=[5, 6, 7], sampling=sampling, request_id=rid
    )


def test_a_configured_peer_speaks_for_a_tenant(tiny_model_dir, tmp_path: Path) -> None:
    decode = FakeDecode(token_delay_s=0.05)

    async def main() -> None:
        cluster = fake_cluster(
            [FakePrefill()],
            [decode],
            tiny_model_dir,
            tenant_keys_file=_keys(tmp_path),
            gateway_peers=["127.0.0.0/8"],
        )
        async with cluster as (r, _):
            async with aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http:
                assert (await _post(http, {"Authorization": f"Bearer {KA}"}))[0] == 200
                assert (await _post(http, {HEADER: "alpha"}))[0] == 200  # no key needed
                assert (await _post(http, {HEADER: "beta"}))[0] == 200
                status, body = await _post(http, {HEADER: "gamma"})
                assert status == 403 and body["error"]["code"] == "permission_denied"
                assert "x-pdserve-tenant header names 'gamma'" in body["error"]["message"]
                assert (await _post(http, {}))[0] == 401  # a gateway without the header: a key
            # the header's tenant is the key's: the same salt reaches the worker
            salts = [c.cache_salt for c in decode.calls]
            assert salts[0] == salts[1] != salts[2] and "" not in salts

            async with grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc_port}") as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                as_alpha = ((HEADER, "alpha"),)
                stream = stub.GenerateStream(_request("r1", 200), metadata=as_alpha, timeout=30)
                await stream.read()  # alpha's request runs, started through the gateway
                abort = router_pb2.AbortRequest(request_id="r1")
                with pytest.raises(grpc.aio.AioRpcError) as unseen:  # beta's key: not its own
                    await stub.Abort(abort, metadata=auth.bearer(KB), timeout=10)
                assert unseen.value.code() == grpc.StatusCode.NOT_FOUND
                await stub.Abort(
                    abort, metadata=auth.bearer(KA), timeout=10
                )  # alpha's key: its own
                last = await stream.read()
                while (msg := await stream.read()) is not grpc.aio.EOF:
                    last = msg
                assert last.finish_reason == common_pb2.FINISH_REASON_CANCELLED
                with pytest.raises(grpc.aio.AioRpcError) as unknown:
                    await stub.Generate(_request(), metadata=((HEADER, "gamma"),), timeout=10)
                assert unknown.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "names 'gamma', which is no tenant" in unknown.value.details()
            assert decode.calls[-1].cache_salt == salts[0]  # gRPC's alpha is HTTP's alpha

    asyncio.run(main())


def test_the_header_from_a_peer_that_is_no_gateway_is_refused(tiny_model_dir, tmp_path) -> None:
    async def main() -> None:
        cluster = fake_cluster(
            [FakePrefill()],
            [FakeDecode()],
            tiny_model_dir,
            tenant_keys_file=_keys(tmp_path),
            gateway_peers=["10.9.9.9"],
        )
        async with cluster as (r, _):
            async with aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http:
                # a forged header is refused even beside a valid key: never silently ignored
                for headers in (
                    {HEADER: "alpha"},
                    {HEADER: "beta", "Authorization": f"Bearer {KA}"},
                ):
                    status, body = await _post(http, headers)
                    assert status == 403, body
                    assert (
                        "x-pdserve-tenant header is taken only from a trusted gateway"
                        in (body["error"]["message"])
                    )
                assert (await _post(http, {"Authorization": f"Bearer {KA}"}))[0] == 200
            async with grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc_port}") as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                forged = (*auth.bearer(KA), (HEADER, "beta"))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Generate(_request(), metadata=forged, timeout=10)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "x-pdserve-tenant header is taken only from" in err.value.details()
                await stub.Generate(_request(), metadata=auth.bearer(KA), timeout=10)

    asyncio.run(main())


def _client_ssl(d: Path, name: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(d / "ca.crt"))
    ctx.load_cert_chain(d / f"{name}.crt", d / f"{name}.key")
    return ctx


def _grpc_creds(d: Path, name: str) -> grpc.ChannelCredentials:
    ca, key, cert = (d / "ca.crt").read_bytes(), (d / f"{name}.key"), (d / f"{name}.crt")
    return grpc.ssl_channel_credentials(ca, key.read_bytes(), cert.read_bytes())


def test_a_gateway_certificate_speaks_for_a_tenant(tiny_model_dir, tmp_path: Path) -> None:
    """Mutual TLS on the public API: the gateway's certificate (OU gateway, CN listed) proves
    it from any address; another certificate of the same CA does not (its key still works);
    HTTP takes clients without a certificate too, gRPC requires one (docs/gateway.md)."""
    d = tmp_path / "certs"
    certs.make(d, ["router:router", "gateway:nginx", "gateway:rogue", "admin:ops"])
    decode = FakeDecode()

    async def main() -> None:
        cluster = fake_cluster(
            [FakePrefill()],
            [decode],
            tiny_model_dir,
            tenant_keys_file=_keys(tmp_path),
            public_tls_cert=str(d / "router.crt"),
            public_tls_key=str(d / "router.key"),
            gateway_identities=["nginx"],
            gateway_ca=str(d / "ca.crt"),
        )
        async with cluster as (r, _):
            url = f"https://127.0.0.1:{r.http_port}"
            for name, want in (("nginx", 200), ("rogue", 403), ("ops", 403)):
                conn = aiohttp.TCPConnector(ssl=_client_ssl(d, name))
                async with aiohttp.ClientSession(url, connector=conn) as http:
                    assert (await _post(http, {HEADER: "alpha"}))[0] == want, name
            plain = aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=str(d / "ca.crt")))
            async with aiohttp.ClientSession(url, connector=plain) as http:
                assert (await _post(http, {HEADER: "alpha"}))[0] == 403
                assert (await _post(http, {"Authorization": f"Bearer {KA}"}))[0] == 200
            salts = [c.cache_salt for c in decode.calls]
            assert salts[0] == salts[1]  # nginx's alpha is the key's alpha

            address = f"127.0.0.1:{r.grpc_port}"
            async with grpc.aio.secure_channel(address, _grpc_creds(d, "nginx")) as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                await stub.Generate(_request(), metadata=((HEADER, "alpha"),), timeout=10)
            assert decode.calls[-1].cache_salt == salts[0]
            async with grpc.aio.secure_channel(address, _grpc_creds(d, "ops")) as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Generate(_request(), metadata=((HEADER, "alpha"),), timeout=10)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "admin:ops at 127.0.0.1 is none" in err.value.details()
                await stub.Generate(_request(), metadata=auth.bearer(KA), timeout=10)

    asyncio.run(main())
