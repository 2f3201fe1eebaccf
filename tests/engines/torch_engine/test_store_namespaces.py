"""The torch engine's puts say whose KV they carry: every chunk and tail of a request is
tagged with the engine's fingerprint (digest and labels) and its cache salt's chain root, so
the master can drop or quarantine them (docs/architecture.md, "Namespaces")."""

from __future__ import annotations

import asyncio

import pytest

from pdserve import hashing
from pdserve.engines.torch_engine.engine import TorchEngine
from pdserve.requests import Sampling
from pdserve.store.memory import MemoryBackend

CS = 16


class Tagged(MemoryBackend):
    """The in-memory store (the real chunk codec), keeping each put's key -> (chain root, fingerprint, labels)."""

    carries_chunk_meta = True

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, tuple[str, str, dict[str, str]]] = {}

    def batch_put(self, items, options=None, *, meta=None, namespace=None):
        assert namespace is not None, "a chunk put without its namespace"
        for key, _ in items:
            self.tags[key] = (namespace.root_of(key), namespace.fingerprint, dict(namespace.labels))
        return super().batch_put(items, options) if options else super().batch_put(items)


@pytest.mark.parametrize("salt", ["", "tenant-1"])
def test_chunks_and_tails_carry_the_salts_chain_root(engine: TorchEngine, salt: str) -> None:
    store = Tagged()
    engine.attach_store(store)
    toks = [(7 * i + 3) % 400 + 5 for i in range(2 * CS + 5)]
    out = asyncio.run(
        engine.prefill("p", toks, Sampling(max_tokens=1, temperature=0.0), cache_salt=salt)
    )
    fp = engine.fingerprint
    written = {*out.kv.chunk_keys, out.kv.tail_key}
    assert len(written) == 3 and set(store.tags) == written
    root = hashing.chain_root(fp, salt).hex()
    assert (root == fp.digest().hex()) == (not salt)  # a salt's chain has a root of its own
    for key in written:
        assert store.tags[key] == (root, fp.digest().hex(), fp.to_labels())


class TenantTagged(MemoryBackend):
    """The in-memory store, keeping each put's key -> the tenant of its root."""

    carries_chunk_meta = True

    def __init__(self) -> None:
        super().__init__()
        self.tenants: dict[str, str] = {}

    def batch_put(self, items, options=None, *, meta=None, namespace=None):
        for key, _ in items:
            self.tenants[key] = namespace.tenants.get(namespace.root_of(key), "")
        return super().batch_put(items, options) if options else super().batch_put(items)


@pytest.mark.parametrize("tenant", ["", "acme"])
def test_chunks_and_tails_carry_the_requests_tenant(engine: TorchEngine, tenant: str) -> None:
    """The tenant of the task that asks (the worker sets it: pdserve.tenants.current) tags the
    chunks the engine's own thread writes (KVNamespace.tenant)."""
    from pdserve import tenants

    store = TenantTagged()
    engine.attach_store(store)
    toks = [(5 * i + 1) % 400 + 5 for i in range(2 * CS + 3)]

    async def prefill():
        tenants.current.set(tenant)
        return await engine.prefill("t", toks, Sampling(max_tokens=1), cache_salt="s")

    out = asyncio.run(prefill())
    written = {*out.kv.chunk_keys, out.kv.tail_key}
    assert store.tenants == dict.fromkeys(written, tenant)
