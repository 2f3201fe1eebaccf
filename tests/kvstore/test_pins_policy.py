"""Tenants' pins in the master's state (no network, an injected clock): pinned objects are
never evicted, not even by their own tenant's flood; a pin past the tenant's memory share is
refused naming the share and the size; keys not stored yet are pinned when their put commits
(while the share holds them); another tenant's chunk cannot be pinned; unpinned objects are
evictable again; pins are journaled and survive a restart."""

from __future__ import annotations

import pytest

from pdserve import errors
from pdserve.services.kvstore.master.pins import MAX_PINS_PER_TENANT
from pdserve.services.kvstore.master.state import MasterState
from pdserve.v1 import kvstore_pb2 as pb

KB = 1024
FP = "f" * 64
ROOTS = {"a": "a" * 64, "b": "b" * 64}


def key(tenant: str, i: int) -> str:
    """A chunk key of ``tenant`` (64 hex characters)."""
    return f"{ord(tenant):02x}{i:062x}"


def put(s: MasterState, tenant: str, keys: list[str], size: int = 4 * KB) -> None:
    for k in keys:  # one by one: the first is the least recently used
        spec = (ROOTS[tenant], FP, {}, tenant)
        (out,) = s.put_start("c", [(k, size)], spaces=[spec], space_of=[1])
        assert out.code == pb.KV_OK, out
        assert s.put_end("c", [k])[0].code == pb.KV_OK


@pytest.fixture
def pool(make_state) -> MasterState:
    """64 KiB of memory; a's share is a quarter (16 KiB), b's half; eviction on demand."""
    s = make_state(
        inline_max_bytes=0,
        tenant_shares={"a": 0.25, "b": 0.5},
        high_watermark=1.0,
        low_watermark=1.0,
    )
    s.mount("n1-seg0", "n1", 64 * KB, [], address="n1:7000")
    return s


def pin(s: MasterState, tenant: str, name: str, keys: list[str]):
    return s.quotas.pin(tenant, name, keys, 0)


def test_a_pinned_prefix_survives_its_own_tenants_flood(pool) -> None:
    system = [key("a", i) for i in range(3)]  # 12 KiB of a's 16 KiB share
    put(pool, "a", system)
    report, total, share = pin(pool, "a", "system", system)
    assert (report.keys, report.present, report.bytes) == (3, 3, 12 * KB)
    assert (total, share) == (12 * KB, 16 * KB)
    flood = [key("a", 100 + i) for i in range(64)]  # 4x the pool
    put(pool, "a", flood)
    assert all(k in pool.objects for k in system)
    assert sum(k in pool.objects for k in flood) == 13  # the rest of the pool
    assert pool.quotas.report("a")[0].pinned_bytes == 12 * KB
    assert pool.pins.unpin("a", "system")
    put(pool, "a", [key("a", 200 + i) for i in range(16)])
    assert not any(k in pool.objects for k in system)  # evictable again: the least recent


def test_a_pin_past_the_share_is_refused_naming_share_and_size(pool) -> None:
    keys = [key("a", i) for i in range(5)]  # 20 KiB: past a's 16 KiB
    put(pool, "a", keys)
    with pytest.raises(errors.ResourceExhausted) as exc:
        pin(pool, "a", "big", keys)
    message = str(exc.value)
    assert "tenant 'a' would pin 20480 bytes" in message
    assert "its memory share is 16384 bytes" in message
    assert len(pool.pins) == 0
    # two pins of one tenant count each object once, and a replaced pin not at all
    pin(pool, "a", "p1", keys[:3])
    pin(pool, "a", "p2", keys[1:4])
    assert pool.pins.pinned_bytes("a") == 16 * KB
    with pytest.raises(errors.ResourceExhausted):
        pin(pool, "a", "p3", keys[4:])
    pin(pool, "a", "p2", keys[1:2])  # replaces p2: 12 KiB pinned now
    assert pool.pins.pinned_bytes("a") == 12 * KB


def test_keys_not_stored_yet_are_pinned_when_put_while_the_share_holds(pool) -> None:
    keys = [key("a", i) for i in range(6)]
    report, total, _ = pin(pool, "a", "later", keys)
    assert (report.present, total) == (0, 0)
    put(pool, "a", keys)  # 24 KiB: the first four fit a's 16 KiB share, then they leave the pin
    (now,) = pool.pins.report("a")
    assert (now.keys, now.present, now.bytes) == (4, 4, 16 * KB)
    assert all(pool.pins.holds(pool.objects[k]) for k in keys[:4])
    assert not pool.pins.holds(pool.objects[keys[4]])


def test_another_tenants_chunk_is_refused_and_bad_requests_name_the_field(pool) -> None:
    put(pool, "b", [key("b", 0)])
    with pytest.raises(errors.InvalidArgument, match=r"keys\[1\] is a chunk of tenant 'b'"):
        pin(pool, "a", "steal", [key("a", 0), key("b", 0)])
    with pytest.raises(errors.InvalidArgument, match=r"keys\[0\] 'nothex' is not a chunk key"):
        pin(pool, "a", "x", ["nothex"])
    with pytest.raises(errors.InvalidArgument, match="keys is empty"):
        pin(pool, "a", "x", [])
    with pytest.raises(errors.InvalidArgument, match="pin name '' must be 1-128"):
        pin(pool, "a", "", [key("a", 0)])
    with pytest.raises(errors.InvalidArgument, match="tenant 'a b' must be 1-64"):
        pin(pool, "a b", "x", [key("a", 0)])
    for i in range(MAX_PINS_PER_TENANT):
        pin(pool, "a", f"p{i}", [key("a", i)])
    with pytest.raises(errors.ResourceExhausted, match="the most it may hold"):
        pin(pool, "a", "one-more", [key("a", 999)])
    assert not pool.pins.unpin("a", "never")


def test_the_tenant_report_counts_pins_usage_and_evictions(pool) -> None:
    put(pool, "a", [key("a", i) for i in range(2)])
    pin(pool, "a", "sys", [key("a", 0)])
    (a,) = pool.quotas.report("a")
    assert (a.memory_bytes, a.disk_bytes, a.pinned_bytes) == (8 * KB, 0, 4 * KB)
    assert (a.memory_share_bytes, a.evictions_over_share, a.evictions_normal) == (16 * KB, 0, 0)
    assert [t.tenant for t in pool.quotas.report()] == ["", "a", "b"]
    with pytest.raises(errors.InvalidArgument, match=r"tenant '\.\./etc' must be 1-64"):
        pool.quotas.report("../etc")


def test_pins_survive_a_restart_and_an_unpin_sticks(make_state, tmp_path) -> None:
    from pdserve.services.kvstore.master.persistence import MetadataStore

    store = MetadataStore(tmp_path)
    s = make_state(store=store, inline_max_bytes=0, tenant_shares={"a": 0.5})
    s.mount("n1-seg0", "n1", 64 * KB, [], address="n1:7000")
    keys = [key("a", i) for i in range(3)]
    put(s, "a", keys[:2])
    s.quotas.pin("a", "system", keys, 7)
    s.flush()
    s.quotas.pin("a", "other", keys[:1], 8)
    s.pins.unpin("a", "other")
    s.flush()
    store.close()

    store = MetadataStore(tmp_path)
    again = make_state(store=store, inline_max_bytes=0, tenant_shares={"a": 0.5})
    assert [(p.name, p.keys, p.created_ms) for p in again.pins.report()] == [("system", 3, 7)]
    # the node remounts with its bytes: the pinned objects come back, held by the pin
    again.mount("n1-seg0", "n1", 64 * KB, [], address="n1:7000")
    assert all(again.pins.holds(again.objects[k]) for k in keys[:2])
    store.close()
