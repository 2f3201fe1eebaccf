"""Namespaces in the master's state (no network, an injected clock): objects tagged with
their fingerprint and chain root, listed, dropped from memory, disk and dormant replicas
(never to come back through a remount or a restart), quarantined, and evicted idle-first."""

from __future__ import annotations

import sqlite3

import pytest

from pdserve import errors
from pdserve.services.kvstore.master.namespaces import DROPPED, NamespaceTable
from pdserve.services.kvstore.master.persistence import MetadataStore
from pdserve.services.kvstore.master.state import MasterState
from pdserve.v1 import kvstore_pb2 as pb

KB = 1024
DISK = pb.STORAGE_TIER_DISK
MEMORY = pb.STORAGE_TIER_MEMORY
FP_A, FP_B = "a" * 64, "b" * 64
SALTED_A = "c" * 64  # a salt's root under FP_A
LABELS_A = {"fingerprint": FP_A, "model_id": "org/a", "model_revision": "r1"}
LABELS_B = {"fingerprint": FP_B, "model_id": "org/b", "model_revision": "r1"}


def space(root: str) -> tuple[str, str, dict[str, str]]:
    """The namespace of ``root``: FP_A's roots (itself, the salted one) or FP_B."""
    return (root, FP_B, LABELS_B) if root == FP_B else (root, FP_A, LABELS_A)


def put(s: MasterState, keys: list[str], root: str, size: int = 4 * KB) -> None:
    out = s.put_start(
        "c", [(k, size) for k in keys], spaces=[space(root)], space_of=[1] * len(keys)
    )
    assert [r.code for r in out] == [pb.KV_OK] * len(keys), out
    assert all(r.code == pb.KV_OK for r in s.put_end("c", keys))


def node(make_state, store=None, **cfg) -> MasterState:
    """Node n1 with a 64 KiB memory and a 256 KiB disk segment; no inlining."""
    s = make_state(store=store, inline_max_bytes=0, **cfg)
    s.mount("n1-seg0", "n1", 64 * KB, [], address="n1:7000")
    s.mount("n1-disk0", "n1", 256 * KB, [], address="n1:7000", tier=DISK)
    return s


def demote_all(s: MasterState, keys: list[str]) -> None:
    """Gives each of ``keys`` a disk copy, as the tier mover would."""
    for key in keys:
        obj = s.objects[key]
        seg = s.segments["n1-disk0"]
        loc = s.segments.place_in(seg, obj.size)
        assert loc is not None
        s.objects.add_replica(obj, loc)
        s.journal.mark(obj)
    s.flush()


def usage(s: MasterState) -> dict[str, tuple[int, int, dict[str, list[int]]]]:
    return {r.digest: (r.objects, r.bytes, r.roots) for r in s.invalidation.usage()}


def test_puts_are_tagged_and_listed_per_fingerprint_and_root(make_state) -> None:
    s = node(make_state)
    put(s, ["a0", "a1"], FP_A)
    put(s, ["s0"], SALTED_A)
    put(s, ["b0"], FP_B)
    s.put_start("c", [("raw", KB)])  # no namespace: unknown
    s.put_end("c", ["raw"])
    assert s.objects["a0"].ns is s.objects["a1"].ns  # interned: one record per root
    assert s.objects["a0"].ns.fp is s.objects["s0"].ns.fp
    got = usage(s)
    assert got[FP_A] == (3, 12 * KB, {FP_A: [2, 8 * KB], SALTED_A: [1, 4 * KB]})
    assert got[FP_B] == (1, 4 * KB, {FP_B: [1, 4 * KB]})
    assert got[""] == (1, KB, {"": [1, KB]})
    assert [r.digest for r in s.invalidation.usage()] == ["", FP_A, FP_B]
    assert s.invalidation.usage()[1].labels == LABELS_A


def test_bad_namespaces_are_refused(make_state) -> None:
    s = node(make_state)
    with pytest.raises(errors.InvalidArgument, match="64 lowercase hex"):
        s.put_start("c", [("k", KB)], spaces=[("XYZ", FP_A, {})], space_of=[1])
    with pytest.raises(errors.InvalidArgument, match="fingerprint must be 64"):
        s.put_start("c", [("k", KB)], spaces=[(FP_A, "a" * 63, {})], space_of=[1])
    with pytest.raises(errors.InvalidArgument, match="labels"):
        many = {f"l{i}": "v" for i in range(40)}
        s.put_start("c", [("k", KB)], spaces=[(FP_A, FP_A, many)], space_of=[1])
    with pytest.raises(errors.InvalidArgument, match="namespace indexes"):
        s.put_start("c", [("k", KB)], spaces=[space(FP_A)], space_of=[1, 1])
    (r,) = s.put_start("c", [("k", KB)], spaces=[space(FP_A)], space_of=[2])
    assert r.code == pb.KV_INVALID and "names none" in r.message
    put(s, ["a0"], SALTED_A)
    with pytest.raises(errors.InvalidArgument, match="belongs to fingerprint"):
        s.put_start("c", [("k", KB)], spaces=[(SALTED_A, FP_B, {})], space_of=[1])


def test_drop_removes_memory_and_disk_copies_and_leaves_other_fingerprints(
    make_state, events
) -> None:
    s = node(make_state)
    put(s, ["a0", "a1"], FP_A)
    put(s, ["s0"], SALTED_A)
    put(s, ["b0", "b1"], FP_B)
    demote_all(s, ["a0", "b0"])
    assert s.stats().disk_used_bytes == 8 * KB
    dry = s.drop_namespaces([FP_A], [], True)
    assert [(r.digest, r.objects, r.bytes) for r in dry.fingerprints] == [(FP_A, 3, 12 * KB)]
    assert set(s.objects) == {"a0", "a1", "s0", "b0", "b1"}  # a dry run changes nothing
    report = s.drop_namespaces([FP_A], [], False)
    assert [(r.digest, r.objects, r.bytes) for r in report.fingerprints] == [(FP_A, 3, 12 * KB)]
    assert report.fingerprints[0].roots == {FP_A: [2, 8 * KB], SALTED_A: [1, 4 * KB]}
    assert set(s.objects) == {"b0", "b1"}
    assert s.exists(["a0", "a1", "s0", "b0", "b1"]) == [False, False, False, True, True]
    assert s.stats().disk_used_bytes == 4 * KB  # b0's disk copy only
    assert s.segments["n1-seg0"].used == 8 * KB
    assert s.stats().dropped_objects == 3
    removed = {e[1] for e in events.events if e[0] == pb.KV_EVENT_REMOVED}
    assert removed == {"a0", "a1", "s0"}
    assert [r.digest for r in s.invalidation.usage()] == [FP_B]  # FP_A forgotten
    put(s, ["a0"], FP_A)  # a later put interns it again
    assert usage(s)[FP_A][0] == 1


def test_drop_by_root_leaves_the_fingerprints_other_roots(make_state) -> None:
    s = node(make_state)
    put(s, ["a0"], FP_A)
    put(s, ["s0", "s1"], SALTED_A)
    report = s.drop_namespaces([], [SALTED_A], False)
    assert [(r.digest, r.objects) for r in report.fingerprints] == [(FP_A, 2)]
    assert set(s.objects) == {"a0"}
    assert usage(s)[FP_A][2] == {FP_A: [1, 4 * KB]}


def test_drop_input_is_validated(make_state) -> None:
    s = node(make_state)
    with pytest.raises(errors.InvalidArgument, match="at least one"):
        s.drop_namespaces([], [], False)
    with pytest.raises(errors.InvalidArgument, match=r"fingerprints\[0\] must be 64"):
        s.drop_namespaces(["nothex"], [], False)
    with pytest.raises(errors.InvalidArgument, match=r"roots\[0\] must be 64"):
        s.drop_namespaces([], ["A" * 64], False)
    assert s.drop_namespaces([FP_A], [], False).fingerprints == []  # unknown: nothing


def test_a_leased_object_is_hidden_at_once_and_freed_when_its_lease_ends(make_state, clock) -> None:
    s = node(make_state)
    put(s, ["a0", "a1"], FP_A)
    (g,) = s.get_replicas("reader", ["a0"], lease_ms=2000)
    assert g.code == pb.KV_OK
    report = s.drop_namespaces([FP_A], [], False)
    assert report.deferred == 1
    assert "a0" in s.objects and s.objects["a0"].ns is DROPPED and "a1" not in s.objects
    assert s.exists(["a0"]) == [False] and s.longest_prefix(["a0"]) == 0
    assert s.get_replicas("other", ["a0"])[0].code == pb.KV_NOT_FOUND
    assert s.visible_keys() == []
    s.tick()
    assert "a0" in s.objects  # still leased
    clock.advance(2.1)
    s.tick()
    assert "a0" not in s.objects and s.segments["n1-seg0"].used == 0
    assert not s.namespaces.hidden  # the fast path again


def test_a_dropped_object_does_not_come_back_after_a_restart_or_a_remount(
    make_state, tmp_path
) -> None:
    store = MetadataStore(tmp_path)
    s = node(make_state, store=store)
    put(s, ["a0", "a1"], FP_A)
    put(s, ["b0"], FP_B)
    demote_all(s, ["a0", "b0"])
    s.drop_namespaces([FP_A], [], False)
    s.set_quarantine(FP_B, True, "diverged", "router")
    store.close()
    # a master restart: the rows come back dormant and revive on the remount
    store = MetadataStore(tmp_path)
    s2 = make_state(store=store, inline_max_bytes=0)
    assert s2.mount("n1-seg0", "n1", 64 * KB, [], address="n1:7000") == 1  # b0
    assert s2.mount("n1-disk0", "n1", 256 * KB, [], address="n1:7000", tier=DISK) == 1
    assert set(s2.objects) == {"b0"}
    assert s2.objects["b0"].ns is not None and s2.objects["b0"].ns.fp.digest == FP_B
    fp_b = s2.namespaces.fingerprint(FP_B)
    assert fp_b is not None and fp_b.quarantine is not None
    assert fp_b.quarantine.reason == "diverged" and fp_b.quarantine.by == "router"
    assert s2.exists(["b0"]) == [False]  # still quarantined
    assert s2.namespaces.fingerprint(FP_A) is None
    store.close()


def test_a_drop_reaches_dormant_objects(make_state, clock, tmp_path) -> None:
    store = MetadataStore(tmp_path)
    s = node(make_state, store=store)
    put(s, ["a0"], FP_A)
    put(s, ["b0"], FP_B)
    demote_all(s, ["a0"])
    for _ in range(30):  # no heartbeats for 3 s: n1 is dead, its replicas dormant
        clock.advance(0.1)
        s.tick()
    assert not s.objects and len(s.dormant) == 2
    report = s.drop_namespaces([FP_A], [], False)
    assert [(r.digest, r.objects) for r in report.fingerprints] == [(FP_A, 1)]
    assert len(s.dormant) == 1
    # the node comes back with its bytes: only b0 revives
    s.mount("n1-seg0", "n1", 64 * KB, [], address="n1:7000")
    s.mount("n1-disk0", "n1", 256 * KB, [], address="n1:7000", tier=DISK)
    assert set(s.objects) == {"b0"}
    assert {o.key for o in store.load()} == {"b0"}
    store.close()


def test_quarantine_hides_reads_refuses_puts_and_clearing_restores(make_state) -> None:
    s = node(make_state)
    put(s, ["a0", "a1"], FP_A)
    put(s, ["b0"], FP_B)
    assert s.set_quarantine(FP_A, True, "diverged", "router") == (False, 2)
    assert s.longest_prefix(["a0", "a1"]) == 0
    assert s.exists(["a0", "b0"]) == [False, True]
    assert s.get_replicas("c", ["a0"])[0].code == pb.KV_NOT_FOUND
    assert s.prefix_replicas("c", ["a0"]) == []
    (r,) = s.put_start("c", [("a2", KB)], spaces=[space(FP_A)], space_of=[1])
    assert r.code == pb.KV_QUARANTINED
    stats = s.stats()
    assert stats.quarantined_fingerprints == 1 and stats.quarantined_misses >= 4
    assert s.set_quarantine(FP_A, True, "again", "router") == (True, 2)
    assert s.namespaces.fingerprint(FP_A).quarantine.reason == "diverged"  # the first stands
    assert s.set_quarantine(FP_A, False, "", "admin") == (True, 2)
    assert s.longest_prefix(["a0", "a1"]) == 2 and not s.namespaces.hidden
    assert s.stats().quarantined_fingerprints == 0


def test_a_fingerprint_with_no_object_may_be_quarantined(make_state) -> None:
    s = node(make_state)
    assert s.set_quarantine(FP_B, True, "seen diverging", "router") == (False, 0)
    (r,) = s.put_start("c", [("b0", KB)], spaces=[space(FP_B)], space_of=[1])
    assert r.code == pb.KV_QUARANTINED
    assert [u.digest for u in s.invalidation.usage()] == [FP_B]
    assert s.set_quarantine(FP_B, False, "", "admin") == (True, 0)
    (u,) = s.invalidation.usage()  # the refused put named its root: listed, empty
    assert (u.digest, u.objects, u.quarantine) == (FP_B, 0, None)


def test_quarantine_input_is_validated(make_state) -> None:
    s = node(make_state)
    with pytest.raises(errors.InvalidArgument, match="64 lowercase hex"):
        s.set_quarantine("xyz", True, "why", "router")
    with pytest.raises(errors.InvalidArgument, match="needs a reason"):
        s.set_quarantine(FP_A, True, " ", "router")
    with pytest.raises(errors.InvalidArgument, match="longer than"):
        s.set_quarantine(FP_A, True, "x" * 2000, "router")


def test_an_unknown_objects_next_put_names_its_namespace(make_state) -> None:
    s = node(make_state)
    s.put_start("c", [("k", KB)])
    s.put_end("c", ["k"])
    assert s.objects["k"].ns is None
    (r,) = s.put_start("c", [("k", KB)], spaces=[space(FP_A)], space_of=[1])
    assert r.already_exists and s.objects["k"].ns.root == FP_A


def test_eviction_takes_idle_fingerprints_first(make_state, clock) -> None:
    s = make_state(inline_max_bytes=0, idle_fingerprint_s=60, high_watermark=1.0)
    s.mount("n1-seg0", "n1", 64 * KB, [], address="n1:7000")
    put(s, ["b0", "b1"], FP_B)  # least recently used, but its fingerprint is busy
    clock.advance(30)
    put(s, ["a0", "a1"], FP_A)
    clock.advance(40)  # FP_A's last use 40 s ago, FP_B's 70 s: FP_B is idle
    put(s, ["a2", "a3"], FP_A)
    assert [o.key for o in s.evictor.candidates(clock.mono())][:2] == ["b1", "b0"]
    s.longest_prefix(["b0"])  # a hit: FP_B is served again
    order = [o.key for o in s.evictor.candidates(clock.mono())]
    assert order == ["b1", "a1", "a0", "a3", "a2", "b0"]  # plain LRU (chains deepest first)
    clock.advance(61)  # both idle: LRU among them
    put(s, ["x0"], SALTED_A)  # FP_A's salted root: FP_A is served again
    order = [o.key for o in s.evictor.candidates(clock.mono())]
    assert order[:2] == ["b1", "b0"]


def test_namespace_table_forgets_dropped_roots_and_keeps_quarantines() -> None:
    t = NamespaceTable(idle_s=10)
    (a, salted) = t.intern_all([space(FP_A), space(SALTED_A)], now=0)
    assert a.fp is salted.fp and len(t) == 1
    t.set_quarantine(FP_A, None, 0)
    changes = t.take_changes()
    assert set(changes.namespaces) == {FP_A, SALTED_A} and changes.quarantines == {FP_A: None}
    t.forget([a, salted])
    assert t.get(FP_A) is None and len(t) == 0
    assert t.take_changes().dropped == {FP_A, SALTED_A}
    assert t.idle(100) == set()


def test_a_version_2_state_file_is_migrated(tmp_path) -> None:
    db = sqlite3.connect(tmp_path / "kvstore-master.sqlite3")
    db.execute("CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
    db.execute("INSERT INTO meta VALUES ('schema', '2')")
    db.execute(
        "CREATE TABLE objects (key TEXT PRIMARY KEY, size INTEGER NOT NULL, soft_pin INTEGER "
        "NOT NULL, ttl_deadline_ms INTEGER NOT NULL, replicas TEXT NOT NULL, checksum BLOB NOT "
        "NULL DEFAULT x'')"
    )
    db.execute("INSERT INTO objects VALUES ('k', 10, 0, 0, '[[\"s\", \"n\", 0]]', x'01')")
    db.commit()
    db.close()
    store = MetadataStore(tmp_path)
    (obj,) = store.load()
    assert (obj.key, obj.size, obj.checksum, obj.root) == ("k", 10, b"\x01", "")
    assert store.load_namespaces() == ([], [])
    schema = store._db.execute("SELECT value FROM meta WHERE name='schema'").fetchone()[0]
    assert schema == "4"
    store.close()


def test_a_node_that_re_reports_a_dropped_object_does_not_bring_it_back(make_state) -> None:
    s = node(make_state)
    put(s, ["a0"], FP_A)
    put(s, ["b0"], FP_B)
    offsets = {k: s.objects[k].replicas[0].offset for k in ("a0", "b0")}
    s.drop_namespaces([FP_A], [], False)
    s.unmount("n1-seg0")  # b0 goes with it; then the node remounts, reporting what it holds
    held = [(k, offsets[k], 4 * KB) for k in ("a0", "b0")]
    assert s.mount("n1-seg0", "n1", 64 * KB, [], held, address="n1:7000") == 1
    assert set(s.objects) == {"b0"} and s.objects["b0"].ns is None  # b0: unknown namespace
    # a new put of the dropped key is welcome, and so is a later re-report of it
    put(s, ["a0"], FP_A)
    assert "a0" not in s.namespaces.tombstones
