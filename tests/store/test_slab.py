"""The slab allocator: no overlap, bounded waste, capacity never exceeded, slabs recycled."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.tiers.slab import SlabAllocator

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
