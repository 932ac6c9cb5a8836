"""The prefix-aware eviction orders, ``prefix-lru``, ``prefix-2q`` and ``prefix-arc`` (one class),
and the base of ``prefix-marginal`` (kvstore.node.tiers.order_marginal). The rules are in
kvstore.node.tiers.order's docstring; this module is their implementation.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Generator

# The adaptive probation share stays within these bounds (prefix-arc); per ghost hit it moves
# by ARC's step (a block's worth times the ratio of the other ghost list's length to this
# one's) times this gain: the ghost lists reach back ``ghosts`` x the tier, not ARC's 1x, and
# at a gain of 1 the share adapts too slowly for an hour of traffic (bench/trace_sim.py: the
# conversation trace at 30,000 blocks falls below LRU at gains 1 and 2, not at 8; near-miss
# steering, only ghosts evicted within a tier's worth, did worse).
_MIN_SHARE, _MAX_SHARE = 0.01, 0.99
_ADAPT_GAIN = 8.0
# Orphans' ticks are this far below every other's: they go first, oldest first.
_ORPHAN = 1 << 62

# A heap is rebuilt from its live entries when it holds more than 2x of them plus this many.
_COMPACT_SLACK = 1024


class _LeafHeap:
    """(tick, key) entries of one segment's leaves; an entry is live while ``live(tick, key)``."""

    def __init__(self) -> None:
        self.heap: list[tuple[int, bytes]] = []

    def push(self, tick: int, key: bytes) -> None:
        heapq.heappush(self.heap, (tick, key))

    def compact(self, live, members: int) -> None:
        if len(self.heap) > 2 * members + _COMPACT_SLACK:
            self.heap = [e for e in self.heap if live(*e)]
            heapq.heapify(self.heap)


class PrefixLruOrder:
    """``prefix-lru`` (``probation`` 0), ``prefix-2q`` (``probation`` in (0, 1)) or, with
    ``adaptive``, ``prefix-arc``; see the module docstring."""

    def __init__(
        self, probation: float = 0.0, ghosts: float = 4.0, adaptive: bool = False, marks_orphans: bool = True
    ) -> None:
        if not 0.0 <= probation < 1.0:
            raise ValueError(f"probation {probation!r} is not in [0, 1)")
        if ghosts < 0:
            raise ValueError(f"ghosts {ghosts!r} is negative")
        self.probation = probation  # the share probation may hold now
        self.ghosts = ghosts
        self.adaptive = adaptive
        self.policy = ("prefix-arc" if adaptive else "prefix-2q") if probation else "prefix-lru"
        self._tick = 0
        self._at: dict[bytes, int] = {}  # key -> tick of its last add or touch
        self._parent: dict[bytes, bytes] = {}
        self._kids: dict[bytes, int] = {}  # key -> stored blocks naming it as their parent
        self._on_probation: set[bytes] = set()
        self._main, self._prob = _LeafHeap(), _LeafHeap()
        self._ghosts: OrderedDict[bytes, None] = OrderedDict()  # evicted from probation
        self._main_ghosts: OrderedDict[bytes, None] = OrderedDict()  # evicted from main
        self.ghost_hits = 0
        self.orphans_added = 0
        self.orphans: set[bytes] = set()  # stored here, parent evicted from here, not read since
        self.marks_orphans = marks_orphans

    def __len__(self) -> int:
        return len(self._at)

    def _live(self, tick: int, key: bytes) -> bool:
        return self._at.get(key) == tick and key not in self._kids

    def _heap_of(self, key: bytes) -> _LeafHeap:
        return self._prob if key in self._on_probation else self._main

    def _stamp(self, key: bytes, orphan: bool = False) -> None:
        self._tick += 1
        t = self._tick - _ORPHAN if orphan else self._tick
        self._at[key] = t
        if orphan:
            self.orphans.add(key)
        else:
            self.orphans.discard(key)
        if key not in self._kids:
            self._heap_of(key).push(t, key)

    def add(self, key: bytes, parent: bytes | None, demoted: bool = False) -> None:
        """``demoted``: a block the tier above evicts, not a client's write: its ghost here is
        forgotten, not a ghost hit (no return, no near miss, not past probation). Counted as
        one, the demotions of a small DRAM over a larger disk returned the disk's own evictions
        to it as reuse and grew its probation to 0.99 (a FIFO): bench/trace_sim.py,
        conversation, DRAM + disk, 1,000 blocks."""
        if key in self._at:
            self.discard(key)
        if demoted:
            self._ghosts.pop(key, None)
            self._main_ghosts.pop(key, None)
        if self.probation:
            if key in self._ghosts:
                self._ghost_hit(self._ghosts, key, +1, len(self._main_ghosts) / max(len(self._ghosts) - 1, 1))
            elif key in self._main_ghosts:
                self._ghost_hit(
                    self._main_ghosts, key, -1, len(self._ghosts) / max(len(self._main_ghosts) - 1, 1)
                )
            else:
                self._on_probation.add(key)
        orphan = False
        if parent is not None:
            self._parent[key] = parent
            self._kids[parent] = self._kids.get(parent, 0) + 1
            gone = (
                self.marks_orphans
                and parent not in self._at
                and (parent in self._ghosts or parent in self._main_ghosts)
            )
            orphan = gone or parent in self.orphans
            self.orphans_added += orphan
        self._stamp(key, orphan)
        self._compact()

    def touch(self, key: bytes) -> None:
        if key in self._at:
            self._on_probation.discard(key)
            self._stamp(key)
            self._compact()

    def discard(self, key: bytes) -> None:
        if self._at.pop(key, None) is None:
            return
        self.orphans.discard(key)
        if key in self._on_probation:
            self._on_probation.discard(key)
            self._remember(self._ghosts, key)
        else:
            self._remember(self._main_ghosts, key)
        p = self._parent.pop(key, None)
        if p is None:
            return
        n = self._kids[p] - 1
        if n:
            self._kids[p] = n
            return
        del self._kids[p]
        t = self._at.get(p)
        if t is not None:  # a leaf now, a candidate at its own last use
            self._heap_of(p).push(t, p)

    def _remember(self, ghosts: OrderedDict[bytes, None], key: bytes) -> None:
        ghosts[key] = None
        while len(ghosts) > self.ghosts * len(self._at):
            ghosts.popitem(last=False)

    def _ghost_hit(self, ghosts: OrderedDict[bytes, None], key: bytes, sign: int, ratio: float) -> None:
        """``key`` comes back after eviction: it skips probation, and (adaptive) the probation
        share grows (``sign`` +1: it was evicted from probation) or shrinks (-1) by ARC's step,
        ``ratio`` (the other ghost list's length over this one's) blocks' worth at least one."""
        self.ghost_hits += 1
        del ghosts[key]
        if self.adaptive:
            step = _ADAPT_GAIN * max(ratio, 1.0) / max(len(self._at), 1)
            self.probation = min(max(self.probation + sign * step, _MIN_SHARE), _MAX_SHARE)

    def _compact(self) -> None:
        self._main.compact(self._live, len(self._at) - len(self._on_probation))
        self._prob.compact(self._live, len(self._on_probation))

    def _pop_live(self, h: _LeafHeap, popped: list, seen: set[bytes]) -> tuple[int, bytes] | None:
        while h.heap:
            e = heapq.heappop(h.heap)
            if self._live(*e) and e[1] not in seen:
                popped.append((h, e))
                return e
        return None

    def candidates(self, accept: Callable[[bytes], bool] | None = None) -> Generator[bytes, None, None]:
        """Leaves, oldest first; probation's first while it is over its share. Entries popped
        to look ahead go back when the iteration ends.

        ``accept``: the caller's filter, for a plan of several victims made in one pass (the
        disk tier's put). A leaf it refuses is skipped; one it accepts is yielded and counts as
        gone for the rest of the pass, so a parent whose stored children were all accepted
        becomes a candidate at its own last use, as it would after their eviction. Without it
        only the leaves of now are yielded: a pass that plans many victims would run out of
        probation's leaves (one a chain) and take the main segment's."""
        popped: list[tuple[_LeafHeap, tuple[int, bytes]]] = []
        seen: set[bytes] = set()
        heads: dict[int, tuple[int, bytes] | None] = {}
        freed: tuple[list, list] = ([], [])  # per segment: parents whose children this pass took
        taken: dict[bytes, int] = {}
        try:
            prob_left = len(self._on_probation)
            total_left = len(self._at)
            while True:
                for i, h in enumerate((self._main, self._prob)):
                    if heads.get(i) is None:
                        heads[i] = self._pop_live(h, popped, seen)
                best: list[tuple[int, bytes] | None] = [None, None]
                for i in (0, 1):
                    f = freed[i]
                    while f and (f[0][1] in seen or self._at.get(f[0][1]) != f[0][0]):
                        heapq.heappop(f)  # touched or gone since it was freed
                    h = heads[i]
                    best[i] = f[0] if f and (h is None or f[0] < h) else h
                m, p = best
                if m is None and p is None:
                    return
                over = prob_left > self.probation * total_left
                # orphans (negative ticks) go first from either segment, then probation
                # while it is over its share, else the older leaf
                take_prob = p is not None and (m is None or p[0] < m[0] or (over and m[0] > 0))
                i = 1 if take_prob else 0
                e = best[i]
                assert e is not None
                if e is heads[i]:
                    heads[i] = None
                else:
                    heapq.heappop(freed[i])
                seen.add(e[1])
                if accept is not None and not accept(e[1]):
                    continue
                prob_left -= take_prob
                total_left -= 1
                yield e[1]
                if accept is not None:
                    self._free_parent(e[1], taken, freed)
        finally:
            for h, e in popped:
                if self._live(*e):
                    h.push(*e)

    def _free_parent(self, key: bytes, taken: dict[bytes, int], freed: tuple[list, list]) -> None:
        """``key`` was taken by a pass: its parent is a candidate of that pass once all its
        stored children are."""
        par = self._parent.get(key)
        if par is None or par not in self._at:
            return
        n = taken.get(par, 0) + 1
        taken[par] = n
        if n >= self._kids.get(par, 0):
            heapq.heappush(freed[1 if par in self._on_probation else 0], (self._at[par], par))

    def stats(self) -> dict:
        return {
            "policy": self.policy,
            "probation_blocks": len(self._on_probation),
            "probation_share": round(self.probation, 4),
            "ghost_hits": self.ghost_hits,
            "orphans_stored": self.orphans_added,
            "orphan_blocks": len(self.orphans),
        }
