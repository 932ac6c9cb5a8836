"""A slab allocator over one contiguous range of bytes: offsets only, no memory of its own.

``[0, capacity)`` is cut into slabs of ``slab_size`` bytes. A slab serves one size class at a
time. Below ``slab_size / 64`` classes grow geometrically (``growth``, default 1.125) from
``min_slot``, rounded up to ``align``, so the slack inside a slot is under 12.5 % plus the
alignment; above that the classes are ``slab_size / k`` (k = 64..1), which tile a slab
exactly (neighbouring classes differ by at most 1/8 for k >= 8).
Blocks of one model all have one size: choose ``slab_size`` as a multiple of it and the waste
is zero. A slab whose slots are all free goes back to the shared pool and can serve another
class, so a change of block size does not strand memory.

Every operation is O(1) (a slab's free list is built once when the slab is assigned, in
O(slots per slab)). Not thread-safe: the owner serialises calls.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import islice


class SlabAllocator:
    def __init__(
        self, capacity: int, slab_size: int, *, min_slot: int = 256, growth: float = 1.125, align: int = 256
    ) -> None:
        if slab_size <= 0 or capacity < slab_size:
            raise ValueError(f"capacity {capacity} must hold at least one slab of {slab_size} bytes")
        if min_slot <= 0 or align <= 0 or growth <= 1.0:
            raise ValueError("min_slot and align must be > 0 and growth > 1")
        self.slab_size = slab_size
        self.num_slabs = capacity // slab_size
        self.capacity = self.num_slabs * slab_size
        # Small slots: geometric classes (slack < 1/growth). Larger ones (from slab/64): exactly
        # slab/k for k = 64..1, which tile a slab with no tail; neighbours differ by <= 1/8
        # down to k = 8.
        classes: list[int] = []
        size = min(_round_up(min_slot, align), slab_size)
        while size < slab_size // 64:
            classes.append(size)
            size = max(_round_up(int(size * growth), align), size + align)
        for k in range(64, 0, -1):
            s = slab_size // k // align * align
            if s >= align and (not classes or s > classes[-1]):
                classes.append(s)
        if classes[-1] != slab_size:
            classes.append(slab_size)
        self.classes: tuple[int, ...] = tuple(classes)
        self._slab_class = [-1] * self.num_slabs
        self._slab_free: list[list[int] | None] = [None] * self.num_slabs
        self._slab_used = [0] * self.num_slabs
        # per class: slabs with at least one free slot (dict as an ordered set: O(1) add/remove)
        self._partial: list[dict[int, None]] = [{} for _ in self.classes]
        self._free_slabs = list(range(self.num_slabs - 1, -1, -1))
        self.allocated_bytes = 0  # sum of slot sizes handed out

    def class_of(self, nbytes: int) -> int:
        """Index of the smallest class that holds ``nbytes``; ValueError when over slab_size."""
        if nbytes > self.slab_size or nbytes <= 0:
            raise ValueError(f"{nbytes} bytes do not fit a slot (1..{self.slab_size})")
        return bisect_left(self.classes, nbytes)

    def slot_size_for(self, nbytes: int) -> int:
        return self.classes[self.class_of(nbytes)]

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free slot of at least ``nbytes``, or None when no slab can serve it."""
        c = self.class_of(nbytes)
        partial = self._partial[c]
        if partial:
            slab = next(iter(partial))
        elif self._free_slabs:
            slab = self._free_slabs.pop()
            slot = self.classes[c]
            base = slab * self.slab_size
            self._slab_class[slab] = c
            self._slab_free[slab] = [base + i * slot for i in range(self.slab_size // slot - 1, -1, -1)]
            partial[slab] = None
        else:
            return None
        free = self._slab_free[slab]
        off = free.pop()
        self._slab_used[slab] += 1
        if not free:
            del partial[slab]
        self.allocated_bytes += self.classes[c]
        return off

    def free(self, offset: int) -> None:
        """Return a slot. Raises ValueError for an offset that is not an allocated slot start."""
        slab, within = divmod(offset, self.slab_size)
        if not 0 <= slab < self.num_slabs or self._slab_class[slab] < 0:
            raise ValueError(f"offset {offset} is not in an allocated slab")
        c = self._slab_class[slab]
        slot = self.classes[c]
        if within % slot or within // slot >= self.slab_size // slot:
            raise ValueError(f"offset {offset} is not a slot start")
        free = self._slab_free[slab]
        free.append(offset)
        self._slab_used[slab] -= 1
        self.allocated_bytes -= slot
        if self._slab_used[slab] == 0:
            self._partial[c].pop(slab, None)
            self._slab_class[slab] = -1
            self._slab_free[slab] = None
            self._free_slabs.append(slab)
        else:
            self._partial[c][slab] = None

    def slot_size(self, offset: int) -> int:
        return self.classes[self._slab_class[offset // self.slab_size]]

    def can_alloc(self, nbytes: int) -> bool:
        return bool(self._partial[self.class_of(nbytes)]) or bool(self._free_slabs)

    def can_alloc_n(self, nbytes: int, n: int) -> bool:
        """Whether ``n`` slots of ``nbytes`` can be allocated now."""
        c = self.class_of(nbytes)
        free = sum(len(self._slab_free[s]) for s in islice(self._partial[c], n))
        return free >= n or bool(self._free_slabs)

    @property
    def free_slabs(self) -> int:
        return len(self._free_slabs)

    def check(self) -> None:
        """Integrity check (for tests): counts and free lists agree. Raises AssertionError."""
        total = 0
        for slab in range(self.num_slabs):
            c = self._slab_class[slab]
            if c < 0:
                assert self._slab_free[slab] is None and self._slab_used[slab] == 0
                assert slab in self._free_slabs
                continue
            nslots = self.slab_size // self.classes[c]
            free = self._slab_free[slab]
            assert len(set(free)) == len(free), "duplicate free slot"
            assert len(free) + self._slab_used[slab] == nslots
            assert (slab in self._partial[c]) == bool(free)
            total += self._slab_used[slab] * self.classes[c]
        assert total == self.allocated_bytes
        assert len(set(self._free_slabs)) == len(self._free_slabs)


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a
