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
        """Marks ``[offset, offset + size)`` as allocated (objects re-reported by a node after a
        master restart). Raises :class:`AllocatorError` when the range is misaligned, does not
        fit in the segment or overlaps an allocated range."""
        if size <= 0:
            raise AllocatorError(f"size must be > 0, got {size}")
        if offset % ALIGNMENT:
            raise AllocatorError(f"offset {offset} is not {ALIGNMENT}-byte aligned")
        need = align_up(size)
        if offset + need > self.capacity:
            raise AllocatorError(
                f"range [{offset}, {offset + need}) does not fit in a segment of "
                f"{self.capacity} usable bytes"
            )
        i = bisect.bisect_right(self._free_off, offset) - 1
        if i < 0 or self._free_off[i] + self._free_len[i] < offset + need:
            raise AllocatorError(f"range [{offset}, {offset + need}) overlaps an allocated range")
        f_off, f_len = self._free_off[i], self._free_len[i]
        pieces = []
        if offset > f_off:
            pieces.append((f_off, offset - f_off))
        end, f_end = offset + need, f_off + f_len
        if f_end > end:
            pieces.append((end, f_end - end))
        self._free_off[i : i + 1] = [p[0] for p in pieces]
        self._free_len[i : i + 1] = [p[1] for p in pieces]
        self._allocated[offset] = need
        self.used += need

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
