"""Dormant replicas on their own: kept per segment, taken out on remount, due after grace."""

from __future__ import annotations

from pdserve.services.kvstore.master.dormant import DormantReplicas
from pdserve.services.kvstore.master.persistence import StoredObject, StoredReplica


def _stored(key: str, *segments: str) -> StoredObject:
    reps = tuple(StoredReplica(s, f"node-of-{s}", 64 * i) for i, s in enumerate(segments))
    return StoredObject(key, 100, False, 0, reps)


def test_forget_returns_the_segments_replicas_and_the_keys_left_with_none() -> None:
    d = DormantReplicas()
    d.add(_stored("a", "s1", "s2"), deadline=10.0)
    d.add(_stored("b", "s1"), deadline=10.0)
    assert len(d) == 2 and d.segments == 2
    back, gone = d.forget("s1")
    assert sorted(stored.key for stored, _rep in back) == ["a", "b"]
    assert gone == ["b"] and "a" in d and "b" not in d
    assert d.forget("s1") == ([], [])


def test_a_segment_keeps_its_first_deadline() -> None:
    d = DormantReplicas()
    d.add(_stored("a", "s1"), deadline=10.0)
    d.add(_stored("b", "s1"), deadline=20.0)
    d.hold_until("s1", 30.0)
    assert d.due(9.0) == [] and d.due(10.0) == ["s1"]


def test_a_second_add_merges_the_replicas() -> None:
    d = DormantReplicas()
    d.add(_stored("a", "s1"), deadline=10.0)
    d.add(_stored("a", "s2"), deadline=10.0)
    back, gone = d.forget("s2")
    assert len(back) == 1 and gone == [] and "a" in d
