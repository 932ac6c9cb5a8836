"""Eviction orders: which of a tier's blocks goes first when room is needed.

Every tier keeps one order beside its index (see kvstore.node.tiers.index) and asks it for
candidates, first to go first; the node filters them (held, pinned, tenant shares: see
kvstore.node.eviction) and decides where they go. Policies (``[eviction] policy``):

- ``lru``: per-block least recently used (the order before prefix awareness).
- ``prefix-lru``: least recently used among *leaves*: a block that other stored blocks of the
  same tier name as their parent is never a candidate, so a chain is evicted from its tail
  and no block outlives its prefix on the tier. A block whose children all went becomes a
  candidate at its own last use. A block stored while its parent is among the tier's recent
  evictions (the ghosts below), or is an orphan itself, is an orphan -- it cannot be part of
  a hit prefix here -- and goes first, from either segment (an orphan chain from its tail);
  read, it is a block like any other. Only the node's top tier marks orphans (``marks_orphans``
  of :func:`make_order`).
- ``prefix-2q``: ``prefix-lru`` with a probation segment (2Q, Johnson and Shasha 1994): a new
  block is on probation until it is read; while probation holds more than ``probation`` of
  the tier's blocks, its oldest leaf goes first, so a one-off scan (a long prompt never read
  back) flushes only probation, not the read-again prefixes. A key evicted from probation is
  remembered (a ghost: up to ``ghosts`` x the blocks the tier holds, keys only) and skips
  probation when it comes back.
- ``prefix-arc``: ``prefix-2q`` whose probation share adapts as ARC's does (Megiddo and
  Modha 2003): a key coming back after eviction from probation grows it, one coming back
  after eviction from the main segment shrinks it (``probation`` is where it starts). So it
  resists scans where they cost hits and tends to LRU where reuse distances are long.
- ``prefix-marginal``: ``prefix-2q`` whose probation share follows near misses only (keys
  coming back soon after they left a segment: the marginal hits of a larger probation or a
  larger main segment), see kvstore.node.tiers.order_marginal.

Contract: ``add`` (stored, most recently used), ``touch`` (read), ``discard`` (gone);
``candidates()`` yields stored keys in eviction order, each once; the tier may discard or
touch keys between two steps (the iteration stays valid). Heaps with lazily dropped stale
entries: O(log n) per operation, bounded to twice the blocks held. Not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Generator
from typing import Protocol

from kvstore.node.tiers.order_marginal import START_SHARE, MarginalOrder
from kvstore.node.tiers.order_prefix import PrefixLruOrder

POLICIES = ("lru", "prefix-lru", "prefix-2q", "prefix-arc", "prefix-marginal")


class EvictionOrder(Protocol):
    """What a tier's index asks of its eviction order (see the module docstring)."""

    policy: str

    def __len__(self) -> int: ...

    def add(self, key: bytes, parent: bytes | None, demoted: bool = False) -> None:
        """``key`` is stored (most recently used); ``parent``: its header's parent key;
        ``demoted``: it comes down from a tier above, where it was stored until now (not a
        client's write: a key of it this tier evicted is not coming back)."""
        ...

    def touch(self, key: bytes) -> None:
        """``key`` was read (no-op when absent)."""
        ...

    def discard(self, key: bytes) -> None:
        """``key`` is gone (no-op when absent)."""
        ...

    def candidates(self, accept: Callable[[bytes], bool] | None = None) -> Generator[bytes, None, None]:
        """Stored keys, first to go first; close it when done. ``accept``: the caller's filter
        when it plans several victims in one pass (yielded keys are the accepted ones, each
        counted as gone for the rest of the pass: see PrefixLruOrder.candidates)."""
        ...

    def stats(self) -> dict: ...


class LruOrder:
    """Per-block LRU: candidates are the least recently added or touched blocks."""

    policy = "lru"

    def __init__(self) -> None:
        self._q: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._q)

    def add(self, key: bytes, parent: bytes | None, demoted: bool = False) -> None:
        self._q[key] = None
        self._q.move_to_end(key)

    def touch(self, key: bytes) -> None:
        if key in self._q:
            self._q.move_to_end(key)

    def discard(self, key: bytes) -> None:
        self._q.pop(key, None)

    def candidates(self, accept: Callable[[bytes], bool] | None = None) -> Generator[bytes, None, None]:
        """Least recently used first (those ``accept`` takes, when given). The tier must not
        change between steps (iterate a slice of it into a list first where it does)."""
        if accept is None:
            yield from self._q
        else:
            yield from filter(accept, self._q)

    def stats(self) -> dict:
        return {"policy": self.policy}


def make_order(
    policy: str,
    probation: float = 0.1,
    ghosts: float = 4.0,
    marks_orphans: bool = True,
    marginal_start: float = START_SHARE,
) -> EvictionOrder:
    """The order of a policy named in ``POLICIES`` (ValueError naming it otherwise);
    ``probation`` and ``ghosts``: see :class:`PrefixLruOrder` (``probation``: not
    ``prefix-marginal``'s, whose share starts at ``marginal_start``). ``marks_orphans``: whether a block whose
    parent this tier evicted is an orphan (first to go); only the node's top tier knows that
    (below it the parent may still be in a tier above: the disk may drop a chain's prefix while
    DRAM still serves it)."""
    if policy == "lru":
        return LruOrder()
    if policy == "prefix-lru":
        return PrefixLruOrder(
            0.0, min(ghosts, 1.0), marks_orphans=marks_orphans
        )  # ghosts only to know orphans
    if policy == "prefix-2q":
        return PrefixLruOrder(probation, ghosts, marks_orphans=marks_orphans)
    if policy == "prefix-arc":
        return PrefixLruOrder(probation, ghosts, adaptive=True, marks_orphans=marks_orphans)
    if policy == "prefix-marginal":
        return MarginalOrder(ghosts, marks_orphans, marginal_start)
    raise ValueError(f"eviction policy {policy!r} is not one of {POLICIES}")
