"""Several models behind one router (services/router/models.py): the config's ``models`` and
``model_settings``, the choice of a request's model, and an in-process router in front of one
fake decode worker per model: each model's requests reach only its own worker, a request
without a model goes to the first, an unknown one is 404 model_not_found / NOT_FOUND, and
/v1/models, /v1/models/{id}, ListModels and /health cover every model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import grpc
import pytest
from router_fakes import FakeDecode, expected_tokens, start_fake

from pdserve import grpcutil
from pdserve.config import ConfigError
from pdserve.errors import ModelNotFound
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.models import Models, ModelSpec, model_configs
from pdserve.telemetry import REGISTRY
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc


def test_model_specs():
    assert ModelSpec.parse("smollm2") == ModelSpec("smollm2", "smollm2")
    assert ModelSpec.parse(" b = /models/x ") == ModelSpec("b", "/models/x")
    for bad in ("=x", "b=", ""):
        with pytest.raises(ConfigError, match="SERVED=MODEL"):
            ModelSpec.parse(bad)


def _cfg(**kw) -> RouterConfig:
    cfg = RouterConfig(**{"meta": "127.0.0.1:1", **kw})
    cfg.validate()
    return cfg


def test_config_models_and_settings():
    one = _cfg(model="tiny", served_name="t")
    assert model_configs(one) == [one]  # one model: today's config, unchanged
    cfg = _cfg(
        models=["a=tiny", "b=tiny"],
        max_model_len=64,
        model_settings={"b": {"max_model_len": "32", "decode": "h:1,h:2"}},
    )
    assert (cfg.model, cfg.served_name, cfg.name) == ("tiny", "a", "a")  # the default
    a, b = model_configs(cfg)
    assert (a.name, a.max_model_len, a.decode, a.models) == ("a", 64, [], [])
    assert (b.name, b.max_model_len, b.decode) == ("b", 32, ["h:1", "h:2"])
    for kw, msg in (
        ({"models": ["a=tiny", "a=other"]}, "given twice"),
        ({"models": ["a=tiny"], "model_settings": {"c": {}}}, "not in models"),
        ({"models": ["a=tiny"], "model_settings": {"a": {"policy": "x"}}}, "cannot differ"),
        ({"models": ["a=tiny"], "model_settings": {"a": {"chunk_size": "x"}}}, "chunk_size"),
        ({"model_settings": {"a": {}}}, "needs models"),
        ({"models": ["a=tiny", "b=tiny"], "decode": ["h:1"]}, "belong to one"),
        ({"models": ["a=tiny", "b=tiny"], "meta": ""}, "have no workers"),
    ):
        with pytest.raises(ConfigError, match=msg):
            _cfg(**kw)


def _fe(name: str) -> SimpleNamespace:
    return SimpleNamespace(limits=SimpleNamespace(model=name))


def test_select_default_known_and_unknown():
    a, b = _fe("a"), _fe("b")
    models = Models([a, b])
    assert models.names() == ["a", "b"] and models.default is a
    assert models.select("") is a and models.select(None) is a and models.select(3) is a
    assert models.select("b") is b
    with pytest.raises(ModelNotFound, match="serves 'a', 'b'") as err:
        models.select("c")
    assert err.value.code == grpc.StatusCode.NOT_FOUND and err.value.param == "model"
    with pytest.raises(ValueError, match="repeat"):
        Models([a, _fe("a")])


@contextlib.asynccontextmanager
async def two_model_router(tiny: Path, decodes: dict[str, FakeDecode]):
    """An in-process router serving each model of ``decodes`` (the first the default) from
    the fake decode worker given for it."""
    from pdserve.services.router.server import serve

    servers = {name: await start_fake(d) for name, d in decodes.items()}
    config = RouterConfig(
        port=0,
        http_port=0,
        models=[f"{name}={tiny}" for name in decodes],
        model_settings={name: {"decode": [s.address]} for name, s in servers.items()},
        chunk_size=4,
        kv_dtype="float32",
        local_prefill_threshold=0,
    )
    config.validate()
    stop = asyncio.Event()
    started: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(serve(config, stop, started=started.set_result))
    running = await asyncio.wait_for(started, 30)
    try:
        yield running
    finally:
        stop.set()
        await task
        for s in servers.values():
            await s.stop(0)


def test_each_model_from_its_own_workers(tiny_model_dir):
    decodes = {"a": FakeDecode(), "b": FakeDecode()}
    prompt = [5, 6, 7]

    async def main():
        async with (
            two_model_router(tiny_model_dir, decodes) as r,
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
            grpcutil.channel(f"127.0.0.1:{r.grpc_port}") as ch,
        ):

            async def post(path: str, body: dict) -> tuple[int, dict]:
                async with http.post(path, json=body) as resp:
                    return resp.status, await resp.json()

            for name in ("b", "a", "b"):
                body = {"model": name, "prompt": prompt, "max_tokens": 3, "temperature": 0}
                status, out = await post("/v1/completions", body)
                assert status == 200 and out["model"] == name, out
                want = "".join(f"<{t}>" for t in expected_tokens(prompt, 3))
                assert out["choices"][0]["text"] == want
            assert [c.model for c in decodes["a"].calls] == ["a"]
            assert [c.model for c in decodes["b"].calls] == ["b", "b"]
            status, out = await post(
                "/v1/chat/completions",
                {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
            assert status == 200 and out["model"] == "b" and len(decodes["b"].calls) == 3
            status, out = await post("/v1/completions", {"model": "c", "prompt": "x"})
            assert status == 404 and out["error"]["code"] == "model_not_found", out
            assert "'a', 'b'" in out["error"]["message"]

            stub = router_pb2_grpc.RouterServiceStub(ch)
            sampling = common_pb2.SamplingParams(max_tokens=2, temperature=0)
            got = await stub.Generate(
                router_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
            )  # no model: the default
            assert list(got.token_ids) == expected_tokens(prompt, 2)
            assert [c.model for c in decodes["a"].calls] == ["a", "a"]
            got = await stub.Generate(
                router_pb2.GenerateRequest(model="b", prompt_token_ids=prompt, sampling=sampling)
            )
            assert (
                list(got.token_ids) == expected_tokens(prompt, 2) and len(decodes["b"].calls) == 4
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(router_pb2.GenerateRequest(model="c", prompt="x"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'c'" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Tokenize(router_pb2.TokenizeRequest(model="c", text="x"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            listed = (await stub.ListModels(router_pb2.ListModelsRequest())).models
            assert [(m.name, m.decode_workers) for m in listed] == [("a", 1), ("b", 1)]

            async with http.get("/v1/models") as resp:
                data = (await resp.json())["data"]
            assert [m["id"] for m in data] == ["a", "b"]
            assert {m["root"] for m in data} == {str(tiny_model_dir)}
            async with http.get("/v1/models/b") as resp:
                assert resp.status == 200 and (await resp.json())["id"] == "b"
            async with http.get("/v1/models/c") as resp:
                assert resp.status == 404
            status, out = await post("/tokenize", {"model": "b", "prompt": "hello"})
            assert status == 200 and out["count"] == len(out["tokens"]) > 0
            status, out = await post("/tokenize", {"model": "c", "prompt": "hello"})
            assert status == 404 and out["error"]["code"] == "model_not_found"
            async with http.get("/health") as resp:
                assert resp.status == 200 and (await resp.json())["decode_workers"] == 2
            for name in ("a", "b"):
                labels = {"role": "decode", "model": name}
                assert REGISTRY.get_sample_value("pdserve_router_workers", labels) == 1

    asyncio.run(main())


def test_a_worker_of_another_model_is_not_refused_just_not_that_models(caplog):
    """Two models' pools fed the same meta listing: each takes its own worker and sees the
    other's not at all (its different fingerprint is no disagreement: nothing refused,
    nothing logged)."""
    from pdserve.hashing import ModelFingerprint
    from pdserve.services.router.fingerprint import FingerprintSource
    from pdserve.services.router.workers import DECODE, WorkerPool
    from pdserve.v1 import common_pb2 as c
    from pdserve.v1 import meta_pb2

    def instance(iid: str, model: str) -> meta_pb2.Instance:
        labels = ModelFingerprint(model, "rev1", "float32", 32).to_labels()
        return meta_pb2.Instance(
            instance_id=iid, role=c.ROLE_DECODE, model=model, address=f"{iid}:1", labels=labels
        )

    listing = [instance("decode-0", "a"), instance("decode-1", "b")]
    pools = {}
    for name in ("a", "b"):
        pool = WorkerPool(model=name)
        src = FingerprintSource(
            name, "rev1", kv_dtype="auto", chunk_size=0, workers=pool.registered_labels
        )
        pool.refusals = src.refusals
        with caplog.at_level(logging.INFO):
            pool.sync(listing)
        pools[name] = pool
        assert src.current() == ModelFingerprint(name, "rev1", "float32", 32)
    assert [w.id for w in pools["a"].candidates(DECODE)] == ["decode-0"]
    assert [w.id for w in pools["b"].candidates(DECODE)] == ["decode-1"]
    assert not pools["a"].refused() and not pools["b"].refused()
    assert "refused" not in caplog.text and "disagree" not in caplog.text
