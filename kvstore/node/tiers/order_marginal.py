"""``prefix-marginal``: a prefix-aware 2Q whose probation share follows marginal hits. Why a
fixed share (``prefix-2q``) or ARC's rule (``prefix-arc``) falls short, and what each choice
below measured: docs/eviction-policy.md, "The policy: ``prefix-marginal``".

The share moves only by *near misses*: a key evicted from probation that comes back within
the last ``_WINDOW`` x the tier's blocks of probation's evictions (and at least
``_MIN_WINDOW`` of them) is a hit a probation that much larger would have made; one evicted
from the main segment within that many of main's evictions, a hit of a larger main segment
(a segment of n blocks keeps a block for its next n evictions). Each near miss multiplies the
share's odds (share / (1 - share)) by ``1 + _STEP`` toward its segment. The share starts at
``start`` (``eviction.marginal_start``, default ``START_SHARE``) and stays in
[``MIN_SHARE``, ``MAX_SHARE``].

No wind-up: while probation holds less than its share the share decides nothing, so each step
starts from the smaller of the share and the share probation holds now (a chain returns whole,
one near miss a block: one request once took a disk's share from 0.54 to 0.99;
tests/store/test_probation_windup.py).

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
