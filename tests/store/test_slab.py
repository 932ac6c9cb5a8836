"""The slab allocator: no overlap, bounded waste, capacity never exceeded, slabs recycled."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.node.tiers.slab import SlabAllocator

MiB = 1 << 20


class SlabMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.a = SlabAllocator(16 * MiB, 2 * MiB)
        self.live: dict[int, int] = {}  # offset -> requested bytes

    @rule(n=st.integers(1, 2 * MiB))
    def alloc(self, n):
        off = self.a.alloc(n)
        if off is None:
            assert self.a.free_slabs == 0
            return
        assert off not in self.live
        assert self.a.slot_size(off) >= n
        self.live[off] = n

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6))
    def free(self, i):
        off = sorted(self.live)[i % len(self.live)]
        del self.live[off]
        self.a.free(off)

    @invariant()
    def consistent(self):
        self.a.check()
        spans = sorted((o, o + self.a.slot_size(o)) for o in self.live)
        for (_, e1), (s2, _) in zip(spans, spans[1:]):
            assert e1 <= s2, "slots overlap"
        assert all(e <= self.a.capacity for _, e in spans)
        assert self.a.allocated_bytes <= self.a.capacity


TestSlabMachine = SlabMachine.TestCase
TestSlabMachine.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)


def test_waste_bounded_and_slabs_recycled():
    a = SlabAllocator(64 * MiB, 4 * MiB)
    for n in range(1, 4 * MiB // 8, 4099):
        slot = a.slot_size_for(n)
        assert slot >= n
        assert slot <= max(256, n * 1.125 + 256)
    for k in (1, 2, 4, 8, 16, 32, 64):  # slab/k tiles a slab exactly
        assert a.slot_size_for(4 * MiB // k) == 4 * MiB // k
    offs = [a.alloc(2 * MiB) for _ in range(32)]
    assert None not in offs and a.alloc(1) is None
    for o in offs:
        a.free(o)
    assert a.free_slabs == 16
    assert a.alloc(3 * MiB) is not None  # memory went back to the pool and serves another size


def test_bad_free_rejected():
    a = SlabAllocator(8 * MiB, 2 * MiB)
    off = a.alloc(100_000)
    with pytest.raises(ValueError):
        a.free(off + 1)
    with pytest.raises(ValueError):
        a.free(6 * MiB)
    with pytest.raises(ValueError):
        a.alloc(3 * MiB)


def test_a_span_returns_its_pages_only_when_no_slot_is_live():
    # 16 MiB of 8 MiB slabs: 16 pages of 1 MiB; 64 KiB slots take one page (16 slots)
    a = SlabAllocator(16 * MiB, 8 * MiB)
    small = [a.alloc(64 << 10) for _ in range(16 * 16)]  # every page
    assert None not in small and a.alloc(8 * MiB) is None
    page0 = sorted(small)[:16]  # the slots of the first page
    for off in page0[1:]:
        a.free(off)
    assert a.alloc(1 * MiB) is None, "a page with a live slot must not serve another class"
    a.free(page0[0])
    one = a.alloc(1 * MiB)
    assert one == 0, "the emptied page serves the 1 MiB class"
    a.check()
    # a whole slab for an 8 MiB block once all eight pages of one slab are empty
    for off in sorted(small)[16:]:
        if off < 8 * MiB:
            a.free(off)
    assert a.alloc(8 * MiB) is None, "page 0 is still live"
    a.free(one)
    assert a.alloc(8 * MiB) == 0
    a.check()


def test_spans_tile_with_little_tail():
    a = SlabAllocator(1 << 30, 32 * MiB)
    for n in (64 << 10, 96 << 10, 1 * MiB, 3 * MiB // 2, 2 * MiB, 4 * MiB, 737280):
        slot = a.slot_size_for(n)
        span = a.span_pages(n) * a.page
        assert (span // slot) * n / span >= 0.98, n
