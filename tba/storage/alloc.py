"""A best-fit extent allocator over one linear range, with coalescing on free.

Used for slab files (disk) and for the staging arena (memory). Not thread-safe: callers lock.
"""

from __future__ import annotations

import bisect

from ..errors import internal_error


class ExtentAllocator:
    """Hands out ``align``-multiple extents of ``[0, capacity)``.

    Free ranges are kept sorted by start; a freed extent merges with its neighbours, so a fully
    freed allocator is one range again. Requests are rounded up to ``align``.
    """

    __slots__ = ("capacity", "align", "_starts", "_ends", "used", "_live")

    def __init__(self, capacity: int, align: int):
        if align <= 0 or align & (align - 1):
            raise ValueError(f"alignment must be a power of two, got {align}")
        self.capacity = capacity // align * align
        self.align = align
        self._starts: list[int] = [0] if self.capacity else []
        self._ends: list[int] = [self.capacity] if self.capacity else []
        self.used = 0
        self._live: dict[int, int] = {}

    def round(self, nbytes: int) -> int:
        a = self.align
        return max(a, (nbytes + a - 1) // a * a)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of ``round(nbytes)`` bytes, or None when no free range fits."""
        need = self.round(nbytes)
        best = -1
        best_len = 0
        for i, (s, e) in enumerate(zip(self._starts, self._ends)):
            n = e - s
            if n >= need and (best < 0 or n < best_len):
                best, best_len = i, n
                if n == need:
                    break
        if best < 0:
            return None
        start = self._starts[best]
        if best_len == need:
            del self._starts[best]
            del self._ends[best]
        else:
            self._starts[best] = start + need
        self.used += need
        self._live[start] = need
        return start

    def free(self, offset: int) -> None:
        """Return the extent that starts at ``offset`` (as returned by :meth:`alloc`)."""
        n = self._live.pop(offset, None)
        if n is None:
            raise internal_error("storage", f"double free or unknown extent at offset {offset}")
        self.used -= n
        end = offset + n
        i = bisect.bisect_left(self._starts, offset)
        merge_prev = i > 0 and self._ends[i - 1] == offset
        merge_next = i < len(self._starts) and self._starts[i] == end
        if merge_prev and merge_next:
            self._ends[i - 1] = self._ends[i]
            del self._starts[i]
            del self._ends[i]
        elif merge_prev:
            self._ends[i - 1] = end
        elif merge_next:
            self._starts[i] = offset
        else:
            self._starts.insert(i, offset)
            self._ends.insert(i, end)

    def size_of(self, offset: int) -> int:
        return self._live[offset]

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        return max((e - s for s, e in zip(self._starts, self._ends)), default=0)

    @property
    def live_extents(self) -> int:
        return len(self._live)
