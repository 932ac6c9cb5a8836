"""Eviction: how a node makes room in a memory tier by moving least recently used blocks down
(hbm -> dram -> disk -> dropped). A mixin of :class:`kvstore.node.NodeStore` (it uses the node's
tiers, leases, pins, dirty set and counters); same threading rules as the node: one event loop.

Held (leased, in-flight) and pinned blocks are never chosen. A victim is held while it is
copied down, so its slot is not freed under the copy.
"""

from __future__ import annotations

from kvstore.tiers.memory import MemoryTier

_MAX_EVICTIONS_PER_ALLOC = 64


class NodeEviction:
    def _room_without_io(self, tier: MemoryTier, plen: int, hlen: int) -> bool:
        """Make room in ``tier`` by dropping only blocks that are also on disk (no writes)."""
        for _ in range(_MAX_EVICTIONS_PER_ALLOC):
            if tier.can_alloc(plen, hlen):
                return True
            victim = self._pick_victim(tier, plen, clean_only=True)
            if victim is None:
                return False
            tier.remove(victim)
            tier.evictions += 1
            self.counters[f"evictions_{tier.name}"] += 1
        return tier.can_alloc(plen, hlen)

    def _pick_victim(self, tier: MemoryTier, nbytes: int, clean_only: bool) -> bytes | None:
        """LRU-first evictable key of ``tier``, preferring one whose slot class fits ``nbytes``."""
        want = tier.alloc.class_of(nbytes)
        first = None
        for k in tier.victims():
            if self._protected(k) or (clean_only and not self._clean_below(tier, k)):
                continue
            if tier.alloc.class_of(tier.slot_size(k)) == want:
                return k
            if first is None:
                first = k
        return first

    def _clean_below(self, tier: MemoryTier, key: bytes) -> bool:
        """The next tier down already holds ``key`` (and it is not dirty): dropping it here
        loses nothing. Only the next tier counts: an HBM block on disk but not in DRAM moves
        to DRAM, the faster of the two places it could be read from later."""
        below = self.tiers[self.tiers.index(tier) + 1 :]
        return bool(below) and key in below[0] and key not in self.dirty

    async def _make_room(self, tier: MemoryTier, plen: int, hlen: int) -> bool:
        """Evict LRU blocks of ``tier`` (moving them down) until a block of these sizes fits."""
        for _ in range(_MAX_EVICTIONS_PER_ALLOC):
            if tier.can_alloc(plen, hlen):
                return True
            victim = self._pick_victim(tier, plen, clean_only=False)
            if victim is None:
                return False
            await self._demote(tier, victim)
        return tier.can_alloc(plen, hlen)

    async def _demote(self, tier: MemoryTier, key: bytes) -> None:
        """Move ``key`` out of ``tier`` to the next tier down (or drop it at the bottom)."""
        below = self.tiers[self.tiers.index(tier) + 1 :]
        self.leases.hold(key)
        try:
            if (below and key not in below[0]) or key in self.dirty:
                await self._copy_down(tier, key, below)
        finally:
            self._unhold(key)
        if key in tier and not self._protected(key):
            tier.remove(key)
            tier.evictions += 1
            self.counters[f"evictions_{tier.name}"] += 1
            if not any(key in t for t in below):
                self.counters["dropped"] += 1
                self.dirty.discard(key)

    async def _copy_down(self, tier: MemoryTier, key: bytes, below: list) -> None:
        if not below:
            return
        hdr = tier.header_sync(key)
        payload = tier.payload_host(key)
        nxt = below[0]
        if isinstance(nxt, MemoryTier):
            if nxt.fits(len(payload), len(hdr)) and await self._make_room(nxt, len(payload), len(hdr)):
                await nxt.put([(key, hdr, payload)])
                self.counters["demotions"] += 1
                return
            below = below[1:]
            if not below:
                return
            nxt = below[0]
            if key in nxt and key not in self.dirty:
                return  # write-through already put it there
        ok = await nxt.put([(key, hdr, payload)])
        if ok[0]:
            self.dirty.discard(key)
            self.counters["demotions"] += 1
