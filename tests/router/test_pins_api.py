"""``/v1/pdserve/pins`` on a router (fake workers) in front of a real KV store master and node:
a tenant's pin names the keys the router computes for its prompt under the tenant's own chain
(a chunk stored under them counts as stored), lists and deletes only its own pins, and bad
bodies, a missing key and a pin past the tenant's memory share answer with the right status and
a message that says what is wrong."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import aiohttp
import pytest
import torch
from router_fakes import FakeDecode, FakePrefill, fake_cluster

from pdserve import hashing
from pdserve.engines.chunk_io import ChunkIO
from pdserve.store.client import StoreClient, pins
from pdserve.tenants import Tenants

KA, KB = "a" * 20, "b" * 20
PROMPT = list(range(10, 20))  # two full chunks of 4 and a tail of 2
API = "/v1/pdserve/pins"


@pytest.mark.slow
def test_tenants_pin_their_own_prefixes_through_the_router(
    tiny_model_dir, cluster_factory, tmp_path: Path
) -> None:
    store = cluster_factory(inline_max_bytes=0, tenant_shares=json.dumps({"beta": 1000}))
    store.add_node(node_id=f"p{uuid.uuid4().hex[:6]}", segment_sizes="8MiB", transports="tcp")
    keys_file = tmp_path / "tenants"
    keys_file.write_text(f"alpha {KA}\nbeta {KB}\n")
    client = StoreClient(store.address, transport="tcp", control="grpc")

    async def main() -> None:
        cluster = fake_cluster(
            [FakePrefill()],
            [FakeDecode()],
            tiny_model_dir,
            tenant_keys_file=str(keys_file),
            store_master=store.address,
        )
        async with (
            cluster as (r, _),
            aiohttp.ClientSession(f"http://127.0.0.1:{r.http_port}") as http,
        ):
            fe = r.frontend

            async def call(method: str, path: str, key: str | None, body=None):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                async with http.request(method, path, json=body, headers=headers) as resp:
                    return resp.status, await resp.json()

            fp = fe.orchestrator.fp
            assert fp is not None and fp.chunk_size == 4
            # alpha's first chunk is stored (as a worker of alpha's would store it)
            salt = Tenants.salt("alpha", "")
            keys = hashing.chunk_keys(fp, PROMPT, salt)
            kv = torch.randn(2, 2, 2, 4, 8)
            root = hashing.chain_root(fp, salt).hex()
            saved = ChunkIO(client, fp).save(
                [(keys[0], kv)], roots={keys[0]: root}, tenants={root: "alpha"}
            )
            assert saved == 1

            status, body = await call("POST", API, KA, {"name": "sys", "prompt_token_ids": PROMPT})
            assert status == 200, body
            assert (body["chunks"], body["stored_chunks"], body["tokens"]) == (2, 1, 10)
            assert body["pinned_tokens"] == 8 and body["stored_bytes"] > 0
            assert body["tenant_pinned_bytes"] == body["stored_bytes"]
            listed = pins.list_pins(client.master)
            assert [(p.tenant, p.name, p.keys, p.present) for p in listed.pins] == [
                ("alpha", "sys", 2, 1)
            ]

            # the messages form pins the chat template's tokens without the generation prompt
            msgs = [{"role": "system", "content": "You are a careful assistant. " * 3}]
            status, body = await call("POST", API, KA, {"name": "chat", "messages": msgs})
            assert status == 200, body
            want = fe.tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
            assert body["tokens"] == len(want) and body["chunks"] == len(want) // 4

            # each tenant sees its own pins only
            status, body = await call("GET", API, KB, None)
            assert status == 200 and body["data"] == []
            status, body = await call("GET", API, KA, None)
            assert sorted(p["name"] for p in body["data"]) == ["chat", "sys"]
            assert body["usage"]["pinned_bytes"] > 0

            # beta's share is 1000 bytes: a stored chunk of 4 KiB cannot be pinned
            beta_salt = Tenants.salt("beta", "")
            beta_keys = hashing.chunk_keys(fp, PROMPT, beta_salt)
            beta_root = hashing.chain_root(fp, beta_salt).hex()
            ChunkIO(client, fp).save(
                [(beta_keys[0], kv)], roots={beta_keys[0]: beta_root}, tenants={beta_root: "beta"}
            )
            status, body = await call("POST", API, KB, {"name": "x", "prompt_token_ids": PROMPT})
            assert status == 429
            assert "its memory share is 1000 bytes" in body["error"]["message"]

            for bad, what in (
                ({"name": "x"}, "give exactly one of prompt, messages and prompt_token_ids"),
                ({"name": "x", "prompt": "hi", "prompt_token_ids": [1]}, "(got prompt, prompt"),
                ({"name": "x", "prompt_token_ids": [1, 2]}, "less than one chunk (4 tokens)"),
                ({"prompt_token_ids": PROMPT}, "name (a non-empty string) is required"),
                ({"name": "x", "promt": "hi"}, "unknown field 'promt'"),
                ({"name": "x" * 200, "prompt_token_ids": PROMPT}, "pin name 'xxx"),
            ):
                status, body = await call("POST", API, KA, bad)
                assert status == 400 and what in body["error"]["message"], (bad, body)
            status, _ = await call("POST", API, None, {"name": "x", "prompt_token_ids": PROMPT})
            assert status == 401

            status, body = await call("DELETE", API + "/sys", KB, None)
            assert status == 404 and "no pin named 'sys'" in body["error"]["message"]
            status, body = await call("DELETE", API + "/sys", KA, None)
            assert status == 200 and body["deleted"]
            assert [p.name for p in pins.list_pins(client.master, "alpha").pins] == ["chat"]

    try:
        asyncio.run(main())
    finally:
        client.close()
