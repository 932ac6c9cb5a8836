"""A slab allocator over one contiguous range of bytes: offsets only, no memory of its own.

``[0, capacity)`` is cut into slabs of ``slab_size`` bytes (the largest slot), and each slab
into ``PAGES_PER_SLAB`` pages. A size class takes its slots from *spans*: runs of 1..8
contiguous pages inside one slab, as few as tile the class's slot size with (nearly) the least
tail (a power-of-two slot up to a page takes one page; 1.5 MiB slots of a 32 MiB slab take 3).
A span serves one class; when its last slot is freed its pages go back to the common pool and
can serve any class. So a node whose mix of block sizes changes keeps its memory in use: a
class holds back at most one partly used span, a page-sized block of memory rather than a
whole slab (``slab_size / 8`` rather than ``slab_size``).

Classes: below ``slab_size / 64`` they grow geometrically (``growth``, default 1.125) from
``min_slot``, rounded up to ``align``; above that they are ``slab_size / k`` (k = 64..1); and
at every size each power of two and 1.5x one. The slack inside a slot is under 12.5 % plus
alignment.

A slot is alloc'd from a span with free slots in O(1); a new span costs a scan of the slabs
with free pages. Not thread-safe: the owner serialises calls.
"""

from __future__ import annotations

from bisect import bisect_left, insort

PAGES_PER_SLAB = 8


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
        # pages of slab/8 when that keeps slots aligned; a slab that small is one page
        self.pages = PAGES_PER_SLAB if slab_size % (PAGES_PER_SLAB * align) == 0 else 1
        self.page = slab_size // self.pages
        self.classes: tuple[int, ...] = _classes(slab_size, min_slot, growth, align)
        self._span_len = tuple(self._pages_for(s) for s in self.classes)
        self._span_slots = tuple(n * self.page // s for n, s in zip(self._span_len, self.classes))
        n_pages = self.num_slabs * self.pages
        self._page_span = [-1] * n_pages  # start page of the span covering each page, -1 free
        self._span_class: dict[int, int] = {}  # span start page -> class index
        self._span_free: dict[int, list[int]] = {}
        self._span_used: dict[int, int] = {}
        # per class: spans with at least one free slot (dict as an ordered set: O(1) add/remove)
        self._partial: list[dict[int, None]] = [{} for _ in self.classes]
        self._slab_free = [(1 << self.pages) - 1] * self.num_slabs  # bitmask of free pages
        # Slabs with a free page, by when they last got pages back (``_freed_at``, a clock:
        # initially slab 0 the most recent): a freed span is what the next allocation reuses,
        # as with a stack. Kept apart as the whole free slabs (a dict in that order, the most
        # recent last) and the partly free ones (a sorted list of (time, slab)), so that a new
        # span costs a look at the partly free slabs only, not at every whole one: the choice
        # is the same as one scan of all of them, most recent first (the first partly free
        # slab with room, else the most recent whole one), at a few blocks' cost per PUT
        # instead of one scan per block (a 256 KiB block in 2 MiB slabs takes a span each).
        self._freed_at = [self.num_slabs - 1 - s for s in range(self.num_slabs)]
        self._clock = self.num_slabs
        self._whole: dict[int, None] = dict.fromkeys(range(self.num_slabs - 1, -1, -1))
        self._partly: list[tuple[int, int]] = []  # (freed_at, slab), ascending
        self.allocated_bytes = 0  # sum of slot sizes handed out

    def _pages_for(self, slot: int) -> int:
        """The fewest pages whose tail after tiling ``slot`` is within 1/64 of the least tail
        any span length gives (short spans are easier to find free and to empty)."""
        tails = {
            n: (n * self.page % slot) / (n * self.page)
            for n in range(1, self.pages + 1)
            if n * self.page >= slot
        }
        best = min(tails.values())
        return min(n for n, t in tails.items() if t <= best + 1 / 64)

    def class_of(self, nbytes: int) -> int:
        """Index of the smallest class that holds ``nbytes``; ValueError when over slab_size."""
        if nbytes > self.slab_size or nbytes <= 0:
            raise ValueError(f"{nbytes} bytes do not fit a slot (1..{self.slab_size})")
        return bisect_left(self.classes, nbytes)

    def slot_size_for(self, nbytes: int) -> int:
        return self.classes[self.class_of(nbytes)]

    def span_pages(self, nbytes: int) -> int:
        """Pages of the span that serves the class of ``nbytes``."""
        return self._span_len[self.class_of(nbytes)]

    # ------------------------------------------------------------------ alloc, free
    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free slot of at least ``nbytes``, or None when no span can serve it."""
        c = self.class_of(nbytes)
        partial = self._partial[c]
        if partial:
            span = next(iter(partial))
        else:
            span = self._take_pages(self._span_len[c])
            if span is None:
                return None
            slot = self.classes[c]
            base = span * self.page
            self._span_class[span] = c
            self._span_free[span] = [base + i * slot for i in range(self._span_slots[c] - 1, -1, -1)]
            self._span_used[span] = 0
            partial[span] = None
        free = self._span_free[span]
        off = free.pop()
        self._span_used[span] += 1
        if not free:
            del partial[span]
        self.allocated_bytes += self.classes[c]
        return off

    def free(self, offset: int) -> None:
        """Return a slot. Raises ValueError for an offset that is not an allocated slot start."""
        page = offset // self.page
        span = self._page_span[page] if 0 <= page < len(self._page_span) else -1
        if span < 0:
            raise ValueError(f"offset {offset} is not in an allocated span")
        c = self._span_class[span]
        slot = self.classes[c]
        within = offset - span * self.page
        if within % slot or within // slot >= self._span_slots[c]:
            raise ValueError(f"offset {offset} is not a slot start")
        free = self._span_free[span]
        free.append(offset)
        self._span_used[span] -= 1
        self.allocated_bytes -= slot
        if self._span_used[span] == 0:  # no live slot left: its pages go back to the pool
            self._partial[c].pop(span, None)
            del self._span_class[span], self._span_free[span], self._span_used[span]
            self._give_pages(span, self._span_len[c])
        else:
            self._partial[c][span] = None

    def _find_pages(self, n: int) -> int | None:
        """Start page of ``n`` free contiguous pages in one slab: in a slab already in use when
        one has room (whole free slabs stay whole for the classes that need them; the most
        recently freed first), else in the most recently freed whole slab."""
        window = (1 << n) - 1
        free = self._slab_free
        for _, slab in reversed(self._partly):
            mask = free[slab]
            for i in range(self.pages - n + 1):
                if (mask >> i) & window == window:
                    return slab * self.pages + i
        return next(reversed(self._whole)) * self.pages if self._whole else None

    def _take_pages(self, n: int) -> int | None:
        start = self._find_pages(n)
        if start is None:
            return None
        slab, i = divmod(start, self.pages)
        was = self._slab_free[slab]
        now = self._slab_free[slab] = was & ~(((1 << n) - 1) << i)
        if was == (1 << self.pages) - 1:
            del self._whole[slab]
            if now:
                insort(self._partly, (self._freed_at[slab], slab))
        elif not now:
            self._partly.pop(bisect_left(self._partly, (self._freed_at[slab], slab)))
        for p in range(start, start + n):
            self._page_span[p] = start
        return start

    def _give_pages(self, start: int, n: int) -> None:
        slab, i = divmod(start, self.pages)
        was = self._slab_free[slab]
        now = self._slab_free[slab] = was | ((1 << n) - 1) << i
        if was:  # partly free until now (a whole slab has no pages to give back)
            self._partly.pop(bisect_left(self._partly, (self._freed_at[slab], slab)))
        self._freed_at[slab] = self._clock  # the most recently freed: searched first
        self._clock += 1
        if now == (1 << self.pages) - 1:
            self._whole[slab] = None
        else:
            self._partly.append((self._freed_at[slab], slab))
        for p in range(start, start + n):
            self._page_span[p] = -1

    # ------------------------------------------------------------------ queries
    def slot_size(self, offset: int) -> int:
        return self.classes[self._span_class[self._page_span[offset // self.page]]]

    def can_alloc(self, nbytes: int) -> bool:
        c = self.class_of(nbytes)
        return bool(self._partial[c]) or self._find_pages(self._span_len[c]) is not None

    def span_of(self, offset: int) -> int:
        """The span (its start page) holding the slot at ``offset``."""
        return self._page_span[offset // self.page]

    def span_used(self, span: int) -> int:
        """Slots of ``span`` handed out and not yet freed (0 for a page not in a span)."""
        return self._span_used.get(span, 0)

    def spans_to_free(self, span: int, nbytes: int) -> list[int]:
        """The spans to empty so that a span for the class of ``nbytes`` fits where ``span``
        is: ``span`` and its neighbours in the same slab that cover enough contiguous pages.
        Emptying them all gives that class room (with no other allocation in between)."""
        need = self._span_len[self.class_of(nbytes)]
        have = self._span_len[self._span_class[span]]
        if have >= need:
            return [span]
        slab = span // self.pages
        lo = max(slab * self.pages, span + have - need)
        out = []
        for p in range(lo, lo + need):
            s = self._page_span[p]
            if s >= 0 and s not in out:
                out.append(s)
        return out

    @property
    def free_slabs(self) -> int:
        """Slabs with every page free."""
        full = (1 << self.pages) - 1
        return sum(1 for m in self._slab_free if m == full)

    @property
    def free_pages(self) -> int:
        return sum(m.bit_count() for m in self._slab_free)

    def free_slot_bytes(self) -> int:
        """Bytes of spans not in a handed-out slot (free slots and the tail a class does not
        tile): memory this allocator holds back from other classes."""
        assigned = len(self._page_span) - self.free_pages
        return assigned * self.page - self.allocated_bytes

    def check(self) -> None:
        """Integrity check (for tests): counts, pages and free lists agree. Raises AssertionError."""
        total = 0
        covered = 0
        for span, c in self._span_class.items():
            n = self._span_len[c]
            assert span // self.pages == (span + n - 1) // self.pages, "span crosses a slab"
            assert all(self._page_span[p] == span for p in range(span, span + n))
            slab, i = divmod(span, self.pages)
            assert not self._slab_free[slab] & (((1 << n) - 1) << i), "span on free pages"
            free = self._span_free[span]
            assert len(set(free)) == len(free), "duplicate free slot"
            assert len(free) + self._span_used[span] == self._span_slots[c]
            assert self._span_used[span] > 0
            assert (span in self._partial[c]) == bool(free)
            total += self._span_used[span] * self.classes[c]
            covered += n
        assert covered + self.free_pages == len(self._page_span)
        assert sum(1 for s in self._page_span if s < 0) == self.free_pages
        assert total == self.allocated_bytes
        full = (1 << self.pages) - 1
        assert list(self._whole) == sorted(
            (s for s, m in enumerate(self._slab_free) if m == full), key=self._freed_at.__getitem__
        ), "whole free slabs out of order"
        assert self._partly == sorted(
            (self._freed_at[s], s) for s, m in enumerate(self._slab_free) if m and m != full
        ), "partly free slabs out of order"


def _classes(slab_size: int, min_slot: int, growth: float, align: int) -> tuple[int, ...]:
    # Small slots: geometric classes (slack < 1/growth). Larger ones (from slab/64): exactly
    # slab/k for k = 64..1, which tile a slab with no tail; neighbours differ by <= 1/8 down to
    # k = 8. Plus, at every size, powers of two and 1.5x them: the block sizes of real models,
    # made exact (more classes only ever lower the slack).
    classes: list[int] = []
    size = min(_round_up(min_slot, align), slab_size)
    while size < slab_size // 64:
        classes.append(size)
        size = max(_round_up(int(size * growth), align), size + align)
    for k in range(64, 0, -1):
        s = slab_size // k // align * align
        if s >= align and (not classes or s > classes[-1]):
            classes.append(s)
    p2 = 1
    while p2 < slab_size:
        for c in (p2, p2 * 3 // 2):
            if c >= min_slot and c % align == 0 and c < slab_size:
                classes.append(c)
        p2 *= 2
    classes.append(slab_size)
    return tuple(sorted(set(classes)))


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a
