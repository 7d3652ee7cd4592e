"""First-fit offset allocator over one node's segment, with coalescing frees.

The master keeps one per storage node: it decides offsets, the node only moves bytes. Free
ranges are kept sorted by offset so a free merges with its neighbours in O(log n) + the list
insert; allocation scans for the first range that fits (segments hold thousands of objects,
not millions, so the scan stays cheap).
"""

from __future__ import annotations

import bisect

ALIGN = 64  # cache-line aligned objects: a KV block copied in place needs no realignment


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class OffsetAllocator:
    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._starts: list[int] = [0]  # free ranges, sorted by start
        self._ends: list[int] = [capacity]
        self._used: dict[int, int] = {}  # offset -> aligned size
        self.used_bytes = 0

    def allocate(self, size: int) -> int | None:
        """An offset for `size` bytes, or None when no free range is large enough."""
        if size <= 0:
            raise ValueError("size must be positive")
        need = _align(size)
        for i, (start, end) in enumerate(zip(self._starts, self._ends)):
            if end - start >= need:
                if end - start == need:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = start + need
                self._used[start] = need
                self.used_bytes += need
                return start
        return None

    def reserve(self, offset: int, size: int) -> None:
        """Mark [offset, offset+size) used (rebuilding state after a master restart)."""
        need = _align(size)
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or offset + need > self._ends[i] or offset in self._used:
            raise ValueError(f"range {offset}+{need} is not free")
        start, end = self._starts[i], self._ends[i]
        del self._starts[i], self._ends[i]
        for s, e in ((offset + need, end), (start, offset)):  # right part first keeps order
            if e > s:
                self._starts.insert(i, s)
                self._ends.insert(i, e)
        self._used[offset] = need
        self.used_bytes += need

    def free(self, offset: int) -> None:
        need = self._used.pop(offset, None)
        if need is None:
            raise ValueError(f"offset {offset} is not allocated")  # a double free is a bug
        self.used_bytes -= need
        start, end = offset, offset + need
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == end:  # merge with the next range
            end = self._ends[i]
            del self._starts[i], self._ends[i]
        if i > 0 and self._ends[i - 1] == start:  # merge with the previous range
            self._ends[i - 1] = end
        else:
            self._starts.insert(i, start)
            self._ends.insert(i, end)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def largest_free(self) -> int:
        return max((e - s for s, e in zip(self._starts, self._ends)), default=0)
