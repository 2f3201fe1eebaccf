"""Tenant shares of the pool in the master's state (no network, an injected clock): shares
parsed and refused with the field named, each object's tenant recorded and persisted, and
eviction taking over-share tenants' objects first (the most over first), never a within-share
tenant's while an over-share one has something to evict."""

from __future__ import annotations

import re
import sqlite3

import pytest

from pdserve import errors
from pdserve.config import ConfigError
from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.services.kvstore.master.persistence import MetadataStore
from pdserve.services.kvstore.master.quotas import NORMAL, OVER_SHARE
from pdserve.services.kvstore.master.shares import Share, Shares
from pdserve.services.kvstore.master.state import MasterState
from pdserve.v1 import kvstore_pb2 as pb

KB = 1024
MEMORY, DISK = pb.STORAGE_TIER_MEMORY, pb.STORAGE_TIER_DISK
FP = "f" * 64
ROOTS = {"a": "a" * 64, "b": "b" * 64, "c": "c" * 64, "": FP}


def put(s: MasterState, tenant: str, keys: list[str], size: int = 4 * KB) -> None:
    """Puts ``keys`` under ``tenant``'s root, tagged with it."""
    spec = (ROOTS[tenant], FP, {}, tenant)
    out = s.put_start("c", [(k, size) for k in keys], spaces=[spec], space_of=[1] * len(keys))
    assert [r.code for r in out] == [pb.KV_OK] * len(keys), out
    assert all(r.code == pb.KV_OK for r in s.put_end("c", keys))


def pool(make_state, shares: dict, **cfg) -> MasterState:
    """One node with a 64 KiB memory segment; no inlining; by default no watermark eviction
    (only on demand)."""
    cfg = {"high_watermark": 1.0, "low_watermark": 1.0, **cfg}
    s = make_state(inline_max_bytes=0, tenant_shares=shares, **cfg)
    s.mount("n1-seg0", "n1", 64 * KB, [], address="n1:7000")
    return s


def each(s: MasterState, tenant: str, keys: list[str]) -> None:
    """Puts ``keys`` one by one (so the least recently used is the first)."""
    for k in keys:
        put(s, tenant, [k])


def evicted(events) -> list[str]:
    return [k for t, k, _, r, *_ in events.events if r == pb.KV_EVENT_REASON_EVICT]


# ---------------------------------------------------------------------- parsing


def test_shares_parse_fractions_sizes_and_tiers() -> None:
    shares = Shares.parse(
        {"a": 0.25, "b": "512MiB", "c": {"memory": "0.5", "disk": 4096}, "d": 1}, default="0.1"
    )
    assert shares.of("a", MEMORY) == shares.of("a", DISK) == Share(fraction=0.25)
    assert shares.of("b", DISK) == Share(bytes=512 << 20)
    assert shares.of("c", MEMORY) == Share(fraction=0.5) and shares.of("c", DISK).bytes == 4096
    assert shares.of("d", MEMORY).whole and shares.of("nobody", MEMORY) == Share(fraction=0.1)
    assert shares.limited and not Shares.parse({"d": 1}).limited
    assert shares.of("a", MEMORY).of(1000) == 250 and shares.of("b", MEMORY).of(10) == 512 << 20
    only_memory = Shares.parse({"x": {"memory": 0.5}})
    assert only_memory.of("x", DISK).whole


@pytest.mark.parametrize(
    ("shares", "default", "problem"),
    [
        ({"a": 0}, 1, "tenant_shares['a']: expected a fraction in (0, 1] or a size"),
        ({"a": -3}, 1, "expected a fraction in (0, 1] or a size"),
        ({"a": 2.5}, 1, "above 1, so bytes: it must be a whole number"),
        ({"a": "lots"}, 1, "tenant_shares['a']: invalid size 'lots'"),
        ({"a": True}, 1, "expected a fraction or a size, got True"),
        ({"a": {"ram": 0.5}}, 1, "unknown tier 'ram'; the tiers are memory, disk"),
        ({"bad name!": 0.5}, 1, "tenant 'bad name!' must be 1-64 characters"),
        ({"": 0.5}, 1, "a tenant name is empty"),
        ({}, "0", "default_tenant_share: expected a fraction in (0, 1]"),
    ],
)
def test_bad_shares_are_refused_naming_the_field(shares, default, problem) -> None:
    cfg = MasterConfig(tenant_shares=shares, default_tenant_share=default)
    with pytest.raises(ConfigError, match=re.escape(problem)):
        cfg.validate()


def test_a_shares_file_is_read_and_the_config_mapping_wins(tmp_path) -> None:
    path = tmp_path / "shares.yaml"
    path.write_text("a: 0.25\nb: 1GiB\n")
    shares = Shares.configured({"a": 0.5}, str(path), "1")
    assert shares.of("a", MEMORY).fraction == 0.5 and shares.of("b", MEMORY).bytes == 1 << 30
    path.write_text("a: 7.5\n")
    with pytest.raises(ConfigError, match=f"tenant_shares_file '{path}'"):
        Shares.configured({}, str(path), "1")
    with pytest.raises(ConfigError, match="tenant_shares_file '/nonexistent/x'"):
        Shares.configured({}, "/nonexistent/x", "1")


# ---------------------------------------------------------------------- tenant tags


def test_each_namespace_records_its_tenant_and_refuses_another(make_state) -> None:
    s = pool(make_state, {})
    put(s, "a", ["a0"])
    put(s, "", ["n0"])
    assert s.namespaces.get(ROOTS["a"]).tenant == "a" and s.namespaces.get(FP).tenant == ""
    with pytest.raises(errors.InvalidArgument, match="belongs to tenant 'a', not 'b'"):
        s.put_start("c", [("x", KB)], spaces=[(ROOTS["a"], FP, {}, "b")], space_of=[1])
    with pytest.raises(errors.InvalidArgument, match=r"namespaces\[0\].tenant 'no way'"):
        s.put_start("c", [("x", KB)], spaces=[(ROOTS["c"], FP, {}, "no way")], space_of=[1])
    # a put naming no tenant leaves the root's tenant as it is
    s.put_start("c", [("a1", KB)], spaces=[(ROOTS["a"], FP, {})], space_of=[1])
    assert s.namespaces.get(ROOTS["a"]).tenant == "a"


def test_tenants_survive_a_restart_and_a_version_3_file_migrates(make_state, tmp_path) -> None:
    store = MetadataStore(tmp_path)
    s = pool(make_state, {}, store=store)
    put(s, "a", ["a0"])
    store.close()
    store = MetadataStore(tmp_path)
    assert [(n.root, n.tenant) for n in store.load_namespaces()[0]] == [(ROOTS["a"], "a")]
    restarted = make_state(store=store)
    assert restarted.namespaces.get(ROOTS["a"]).tenant == "a"
    store.close()

    old = tmp_path / "v3"
    old.mkdir()
    db = sqlite3.connect(old / "kvstore-master.sqlite3")
    db.execute("CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
    db.execute("INSERT INTO meta VALUES ('schema', '3')")
    db.execute(
        "CREATE TABLE namespaces (root TEXT PRIMARY KEY, fingerprint TEXT NOT NULL,"
        " labels TEXT NOT NULL)"
    )
    db.execute("INSERT INTO namespaces VALUES (?, ?, '{}')", (ROOTS["b"], FP))
    db.commit()
    db.close()
    migrated = MetadataStore(old)
    (row,) = migrated.load_namespaces()[0]
    assert (row.root, row.fingerprint, row.tenant) == (ROOTS["b"], FP, "")
    schema = migrated._db.execute("SELECT value FROM meta WHERE name='schema'").fetchone()[0]
    assert schema == "4"
    migrated.close()


# ---------------------------------------------------------------------- eviction order


def test_a_flooding_tenant_loses_its_own_objects_not_a_within_share_tenants(make_state) -> None:
    s = pool(make_state, {"a": 0.25, "b": 0.5})
    b_keys = [f"b{i}" for i in range(4)]  # 16 KiB: within b's 32 KiB
    put(s, "b", b_keys)
    a_keys = [f"a{i}" for i in range(48)]  # 4x a's 16 KiB share, through a 64 KiB pool
    for k in a_keys:
        put(s, "a", [k])
    assert all(k in s.objects for k in b_keys)
    assert sum(k in s.objects for k in a_keys) == 12  # what b leaves of the pool
    report = {t.tenant: t for t in s.quotas.report()}
    assert report["a"].evictions_over_share == 36 and report["a"].evictions_normal == 0
    assert report["b"].evictions_over_share == report["b"].evictions_normal == 0
    assert report["b"].memory_bytes == 16 * KB and report["a"].memory_bytes == 48 * KB
    assert report["a"].memory_share_bytes == 16 * KB


def test_the_most_over_tenant_goes_first_then_by_turns(make_state, events) -> None:
    # a: 6553 bytes of share, b: 8192; the pool evicts from 64 KiB down to 32 KiB
    s = pool(make_state, {"a": 0.1, "b": 0.125}, high_watermark=0.99, low_watermark=0.5)
    each(s, "b", [f"b{i}" for i in range(4)])  # 16 KiB: 8 KiB over
    each(s, "a", [f"a{i}" for i in range(8)])  # 32 KiB: about 26 KiB over
    each(s, "c", [f"c{i}" for i in range(4)])  # 16 KiB: within c's whole pool; fills it
    # a alone until it is less over than b, then whichever is more over, one copy at a time
    assert evicted(events) == ["a0", "a1", "a2", "a3", "a4", "b0", "a5", "b1"]
    assert s.quotas.evictions == {("a", OVER_SHARE): 6, ("b", OVER_SHARE): 2}
    assert all(f"c{i}" in s.objects for i in range(4))


def test_once_no_tenant_is_over_eviction_takes_the_ordinary_order(make_state, events) -> None:
    s = pool(make_state, {"a": 0.125}, high_watermark=0.99, low_watermark=0.5)
    each(s, "b", [f"b{i}" for i in range(6)])  # 24 KiB, b's whole pool
    each(s, "a", [f"a{i}" for i in range(4)])  # 16 KiB: 8 KiB over a's share
    each(s, "c", [f"c{i}" for i in range(6)])  # 24 KiB: full
    # a's two over-share copies first, then least recently used first: b's
    assert evicted(events) == ["a0", "a1", "b0", "b1", "b2", "b3", "b4", "b5"]
    assert s.quotas.evictions == {("a", OVER_SHARE): 2, ("b", NORMAL): 6}


def test_without_shares_the_order_is_the_evictors_and_every_eviction_normal(
    make_state, events
) -> None:
    s = pool(make_state, {})
    each(s, "a", ["a0", "a1"])
    each(s, "b", ["b0"])
    order = [o.key for o in s.evictor.candidates(s.clock.mono())]
    assert order == [o.key for o in s.objects.lru()] == ["a0", "a1", "b0"]
    each(s, "a", [f"x{i}" for i in range(16)])  # 19 objects of 4 KiB through 64 KiB
    assert evicted(events) == ["a0", "a1", "b0"]
    assert s.quotas.evictions == {("a", NORMAL): 2, ("b", NORMAL): 1}
