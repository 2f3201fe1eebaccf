"""The tenant reaches the store (no network): the router's worker requests carry it, the worker
checks it and makes it the task's tenant, the connector reads it from a request's
kv_transfer_params, and a chunk put names it in the KVNamespace of its chain root."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from recording_backend import Recording

from pdserve import hashing, tenants
from pdserve.engines.chunk_io import ChunkIO
from pdserve.engines.connector_keys import RequestKeys
from pdserve.errors import InvalidArgument
from pdserve.requests import Sampling
from pdserve.services.router.request import GenRequest
from pdserve.services.router.worker_requests import decode_request, prefill_request, resumed_request
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.request import check_request
from pdserve.store.client.writes import _tag
from pdserve.v1 import engine_pb2, kvstore_pb2

FP = hashing.ModelFingerprint(model_id="m", kv_dtype="float32", chunk_size=4)


def test_the_routers_worker_requests_carry_the_tenant() -> None:
    req = GenRequest("r1", [1, 2, 3], Sampling(max_tokens=4), cache_salt="s", tenant="acme")
    assert prefill_request(req, "m", publish=False).tenant == "acme"
    first = decode_request(req, "m")
    assert first.tenant == "acme"
    resumed = resumed_request(first, [7])
    assert resumed is not None and resumed.tenant == "acme"
    assert prefill_request(GenRequest("r2", [1], Sampling()), "m", publish=False).tenant == ""


@pytest.mark.parametrize("cls", [engine_pb2.PrefillRequest, engine_pb2.DecodeRequest])
def test_the_worker_makes_the_tenant_its_tasks_and_refuses_a_malformed_one(cls) -> None:
    engine, cfg = SimpleNamespace(max_model_len=100), WorkerConfig(model="m")

    async def check(tenant: str) -> str:  # a task of its own, as each RPC runs in
        check_request(cls(model="m", prompt_token_ids=[1], tenant=tenant), engine, cfg)
        return tenants.current.get()

    assert asyncio.run(check("acme")) == "acme"
    assert asyncio.run(check("")) == ""
    with pytest.raises(InvalidArgument, match="tenant 'no way!' must be 1-64 characters"):
        asyncio.run(check("no way!"))


def test_the_connector_reads_the_tenant_from_kv_transfer_params() -> None:
    keys = RequestKeys(FP)

    def request(params):
        return SimpleNamespace(
            cache_salt="s", lora_request=None, kv_transfer_params=params, mm_features=[]
        )

    scope = keys.scope(request({"pdserve": {"tenant": "acme"}}))
    assert scope.tenant == "acme" and scope.root == hashing.chain_root(FP, "s").hex()
    assert keys.scope(request(None)).tenant == ""
    assert keys.scope(request({"pdserve": {"tenant": 7}})).tenant == ""


def test_a_chunk_put_names_each_roots_tenant() -> None:
    store = Recording()
    salted = hashing.chain_root(FP, "acme-salt").hex()
    kv = torch.zeros(2, 2, 3, 4, 8)
    io = ChunkIO(store, FP)
    assert io.save([("k0", kv), ("k1", kv)], roots={"k1": salted}, tenants={salted: "acme"}) == 2
    (ns,) = store.namespaces
    assert ns is not None and dict(ns.tenants) == {salted: "acme"}

    digest = FP.digest().hex()
    req = kvstore_pb2.BatchPutStartRequest(client_id="c")
    for k in ("k0", "k1"):
        req.items.add(key=k, size=1)
    _tag(req, ns)
    assert [(n.root, n.tenant) for n in req.namespaces] == [(digest, ""), (salted, "acme")]
