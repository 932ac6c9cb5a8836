"""Eviction: how a node makes room in a memory tier by moving least recently used blocks down
(hbm -> dram -> disk -> dropped). A mixin of :class:`kvstore.node.store.NodeStore` (it uses the node's
tiers, leases, pins, dirty set and counters); same threading rules as the node: one event loop.

Held (leased, in-flight) and pinned blocks are never chosen. A victim is held while it is
copied down, so its slot is not freed under the copy. When a block's size class has no free
slot, a whole slab may be emptied for it (see :meth:`NodeEviction._pick_victims`); the slab
joins the common pool only once none of its slots is live.
"""

from __future__ import annotations

from kvstore.node.tiers.memory import MemoryTier

# Rounds of eviction per allocation (a round is one block or one whole slab): bounded work.
_MAX_EVICTIONS_PER_ALLOC = 64
# How far down the LRU order a round looks for an evictable block or slab.
_VICTIM_SCAN = 1024


class NodeEviction:
    def _room_without_io(self, tier: MemoryTier, plen: int, hlen: int) -> bool:
        """Make room in ``tier`` by dropping only blocks that are also on disk (no writes)."""
        for _ in range(_MAX_EVICTIONS_PER_ALLOC):
            if tier.can_alloc(plen, hlen):
                return True
            victims = self._pick_victims(tier, plen, hlen, clean_only=True)
            if not victims:
                return False
            for victim in victims:
                tier.remove(victim)
                tier.evictions += 1
                self.counters[f"evictions_{tier.name}"] += 1
        return tier.can_alloc(plen, hlen)

    def _pick_victims(self, tier: MemoryTier, plen: int, hlen: int, clean_only: bool) -> list[bytes]:
        """What to evict next so that a block of these sizes can fit, LRU first.

        Header room short, or a slot of the wanted class free: the least recently used
        evictable block. Otherwise the wanted class's own oldest block -- unless the pages of
        another class's span (with its neighbours when the wanted class needs a longer run of
        pages) hold only blocks older than that one: then those spans are emptied and their
        pages return to the common pool, where the wanted class takes them. So memory moves to
        the classes whose blocks are used more recently, and a class with no span at all takes
        the pages of the oldest blocks. A span with a held or pinned block or a reservation is
        never emptied. Empty when nothing can be evicted."""
        evictable = (k for k in tier.victims(_VICTIM_SCAN) if self._evictable(tier, k, clean_only))
        if not tier.header_room(hlen) or tier.alloc.can_alloc(plen):
            return [k for k, _ in zip(evictable, range(1))]
        # the evictable blocks older than the class's own oldest one (or all in reach)
        want = tier.alloc.class_of(plen)
        scan, own = [], None
        for k in evictable:
            scan.append(k)
            if tier.alloc.class_of(tier.slot_size(k)) == want:
                own = len(scan) - 1
                break
        pos = {k: i for i, k in enumerate(scan)}
        limit = own if own is not None else len(scan)
        tried: set[int] = set()
        for k in scan[:limit]:
            span = tier.span_of(k)
            if span in tried:
                continue
            tried.add(span)
            spans = tier.alloc.spans_to_free(span, plen)
            blocks = [b for s in spans for b in tier.span_blocks(s)]
            # all older than the class's own victim (any age when the class has none in reach)
            if all(tier.span_only_committed(s) for s in spans) and all(
                pos.get(b, limit) < limit for b in blocks
            ):
                self.counters[f"slab_moves_{tier.name}"] += 1
                tier.slab_moves += 1
                return blocks
        return [scan[own]] if own is not None else []

    def _evictable(self, tier: MemoryTier, key: bytes, clean_only: bool) -> bool:
        return not self._protected(key) and (not clean_only or self._clean_below(tier, key))

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
            victims = self._pick_victims(tier, plen, hlen, clean_only=False)
            if not victims:
                return False
            for victim in victims:
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
