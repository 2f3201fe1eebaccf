"""OffsetAllocator: alignment, first fit, coalescing, reservations; property tests."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.services.kvstore.master.allocator import ALIGNMENT, AllocatorError, OffsetAllocator


def check_invariants(a: OffsetAllocator) -> None:
    free = a.free_ranges()
    used = a.allocated_ranges()
    spans = sorted(free + used)
    # Free and used ranges tile [0, capacity) exactly: no overlap, no hole.
    pos = 0
    for off, length in spans:
        assert off == pos, f"gap or overlap at {pos}: {spans}"
        assert length > 0 and off % ALIGNMENT == 0
        pos = off + length
    assert pos == a.capacity
    # Free neighbours are always merged.
    for (o1, l1), (o2, _) in itertools.pairwise(free):
        assert o1 + l1 < o2
    assert a.used == sum(n for _, n in used)


def test_alignment_and_capacity() -> None:
    a = OffsetAllocator(1000)
    assert a.capacity == 960
    offs = [a.allocate(1), a.allocate(65), a.allocate(64)]
    assert offs == [0, 64, 192]
    assert a.used == 64 + 128 + 64
    check_invariants(a)


def test_full_then_none() -> None:
    a = OffsetAllocator(256)
    assert a.allocate(256) == 0
    assert a.allocate(1) is None
    a.release(0)
    assert a.free_ranges() == [(0, 256)]


def test_release_coalesces_both_sides() -> None:
    a = OffsetAllocator(64 * 10)
    x, y, z = a.allocate(64), a.allocate(64), a.allocate(64)
    a.release(x)
    a.release(z)
    assert a.free_ranges() == [(0, 64), (128, 64 * 8)]
    a.release(y)
    assert a.free_ranges() == [(0, 640)]


def test_first_fit_reuses_hole() -> None:
    a = OffsetAllocator(64 * 10)
    x = a.allocate(128)
    a.allocate(64)
    a.release(x)
    assert a.allocate(64) == 0


def test_release_unknown_and_bad_sizes() -> None:
    a = OffsetAllocator(1024)
    with pytest.raises(AllocatorError, match="no allocated range"):
        a.release(64)
    with pytest.raises(AllocatorError):
        a.allocate(0)
    with pytest.raises(AllocatorError):
        OffsetAllocator(0)


def test_reserve_validates() -> None:
    a = OffsetAllocator(1024)
    a.reserve(128, 100)
    assert a.allocated_ranges() == [(128, 128)]
    with pytest.raises(AllocatorError, match="overlaps"):
        a.reserve(192, 64)
    with pytest.raises(AllocatorError, match="overlaps"):
        a.reserve(64, 128)
    with pytest.raises(AllocatorError, match="aligned"):
        a.reserve(3, 10)
    with pytest.raises(AllocatorError, match="does not fit"):
        a.reserve(960, 128)
    a.reserve(0, 64)
    a.reserve(256, 768)
    assert a.free == 64 * 1
    check_invariants(a)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 5000)),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("reserve"), st.integers(0, 200), st.integers(1, 500)),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(size=st.integers(64, 50_000), ops=ops)
def test_property_never_overlaps_and_coalesces(size: int, ops: list) -> None:
    a = OffsetAllocator(size)
    live: dict[int, int] = {}
    for op in ops:
        if op[0] == "alloc":
            off = a.allocate(op[1])
            if off is not None:
                assert off % ALIGNMENT == 0 and off + op[1] <= a.capacity
                live[off] = op[1]
        elif op[0] == "free" and live:
            off = sorted(live)[op[1] % len(live)]
            a.release(off)
            del live[off]
        elif op[0] == "reserve":
            off = op[1] * ALIGNMENT
            try:
                a.reserve(off, op[2])
            except AllocatorError:
                pass
            else:
                live[off] = op[2]
        check_invariants(a)
        # The user's view: requested ranges never overlap.
        spans = sorted(live.items())
        for (o1, n1), (o2, _) in itertools.pairwise(spans):
            assert o1 + n1 <= o2
    for off in list(live):
        a.release(off)
    # Everything freed: one single free range again.
    assert a.free_ranges() == ([(0, a.capacity)] if a.capacity else [])
    assert a.used == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 63), st.integers(1, 300)), max_size=40))
def test_reserve_many_matches_reserving_one_by_one(ranges) -> None:
    """One pass over the free list leaves the allocator as sequential reserves (in offset
    order) do, and refuses the same ranges."""
    ranges = [(slot * ALIGNMENT, size) for slot, size in ranges]
    batch, single = OffsetAllocator(64 * ALIGNMENT), OffsetAllocator(64 * ALIGNMENT)
    batch.allocate(100)
    single.allocate(100)
    problems = batch.reserve_many(ranges)
    expected = [""] * len(ranges)
    for i in sorted(range(len(ranges)), key=lambda i: ranges[i][0]):
        try:
            single.reserve(*ranges[i])
        except AllocatorError:
            expected[i] = "refused"
    assert [bool(p) for p in problems] == [bool(e) for e in expected]
    assert batch.free_ranges() == single.free_ranges()
    assert batch.allocated_ranges() == single.allocated_ranges()
