"""Eviction: how a node makes room in a memory tier by moving blocks down (hbm -> dram ->
disk -> dropped), first to go first in each tier's eviction order (``[eviction] policy``,
kvstore.node.tiers.order; the disk tier evicts on its own in the same order). Same
threading rules as the node: one event loop.

Held (leased, in-flight) and pinned blocks are never chosen, nor blocks another namespace
keeps by its share (kvstore.node.tiers.shares). A victim is held while it is
copied down, so its slot is not freed under the copy. When a block's size class has no free
slot, whole spans may be emptied for it (see kvstore.node.tiers.room); their pages join the
common pool only once none of their slots is live.
"""

from __future__ import annotations

from kvstore.node.state import NodeState
from kvstore.node.tiers.base import SlotTier, Tier
from kvstore.node.tiers.stack import TierStack
from kvstore.node.tiers.tasks import Finishing, to_the_end

# Rounds of eviction per allocation (a round is one block or whole spans): bounded work.
_MAX_EVICTIONS_PER_ALLOC = 64


class Evictor:
    """Makes room in the memory tiers of ``tiers`` (top first) by moving blocks down to the
    next memory tier, then to the disk (the bottom tier, which evicts on its own), or dropping
    them when there is no tier below. From the node's ``state``: its holds and pins (what may
    not move), its dirty keys (write-back, not yet on disk: cleared once written down or
    dropped), its doomed keys (deleted while held: a copy made below during the delete is
    dropped), its ``unhold`` (it frees a key deleted meanwhile) and its counters
    (evictions_<tier>, by reason evictions_<tier>_write and evictions_<tier>_promotion,
    slab_moves_<tier>, demotions, dropped); ``finishing``: the node's tracker of copies left
    finishing by cancelled callers (its own when not given)."""

    def __init__(self, tiers: TierStack, state: NodeState, finishing: Finishing | None = None) -> None:
        self._memory = tiers.memory
        self._disk = tiers.disk
        self._leases = state.leases
        self._pinned = state.pinned
        self._dirty = state.dirty
        self._doomed = state.doomed
        self._unhold = state.unhold
        self._counters = state.counters
        self._finishing = finishing if finishing is not None else Finishing()

    def protected(self, key: bytes) -> bool:
        """Whether ``key`` may not be evicted from any tier: held (leased, in a copy) or pinned."""
        return self._leases.held(key) or key in self._pinned

    def _below(self, tier: SlotTier) -> list[Tier]:
        """The tiers under a memory tier, next one first."""
        below: list[Tier] = [*self._memory[self._memory.index(tier) + 1 :]]
        return below if self._disk is None else [*below, self._disk]

    def _pick(self, tier: SlotTier, plen: int, hlen: int, clean_only: bool, ns: bytes | None) -> list[bytes]:
        below = self._below(tier)
        shares = tier.shares  # type: ignore[attr-defined]

        def evictable(key: bytes) -> bool:
            # clean: the next tier down already holds it (and it is not dirty), so dropping it
            # here loses nothing. Only the next tier counts: an HBM block on disk but not in
            # DRAM moves to DRAM, the faster of the two places it could be read from later.
            if self.protected(key):
                return False
            if clean_only and not (bool(below) and key in below[0] and key not in self._dirty):
                return False
            return shares.allows(tier, key, ns)

        keys, slab_move = tier.victims_for(plen, hlen, evictable)
        if slab_move:
            self._counters[f"slab_moves_{tier.name}"] += 1
        return keys

    def room_without_io(self, tier: SlotTier, plen: int, hlen: int, ns: bytes | None = None) -> bool:
        """Make room in ``tier`` for a block of these sizes (of namespace ``ns``) by dropping
        only blocks the next tier down also holds (no writes). False when that is not enough."""
        for _ in range(_MAX_EVICTIONS_PER_ALLOC):
            if tier.can_alloc(plen, hlen):
                return True
            victims = self._pick(tier, plen, hlen, True, ns)
            if not victims:
                return False
            for victim in victims:
                tier.remove(victim, evicted=True)
                self._counters[f"evictions_{tier.name}"] += 1
                self._counters[f"evictions_{tier.name}_promotion"] += 1
        return tier.can_alloc(plen, hlen)

    async def make_room(self, tier: SlotTier, plen: int, hlen: int, ns: bytes | None = None) -> bool:
        """Evict blocks of ``tier`` in its eviction order (moving them down) until a block of
        these sizes (of namespace ``ns``, for the shares) fits. False when protected blocks
        leave too little room."""
        for _ in range(_MAX_EVICTIONS_PER_ALLOC):
            if tier.can_alloc(plen, hlen):
                return True
            victims = self._pick(tier, plen, hlen, False, ns)
            if not victims:
                self._counters[f"room_refused_{tier.name}"] += 1
                return False
            for victim in victims:
                await self._demote(tier, victim)
        return tier.can_alloc(plen, hlen)

    async def _demote(self, tier: SlotTier, key: bytes) -> None:
        """Move ``key`` out of ``tier`` to the next tier down (or drop it at the bottom)."""
        below = self._below(tier)
        self._leases.hold(key)  # now, not when the task starts: the slot stays put from here on
        # to its end even when the caller is cancelled: a disk thread reads the slot until
        # then, and the hold that keeps it in place goes only after it
        await to_the_end(self._copy_held(tier, key, below), self._finishing)
        if key in tier and not self.protected(key):
            tier.remove(key, evicted=True)
            self._counters[f"evictions_{tier.name}"] += 1
            self._counters[f"evictions_{tier.name}_write"] += 1
            if not any(key in t for t in below):
                self._counters["dropped"] += 1
                self._dirty.discard(key)

    async def _copy_held(self, tier: SlotTier, key: bytes, below: list[Tier]) -> None:
        """Copy ``key`` down where the tier below lacks it (or it is dirty). ``key`` is held
        (its slot is not freed under the copy) and is unheld here when the copy is over."""
        try:
            if (below and key not in below[0]) or key in self._dirty:
                await self._copy_down(tier, key, below)
            # deleted during the copy (held, so only hidden): delete found no disk copy then,
            # and the one just made must not outlive it (memory copies go at the last unhold)
            if key in self._doomed and self._disk is not None and key in self._disk:
                await self._disk.delete([key])
        finally:
            self._unhold(key)

    async def _copy_down(self, tier: SlotTier, key: bytes, below: list[Tier]) -> None:
        """Put ``key`` into the next tier down that has room: a memory tier when room can be
        made there (recursively), else the bottom tier (which evicts on its own)."""
        if not below:
            return
        hdr = tier.header_sync(key)
        payload = tier.payload_host(key)
        nxt = below[0]
        if nxt is not self._disk:
            mem = self._memory[self._memory.index(tier) + 1]  # nxt, as the memory tier it is
            ns = tier.namespace(key)
            if mem.fits(len(payload), len(hdr)) and await self.make_room(mem, len(payload), len(hdr), ns):
                await mem.put([(key, hdr, payload)], demoted=True)
                self._counters["demotions"] += 1
                return
            below = below[1:]
            if not below:
                return
            nxt = below[0]
            if key in nxt and key not in self._dirty:
                return  # write-through already put it there
        ok = await nxt.put([(key, hdr, payload)], demoted=True)
        if ok[0]:
            self._dirty.discard(key)
            self._counters["demotions"] += 1
