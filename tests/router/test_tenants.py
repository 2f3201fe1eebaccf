"""Tenant keys, salts, abort keys and in-flight caps (pdserve/tenants.py), without a network."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.config import ConfigError
from pdserve.errors import ResourceExhausted
from pdserve.tenants import Tenants

KA, KB = "a" * 16 + "-alpha-key", "b" * 16 + "-beta-key"


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tenants"
    path.write_text(text)
    return str(path)


def test_keys_name_their_tenants(tmp_path: Path) -> None:
    t = Tenants.load(_file(tmp_path, f"# team keys\nalpha {KA}\n\nbeta   {KB}\n"), "c" * 20)
    assert (t.tenant_of(KA), t.tenant_of(KB), t.tenant_of("c" * 20)) == ("alpha", "beta", "default")
    assert t.tenant_of(KA + "x") is None and t.tenant_of("") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "names no tenant"),
        (f"alpha {KA} extra\n", "line 1: field 3 is not an option"),
        (f"alpha {KA} {KB}\n", "line 1: field 3 is not an option"),
        ("alpha\n", "line 1: expected 'NAME KEY"),
        (f"al/pha {KA}\n", "tenant name 'al/pha'"),
        (f"alpha {KA}\nalpha {KB}\n", "line 2: tenant 'alpha' is named twice"),
        ("alpha short\n", "key is shorter than 16"),
        (f"alpha {KA}\nbeta {KA}\n", "line 2: tenant 'beta''s key is another tenant's too"),
    ],
)
def test_a_bad_tenants_file_says_where_and_never_shows_a_key(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        Tenants.load(_file(tmp_path, text))
    assert message in str(err.value)
    assert KA not in str(err.value) and "short" not in str(err.value).replace("shorter", "")


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tenant_keys_file .*nope"):
        Tenants.load(str(tmp_path / "nope"))


def test_salts_are_per_tenant_and_the_anonymous_tenant_keeps_its_own() -> None:
    assert Tenants.salt("", "s1") == "s1" and Tenants.salt("", "") == ""
    a, b = Tenants.salt("alpha", ""), Tenants.salt("beta", "")
    assert a != b and len(a) == 64 and int(a, 16) >= 0
    assert Tenants.salt("alpha", "s1") not in (a, Tenants.salt("beta", "s1"))
    assert Tenants.salt("alpha", "s1") == Tenants.salt("alpha", "s1")  # stable across routers
    # no tenant's raw salt turns into another's: beta sending alpha's derived salt gets its own
    assert Tenants.salt("beta", a) != a


def test_abort_keys_and_inflight_caps_are_per_tenant() -> None:
    assert Tenants.abort_key("", "r1") == "r1"
    assert Tenants.abort_key("alpha", "r1") != Tenants.abort_key("beta", "r1")
    t = Tenants(max_inflight=2)
    t.enter("alpha")
    t.enter("alpha")
    with pytest.raises(ResourceExhausted, match="tenant 'alpha' has 2 requests in flight"):
        t.enter("alpha")
    t.enter("beta")  # another tenant is not affected
    t.leave("alpha")
    t.enter("alpha")
    for _ in range(3):
        t.enter("")  # the anonymous tenant has no cap
    assert t.inflight == {"alpha": 2, "beta": 1}


def test_a_router_keeps_tenants_apart(tiny_model_dir, tmp_path: Path) -> None:
    """Two tenants' keys on one router (fake workers): each tenant's requests reach the
    workers under its own cache salt (its own namespace, without choosing a secret), only the
    tenant that started a request aborts it, and each tenant's in-flight cap is its own."""
    import asyncio

    import aiohttp
    import grpc
    from router_fakes import FakeDecode, FakePrefill, fake_cluster

    from pdserve import auth
    from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

    keys = _file(tmp_path, f"alpha {KA}\nbeta {KB}\n")
    decode = FakeDecode(token_delay_s=0.05)

    async def main() -> None:
        cluster = fake_cluster(
            [FakePrefill()], [decode], tiny_model_dir, tenant_keys_file=keys, tenant_max_inflight=1
        )
        async with cluster as (r, _):
            async with aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http:

                async def complete(key: str, **extra) -> int:
                    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 2, **extra}
                    headers = {"Authorization": f"Bearer {key}"}
                    async with http.post("/v1/completions", json=body, headers=headers) as resp:
                        await resp.read()
                        return resp.status

                for key, extra in ((KA, {}), (KA, {}), (KB, {}), (KA, {"cache_salt": "s"})):
                    assert await complete(key, **extra) == 200
                assert await complete("c" * 20) == 401
            salts = [c.cache_salt for c in decode.calls]
            assert salts[0] == salts[1] and len({salts[0], salts[2], salts[3]}) == 3
            assert "" not in salts and "s" not in salts

            async with grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc_port}") as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                sampling = common_pb2.SamplingParams(max_tokens=60, ignore_eos=True)
                req = router_pb2.GenerateRequest(
                    model="tiny", prompt_token_ids=[5, 6, 7], sampling=sampling, request_id="r1"
                )
                stream = stub.GenerateStream(req, metadata=auth.bearer(KA), timeout=30)
                await stream.read()  # alpha's request runs
                # alpha's cap (1 in flight) holds alpha back, not beta
                with pytest.raises(grpc.aio.AioRpcError) as capped:
                    await stub.Generate(req, metadata=auth.bearer(KA), timeout=10)
                assert capped.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "tenant 'alpha' has 1 requests in flight" in capped.value.details()
                two = common_pb2.SamplingParams(max_tokens=2)
                other = router_pb2.GenerateRequest(
                    model="tiny", prompt_token_ids=[5, 6, 7], sampling=two
                )
                await stub.Generate(other, metadata=auth.bearer(KB), timeout=10)
                # beta cannot abort alpha's r1; alpha can
                abort = router_pb2.AbortRequest(request_id="r1")
                with pytest.raises(grpc.aio.AioRpcError) as unseen:
                    await stub.Abort(abort, metadata=auth.bearer(KB), timeout=10)
                assert unseen.value.code() == grpc.StatusCode.NOT_FOUND
                await stub.Abort(abort, metadata=auth.bearer(KA), timeout=10)
                last = await stream.read()
                while (msg := await stream.read()) is not grpc.aio.EOF:
                    last = msg
                assert last.finish_reason == common_pb2.FINISH_REASON_CANCELLED

    asyncio.run(main())
