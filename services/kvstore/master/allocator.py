"""Offset allocator for one segment: a first-fit free list with coalescing.

The master hands out byte ranges inside a node's segment; it never touches the bytes. Every
range starts on an :data:`ALIGNMENT`-byte boundary and its length is the requested size
rounded up to that alignment, so the usable capacity is the segment size rounded down.

Invariants (checked by the property tests): allocated ranges never overlap, free ranges never
overlap or touch (neighbours are merged on free), and ``used + free == capacity``.
"""

from __future__ import annotations

import bisect

#: Offsets and lengths are multiples of this (bytes).
ALIGNMENT = 64


def align_up(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class AllocatorError(ValueError):
    """A free of an unknown range, or a reservation that does not fit or overlaps."""


class OffsetAllocator:
    """Allocates aligned byte ranges inside ``[0, capacity)``."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise AllocatorError(f"segment size must be > 0, got {size}")
        self.capacity = size // ALIGNMENT * ALIGNMENT
        # Free ranges sorted by offset, as parallel lists for bisect.
        self._free_off: list[int] = [0] if self.capacity else []
        self._free_len: list[int] = [self.capacity] if self.capacity else []
        # offset -> aligned length of every allocated range.
        self._allocated: dict[int, int] = {}
        self.used = 0

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def can_fit(self, size: int) -> bool:
        need = align_up(size)
        return any(n >= need for n in self._free_len)

    def allocate(self, size: int) -> int | None:
        """Returns the offset of a new range of at least ``size`` bytes, or None when no free
        range is large enough (first fit)."""
        if size <= 0:
            raise AllocatorError(f"allocation size must be > 0, got {size}")
        need = align_up(size)
        for i, n in enumerate(self._free_len):
            if n >= need:
                off = self._free_off[i]
                if n == need:
                    del self._free_off[i]
                    del self._free_len[i]
                else:
                    self._free_off[i] = off + need
                    self._free_len[i] = n - need
                self._allocated[off] = need
                self.used += need
                return off
        return None

    def reserve(self, offset: int, size: int) -> None:
        """Marks ``[offset, offset + size)`` as allocated (an object a node re-reports, or a
        dormant replica coming back). Raises :class:`AllocatorError` when the range is
        misaligned, does not fit in the segment or overlaps an allocated range."""
        problem = self.reserve_many([(offset, size)])[0]
        if problem:
            raise AllocatorError(problem)

    def _reserve_problem(self, offset: int, size: int) -> str:
        if size <= 0:
            return f"size must be > 0, got {size}"
        if offset % ALIGNMENT:
            return f"offset {offset} is not {ALIGNMENT}-byte aligned"
        need = align_up(size)
        if offset + need > self.capacity:
            return (
                f"range [{offset}, {offset + need}) does not fit in a segment of "
                f"{self.capacity} usable bytes"
            )
        i = bisect.bisect_right(self._free_off, offset) - 1
        if i < 0 or self._free_off[i] + self._free_len[i] < offset + need:
            return f"range [{offset}, {offset + need}) overlaps an allocated range"
        return ""

    def reserve_many(self, ranges: list[tuple[int, int]]) -> list[str]:
        """Marks every valid ``(offset, size)`` of ``ranges`` as allocated, in one pass over
        the free list (linear after sorting, whatever the count); returns per range why it was
        refused ("" = reserved): as :meth:`reserve`, or overlapping an earlier range of the
        same call."""
        problems = [""] * len(ranges)
        accepted: list[tuple[int, int]] = []
        end = -1
        for i in sorted(range(len(ranges)), key=lambda i: ranges[i][0]):
            offset, size = ranges[i]
            problem = self._reserve_problem(offset, size)
            if not problem and offset < end:
                problem = f"range at offset {offset} overlaps another range being reserved"
            if problem:
                problems[i] = problem
                continue
            accepted.append((offset, align_up(size)))
            end = offset + accepted[-1][1]
        if not accepted:
            return problems
        # Each accepted range lies inside one free range: cut them all out in one walk.
        free_off: list[int] = []
        free_len: list[int] = []
        j = 0
        for f_off, f_len in zip(self._free_off, self._free_len, strict=True):
            cur, f_end = f_off, f_off + f_len
            while j < len(accepted) and accepted[j][0] < f_end:
                a_off, a_need = accepted[j]
                if a_off > cur:
                    free_off.append(cur)
                    free_len.append(a_off - cur)
                cur = a_off + a_need
                j += 1
            if cur < f_end:
                free_off.append(cur)
                free_len.append(f_end - cur)
        self._free_off, self._free_len = free_off, free_len
        for offset, need in accepted:
            self._allocated[offset] = need
            self.used += need
        return problems

    def release(self, offset: int) -> None:
        """Frees the range that starts at ``offset`` and merges it with free neighbours."""
        need = self._allocated.pop(offset, None)
        if need is None:
            raise AllocatorError(f"no allocated range starts at offset {offset}")
        self.used -= need
        i = bisect.bisect_left(self._free_off, offset)
        start, length = offset, need
        # Merge with the right neighbour.
        if i < len(self._free_off) and self._free_off[i] == offset + need:
            length += self._free_len[i]
            del self._free_off[i]
            del self._free_len[i]
        # Merge with the left neighbour.
        if i > 0 and self._free_off[i - 1] + self._free_len[i - 1] == start:
            self._free_len[i - 1] += length
        else:
            self._free_off.insert(i, start)
            self._free_len.insert(i, length)

    def free_ranges(self) -> list[tuple[int, int]]:
        """(offset, length) of every free range, in offset order (for tests and debugging)."""
        return list(zip(self._free_off, self._free_len, strict=True))

    def allocated_ranges(self) -> list[tuple[int, int]]:
        return sorted(self._allocated.items())
