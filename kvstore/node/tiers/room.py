"""Which blocks of a memory tier to evict so that a block of a given size can be reserved:
LRU blocks, or whole allocator spans handed from one size class to another.

Used by :meth:`kvstore.node.tiers.memory.MemoryTier.victims_for`; the node decides which keys
may go (``evictable``: not held, not pinned, maybe only clean ones) and where they go.
"""

from __future__ import annotations

from collections.abc import Callable

# How far down the LRU order one pick looks for an evictable block or span.
VICTIM_SCAN = 1024
# A pick first looks this far, and the whole VICTIM_SCAN only when that finds no block to
# take (or, for a slab move, none of the wanted class): the snapshot of the order costs per
# entry (the prefix orders pop and push back a heap entry each), and the first evictable
# block is nearly always among the first few. The former bench/store_throughput.py (now peers.py --policies), 2 MiB PUTs past the
# DRAM capacity, 8 clients: prefix-marginal 0.41 GB/s against LRU's 1.12 with a full scan.
FIRST_SCAN = 16  # (a single victim takes one step of the order: ``first_victim``)


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
    alloc = tier.alloc
    single = not tier.header_room(hlen) or alloc.can_alloc(plen)
    want = None if single else alloc.class_of(plen)
    asked: dict[bytes, bool] = {}  # each key asked once (``evictable`` counts refusals)

    def ok(k: bytes) -> bool:
        r = asked.get(k)
        if r is None:
            r = asked[k] = evictable(k)
        return r

    scan: list[bytes] = []
    own = None
    if single:  # one step of the order, not a snapshot
        first = tier.first_victim(evictable, VICTIM_SCAN)
        return ([first] if first is not None else []), False
    for limit in (FIRST_SCAN, VICTIM_SCAN):  # the same answer as one scan of VICTIM_SCAN
        order = list(tier.victims(limit))
        # the evictable blocks older than the class's own oldest one (or all in reach)
        scan, own = [], None
        for k in order:
            if not ok(k):
                continue
            scan.append(k)
            if alloc.class_of(tier.slot_size(k)) == want:
                own = len(scan) - 1
                break
        if own is not None or len(order) < limit:
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
