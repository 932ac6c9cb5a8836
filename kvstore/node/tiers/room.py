"""Which blocks of a memory tier to evict so that a block of a given size can be reserved:
LRU blocks, or whole allocator spans handed from one size class to another.

Used by :meth:`kvstore.node.tiers.memory.MemoryTier.victims_for`; the node decides which keys
may go (``evictable``: not held, not pinned, maybe only clean ones) and where they go.
"""

from __future__ import annotations

from collections.abc import Callable

# How far down the LRU order one pick looks for an evictable block or span.
VICTIM_SCAN = 1024


def pick_victims(tier, plen: int, hlen: int, evictable: Callable[[bytes], bool]) -> tuple[list[bytes], bool]:
    """What to evict next from ``tier`` (a MemoryTier; untyped, as memory.py imports this
    module) so that a block of these sizes can fit, LRU first, and whether it is a slab
    move (whole spans emptied for another size class).

    Header room short, or a slot of the wanted class free: the least recently used
    evictable block. Otherwise the wanted class's own oldest block -- unless the pages of
    another class's span (with its neighbours when the wanted class needs a longer run of
    pages) hold only blocks older than that one: then those spans are emptied and their
    pages return to the common pool, where the wanted class takes them. So memory moves to
    the classes whose blocks are used more recently, and a class with no span at all takes
    the pages of the oldest blocks. A span with a block ``evictable`` refuses, or with a
    reservation, is never emptied. Empty when nothing can be evicted."""
    candidates = (k for k in tier.victims(VICTIM_SCAN) if evictable(k))
    alloc = tier.alloc
    if not tier.header_room(hlen) or alloc.can_alloc(plen):
        return [k for k, _ in zip(candidates, range(1))], False
    # the evictable blocks older than the class's own oldest one (or all in reach)
    want = alloc.class_of(plen)
    scan, own = [], None
    for k in candidates:
        scan.append(k)
        if alloc.class_of(tier.slot_size(k)) == want:
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
        spans = alloc.spans_to_free(span, plen)
        blocks = [b for s in spans for b in tier.span_blocks(s)]
        # all older than the class's own victim (any age when the class has none in reach)
        if all(tier.span_only_committed(s) for s in spans) and all(pos.get(b, limit) < limit for b in blocks):
            return blocks, True
    return ([scan[own]] if own is not None else []), False
