"""Tenant shares and pins through real processes: a master with ``tenant_shares`` (a: a
quarter of the pool, b: half) and a storage node of 8 MiB. Tenant b stores 2 MiB (within its
share), tenant a pins a 512 KiB prefix and then writes four times its share: a's unpinned
chunks are evicted (counted over its share), none of b's, and b's chunks and a's pinned
prefix read back byte for byte; a pin past a's share is refused naming share and size;
``pdserve kvstore pins`` and ``namespaces`` show the tenants."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from pdserve import errors, hashing
from pdserve.engines.chunk_io import ChunkIO
from pdserve.store.client import StoreClient, pins
from pdserve.tenants import Tenants

CHUNK = 16
FP = hashing.ModelFingerprint(model_id="org/model", revision="r1", chunk_size=CHUNK)
MIB = 1 << 20


def _tenant_chunks(tenant: str, n: int, seed: int) -> tuple[list[str], list[torch.Tensor], str]:
    """``n`` chunks (128 KiB of KV each) of one prompt of ``tenant``, keyed as the router
    keys them (its tenant salt), and their chain root."""
    salt = Tenants.salt(tenant, "")
    tokens = list(range(seed, seed + CHUNK * n))
    g = torch.Generator().manual_seed(seed)
    keys = hashing.chunk_keys(FP, tokens, salt)
    return (
        keys,
        [torch.randn(4, 2, 4, CHUNK, 64, generator=g) for _ in keys],
        (hashing.chain_root(FP, salt).hex()),
    )


def _save(io: ChunkIO, tenant: str, keys, kvs, root: str) -> int:
    items = list(zip(keys, kvs, strict=True))
    written = 0
    for i in range(0, len(items), 4):  # in small batches, as a worker saves a prompt
        batch = items[i : i + 4]
        written += io.save(batch, roots={k: root for k, _ in batch}, tenants={root: tenant})
    return written


def _pdserve(*args: str) -> str:
    exe = Path(sys.executable).with_name("pdserve")
    done = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_a_flooding_tenant_evicts_only_its_own_unpinned_chunks(cluster_factory, tmp_path) -> None:
    c = cluster_factory(inline_max_bytes=0, tenant_shares=json.dumps({"a": 0.25, "b": 0.5}))
    c.add_node(node_id=f"q{uuid.uuid4().hex[:6]}", segment_sizes="8MiB", transports="tcp")
    client = StoreClient(c.address, transport="tcp", control="grpc")
    io = ChunkIO(client, FP)
    try:
        b_keys, b_kv, b_root = _tenant_chunks("b", 16, 1)  # 2 MiB of b's 4 MiB share
        assert _save(io, "b", b_keys, b_kv, b_root) == 16
        sys_keys, sys_kv, a_root = _tenant_chunks("a", 4, 5000)  # a's 512 KiB system prompt
        assert _save(io, "a", sys_keys, sys_kv, a_root) == 4
        pinned = pins.pin_keys(client.master, "a", "system", sys_keys)
        assert (pinned.pin.present, pinned.memory_share_bytes) == (4, 2 * MIB)

        flood_keys, flood_kv, _ = _tenant_chunks("a", 64, 9000)  # 8 MiB: 4x a's share
        assert _save(io, "a", flood_keys, flood_kv, a_root) == 64

        assert client.exists(b_keys) == [True] * 16
        assert client.exists(sys_keys) == [True] * 4
        kept = sum(client.exists(flood_keys))
        assert 0 < kept < 64
        for keys, kvs in ((b_keys, b_kv), (sys_keys, sys_kv)):
            got = client.batch_get_chunks(keys, FP.digest())
            assert all(g is not None and torch.equal(g, t) for g, t in zip(got, kvs, strict=True))

        usage = {t.tenant: t for t in pins.list_pins(client.master).tenants}
        a, b = usage["a"], usage["b"]
        assert a.evictions_over_share == 64 - kept and a.evictions_normal == 0
        assert b.evictions_over_share == b.evictions_normal == 0
        assert a.pinned_bytes == pinned.pin.bytes > 4 * 128 * 1024
        assert b.memory_bytes == client.stats().used_bytes - a.memory_bytes

        with pytest.raises(errors.ResourceExhausted) as refused:
            pins.pin_keys(client.master, "a", "everything", sys_keys + flood_keys)
        assert "its memory share is 2097152 bytes" in str(refused.value)
        assert "tenant 'a' would pin" in str(refused.value)

        run_dir = str(tmp_path / "no-up")
        listed = json.loads(
            _pdserve("kvstore", "pins", "--json", "--master", c.address, "--run-dir", run_dir)
        )
        assert [(p["tenant"], p["name"], p["stored_chunks"]) for p in listed["pins"]] == [
            ("a", "system", 4)
        ]
        roots = json.loads(
            _pdserve("kvstore", "namespaces", "--json", "--master", c.address, "--run-dir", run_dir)
        )[0]["roots"]
        assert {r: v["tenant"] for r, v in roots.items()} == {a_root: "a", b_root: "b"}
    finally:
        client.close()
