"""The eviction orders on their own (kvstore.node.tiers.order, order_marginal), driven as a tier
drives them: add on a write, touch on a read, and while over capacity discard the first
candidate. Prefix awareness for every prefix policy, scan resistance (fails for ``lru``), and
how ``prefix-marginal`` moves its probation share. Block counts only, no timing."""

from __future__ import annotations

import random

import pytest

from kvstore.node.tiers.order import POLICIES, make_order
from kvstore.node.tiers.order_marginal import MarginalOrder

PREFIX_POLICIES = [p for p in POLICIES if p != "lru"]
SCAN_RESISTANT = ["prefix-2q", "prefix-arc", "prefix-marginal"]


class Tier:
    """``capacity`` blocks under one order; ``parent`` of each stored key."""

    def __init__(self, order, capacity: int) -> None:
        self.order, self.capacity = order, capacity
        self.parent: dict[bytes, bytes | None] = {}

    def write(self, key: bytes, parent: bytes | None = None) -> None:
        while len(self.parent) >= self.capacity:
            it = self.order.candidates()
            victim = next(it)
            it.close()
            self.evict(victim)
        self.parent[key] = parent
        self.order.add(key, parent)

    def evict(self, key: bytes) -> None:
        kids = [k for k, p in self.parent.items() if p == key]
        assert not kids or self.order.policy == "lru", f"{key!r} went before its children {kids}"
        del self.parent[key]
        self.order.discard(key)

    def access(self, key: bytes, parent: bytes | None = None) -> bool:
        """A read when stored (True), else a write."""
        if key in self.parent:
            self.order.touch(key)
            return True
        self.write(key, parent)
        return False


def _chain(name: str, n: int) -> list[tuple[bytes, bytes | None]]:
    keys = [f"{name}/{i}".encode() for i in range(n)]
    return list(zip(keys, [None, *keys[:-1]]))


@pytest.mark.parametrize("policy", PREFIX_POLICIES)
def test_no_block_leaves_before_its_children(policy):
    """Random chains sharing prefixes, read and written at random: every eviction takes a
    block with no stored child (Tier.evict asserts it)."""
    rng = random.Random(7)
    tier = Tier(make_order(policy), capacity=60)
    evictions = 0
    for _ in range(3000):
        root = rng.randrange(12)
        chain = _chain(f"c{root}", rng.randrange(1, 20))
        for key, parent in chain:
            if key in tier.parent:
                tier.order.touch(key)
            else:
                evictions += len(tier.parent) >= tier.capacity
                tier.write(key, parent)
    assert evictions > 1000


@pytest.mark.parametrize("policy", SCAN_RESISTANT + ["lru"])
def test_a_one_off_scan_does_not_flush_a_reused_prefix(policy):
    """A 20-block prefix read back three times, then a scan of 500 one-off blocks (5x the
    tier) never read: the scan-resistant orders keep the prefix whole, LRU loses all of it."""
    tier = Tier(make_order(policy), capacity=100)
    hot = _chain("hot", 20)
    for _ in range(3):
        for key, parent in hot:
            tier.access(key, parent)
    for key, parent in _chain("scan", 500):
        tier.write(key, parent)
    kept = sum(k in tier.parent for k, _ in hot)
    assert kept == (0 if policy == "lru" else 20), (policy, kept)


def _reused_after(order, distance: int, capacity: int = 1000, writes: int = 20000) -> int:
    """A tier of ``capacity`` blocks, all read (main), then ``writes`` new blocks, never read,
    each written again ``distance`` writes later when gone; returns how many of the last
    quarter were gone by then."""
    tier = Tier(order, capacity=capacity)
    for i in range(capacity):
        tier.access(f"m{i}".encode())
        tier.access(f"m{i}".encode())
    keys = [f"k{i}".encode() for i in range(writes)]
    gone = 0
    for i, key in enumerate(keys):
        tier.write(key)
        if i >= distance and keys[i - distance] not in tier.parent:
            tier.write(keys[i - distance])
            gone += i >= writes - writes // 4
    return gone


def test_near_misses_from_probation_grow_its_share_to_the_reuse_distance():
    """Probation holds 500 blocks (half of 1,000) and new blocks come back after 580 writes:
    80 evictions after they left, inside the window of 100. The share grows until probation
    keeps them (581 blocks), and then stays. (Starts at one half, not the default.)"""
    order = MarginalOrder(start=0.5)
    assert _reused_after(order, 580) == 0, "the share did not grow to the reuse distance"
    s = order.stats()
    assert s["near_misses_probation"] >= 80 and s["near_misses_main"] == 0, s
    assert 0.55 < order.probation < 0.65 and s["probation_blocks"] >= 580, s
    assert _reused_after(make_order("prefix-2q", probation=0.5), 580) == 5000, "a fixed share misses"


def test_ghost_hits_beyond_the_window_leave_the_share_alone():
    """New blocks come back after 700 writes: 200 evictions after they left probation, a
    ghost hit (they skip probation) but beyond a tenth of the tier: the share does not move.
    (Starts at one half, not the default: probation then holds 500 blocks, as the distances
    assume.)"""
    order = MarginalOrder(start=0.5)
    assert _reused_after(order, 700) == 5000
    s = order.stats()
    assert s["ghost_hits"] > 10000 and s["near_misses_probation"] == s["near_misses_main"] == 0, s
    assert order.probation == 0.5


def test_a_small_tiers_window_is_at_least_a_hundred_evictions():
    """A tier of 100 blocks (a third of 300 per node; a DRAM quarter over a disk): probation
    holds 50 and new blocks come back after 64 writes, 14 evictions after they left it:
    beyond a tenth of the tier but inside the window's floor of 100 evictions. They are near
    misses, and the share grows until probation keeps them (before the floor, a window of 10:
    the share never moved and every one of them was gone)."""
    order = MarginalOrder(start=0.5)
    assert _reused_after(order, 64, capacity=100, writes=2000) == 0
    s = order.stats()
    assert s["near_misses_probation"] >= 14 and s["near_misses_main"] == 0, s
    assert order.probation > 0.6 and s["probation_blocks"] >= 64, s


def test_near_misses_from_main_shrink_its_share():
    """105 blocks read in a cycle through a tier of 100: each comes back 5 of main's
    evictions after it left main (ghost hit, so it skips probation): the share shrinks."""
    order = MarginalOrder()
    tier = Tier(order, capacity=100)
    keys = [f"k{i}".encode() for i in range(105)]
    for _ in range(20):
        for key in keys:
            tier.access(key)
    s = order.stats()
    assert s["near_misses_main"] > 500, s
    assert s["near_misses_main"] > 10 * s["near_misses_probation"], s
    assert order.probation < 0.05


def test_an_orphan_goes_first():
    """A block stored after its parent was evicted here is the next victim."""
    tier = Tier(make_order("prefix-marginal"), capacity=10)
    for key, parent in _chain("a", 10):
        tier.write(key, parent)
    tier.evict(b"a/9")
    tier.evict(b"a/8")
    tier.write(b"other")
    tier.write(b"a/9", b"a/8")  # its parent is a ghost: an orphan
    it = tier.order.candidates()
    assert next(it) == b"a/9"
    it.close()
