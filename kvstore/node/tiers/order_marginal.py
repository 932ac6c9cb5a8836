"""``prefix-marginal``: a prefix-aware 2Q whose probation share follows marginal hits.

``prefix-2q`` (kvstore.node.tiers.order) with a fixed probation share wins where a tier is
small and loses where it is large: new blocks leave after a tenth of the tier's lifetime,
and a conversation's next turn comes later than that once the tier holds more
(bench/trace_sim.py, the conversation trace: 1.93x LRU's hits at 3,000 blocks, 0.89x at
30,000). ``prefix-arc`` adapts the share by every ghost hit, however long ago the key left;
a key evicted four tiers ago says nothing about a share the tier could give, so it settles
between the two (1.40x at 3,000, 1.11x at 6,000).

This order moves the share only by *near misses*: a key evicted from probation that comes
back within the last ``_WINDOW`` x the tier's blocks of probation's evictions (and at least
``_MIN_WINDOW`` of them) is a hit a
probation that much larger would have made; one evicted from the main segment within that
many of main's evictions is a hit a main segment that much larger would have made (a
segment of n blocks keeps a block for its next n evictions, so "k evictions ago" is "k blocks
short"). Equal windows on both sides compare the two segments' marginal hits per block of
room, and the share moves to the segment whose next blocks earn more. Each near miss
multiplies the share's odds (share / (1 - share)) by ``1 + _STEP`` one way or the other: a
multiplicative step crosses the range from 0.5 to 0.01 or to 0.95 in a few hundred near misses at
any tier size, where an additive one is either too slow for large tiers or too coarse for
small ones. The share starts at ``start`` (``eviction.marginal_start``, default
``START_SHARE``; ``eviction.probation`` is ``prefix-2q``'s and ``prefix-arc``'s) and stays in
[``MIN_SHARE``, ``MAX_SHARE``]. 0.2, not one half: the anti-wind-up below pulls a start above
what probation holds down at the first near miss anyway, but each of three nodes sees a third
of the near misses, so its share stays near its start longer (docs/eviction-policy.md, "Three
nodes after the wind-up fix: a lower start share").

No wind-up: while probation holds less than its share the share decides nothing (the order
evicts the older leaf of either segment), and near misses of probation used to keep raising
it with no effect on evictions and nothing to bring it back. A chain returns whole, one near
miss a block, so one request could do it: over the conversation trace one returning 149-block
chain took the disk's share from 0.54 to 0.99 in one PUT, and the disk stayed a FIFO over its
writes for the rest of the replay -- at 2,990 and 3,010 blocks, not at 3,000 (hit ratio 0.073
against 0.087, the first 1,500 requests; tests/store/test_probation_windup.py). So each step
starts from the smaller of the share and the share probation holds now.

Every other rule is ``prefix-2q``'s: leaves only (a chain leaves from its tail), orphans
first, a ghost hit skips probation. O(1) per ghost hit on top of ``prefix-2q``'s O(log n)
heap operations. Not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.node.tiers.order_prefix import PrefixLruOrder

# A near miss: evicted from its segment within this share of the tier's blocks' worth of that
# segment's evictions. bench/trace_sim.py, conversation trace, 1 node, 6,000 blocks (with an
# additive step): 0.05 and 0.25 both did worse than 0.1 (1.17x and 1.14x LRU against 1.28x).
_WINDOW = 0.1
# ... and at least this many evictions, whatever the tier's size: a tenth of a small tier is
# too few evictions to tell the segments apart. The window of a 1,000-block tier, where 0.1
# was measured; below it only (a third of 1,000 blocks per node, a DRAM quarter over a disk).
# bench/trace.py, three nodes of a third of 1,000 blocks each, synthetic trace, DRAM (the mean
# of five placements): 0.950x one node's hits without it, 0.956x / 0.969x / 0.982x / 0.977x /
# 0.977x / 0.967x at 50 / 80 / 100 / 125 / 150 / 200 (docs/eviction-policy.md, "A floor on
# the near-miss window").
_MIN_WINDOW = 100
# Odds step per near miss; 0.003 and 0.01 adapt too slowly to reach 1.25x LRU at 6,000 blocks
# (1.16x, 1.24x) from a start of one half. An additive step (4 blocks' worth a near miss) was
# too slow either way: from 0.1, 0.97x LRU at 30,000 blocks; from 0.5, 1.17x at 6,000.
_STEP = 0.03
# Where the share starts. bench/trace.py, both traces, 1 and 3 nodes, DRAM and DRAM + disk:
# 0.2 keeps every one-node target of 0.5's and brings three nodes closer to one node
# (docs/eviction-policy.md, "Three nodes after the wind-up fix: a lower start share").
START_SHARE = 0.2
MIN_SHARE, MAX_SHARE = 0.01, 0.99

_PROBATION, _MAIN = 0, 1


class MarginalOrder(PrefixLruOrder):
    """``prefix-marginal`` (module docstring); ``ghosts``, ``marks_orphans``: as
    :class:`PrefixLruOrder`'s; ``start``: the probation share before any near miss, in
    [``MIN_SHARE``, ``MAX_SHARE``] (ValueError naming it otherwise)."""

    def __init__(self, ghosts: float = 4.0, marks_orphans: bool = True, start: float = START_SHARE) -> None:
        if not MIN_SHARE <= start <= MAX_SHARE:
            raise ValueError(f"prefix-marginal start share {start!r} is not in [{MIN_SHARE}, {MAX_SHARE}]")
        super().__init__(start, ghosts, marks_orphans=marks_orphans)
        self.policy = "prefix-marginal"
        self._evictions = [0, 0]  # blocks that left probation, main (each ghost keeps its count)
        self.near_misses = [0, 0]

    def discard(self, key: bytes) -> None:
        if key in self._at:
            self._evictions[_PROBATION if key in self._on_probation else _MAIN] += 1
        super().discard(key)

    def _remember(self, ghosts: OrderedDict, key: bytes) -> None:
        ghosts[key] = self._evictions[_PROBATION if ghosts is self._ghosts else _MAIN]
        while len(ghosts) > self.ghosts * len(self._at):
            ghosts.popitem(last=False)

    def _ghost_hit(self, ghosts: OrderedDict, key: bytes, sign: int, ratio: float) -> None:
        """``key`` comes back after eviction from probation (``sign`` +1) or main (-1): it
        skips probation, and a near miss moves the share (``ratio`` is prefix-arc's)."""
        self.ghost_hits += 1
        seg = _PROBATION if sign > 0 else _MAIN
        ago = self._evictions[seg] - ghosts.pop(key)
        if ago >= max(_WINDOW * len(self._at), _MIN_WINDOW):
            return
        self.near_misses[seg] += 1
        # A share above what probation holds decides nothing (the older leaf of either segment
        # goes), so a step starts from the smaller of the two: without this the share wound
        # up to 0.99 on near misses that no longer changed evictions, and stayed there.
        held = max(len(self._on_probation) / max(len(self._at), 1), MIN_SHARE)
        base = min(self.probation, held)
        odds = base / (1.0 - base) * (1.0 + _STEP) ** sign
        self.probation = min(max(odds / (1.0 + odds), MIN_SHARE), MAX_SHARE)

    def stats(self) -> dict:
        return {
            **super().stats(),
            "near_misses_probation": self.near_misses[_PROBATION],
            "near_misses_main": self.near_misses[_MAIN],
        }
