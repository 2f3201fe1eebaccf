"""Placement strategies order segments; the master takes one per node."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.services.kvstore.master.placement import FreeRatioFirst, RandomPlacement


@dataclass
class Seg:
    segment_id: str
    node_id: str
    capacity: int
    free: int


def test_free_ratio_first_orders_by_free_fraction() -> None:
    segs = [Seg("a", "n1", 100, 10), Seg("b", "n2", 1000, 900), Seg("c", "n3", 10, 5)]
    assert [s.segment_id for s in FreeRatioFirst().order(segs, 1)] == ["b", "c", "a"]


def test_random_is_a_seeded_permutation() -> None:
    segs = [Seg(str(i), f"n{i}", 100, 50) for i in range(20)]
    one = [s.segment_id for s in RandomPlacement(7).order(segs, 1)]
    two = [s.segment_id for s in RandomPlacement(7).order(segs, 1)]
    other = [s.segment_id for s in RandomPlacement(8).order(segs, 1)]
    assert one == two
    assert sorted(one) == sorted(s.segment_id for s in segs)
    assert one != other
    assert [s.segment_id for s in segs] == [str(i) for i in range(20)]  # input untouched
