"""A memory tier: an arena (host DRAM or GPU HBM) cut into slots by a slab allocator.

A block's payload takes one slot of the arena (so a payload of a model's block size fills a
slot exactly, and RDMA or zero-copy sends read it in place). Its encoded header (a few hundred
bytes) lives in host memory beside the index, not in the arena: a slab set aside for headers
would hold back a whole slab (1/8 of a 256 MiB tier of 32 MiB slabs) for kilobytes. Header bytes
are bounded to ``capacity / HEADER_BUDGET_DIV``; past that the tier reports no room and the
node evicts. No per-block allocation in the arena: a put takes a slot, a delete gives it back.

The tier knows which blocks sit in each allocator span, so :meth:`victims_for` can name a
span's blocks for the node to evict and let its pages serve another size class: pages return
to the common pool only when their span has no live slot -- no committed block, no
reservation. Each block's namespace is kept in its index entry (see tiers/index.py).

Two-phase writes: :meth:`reserve` hands out a slot (header already written), the caller fills
the payload, then :meth:`commit` indexes it or :meth:`abandon` returns it. A reserved slot is
invisible to readers until commit. Not thread-safe; no I/O (copies only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.block import BlockHeader, checksum
from kvstore.errors import BlockFormatError
from kvstore.node.tiers.base import Slot
from kvstore.node.tiers.index import (
    MAX_HEADER_LEN,
    LruIndex,
    entry_offset,
    entry_payload_len,
    header_fields,
    now_s,
)
from kvstore.node.tiers.order import EvictionOrder
from kvstore.node.tiers.room import pick_victims
from kvstore.node.tiers.shares import TenantShares
from kvstore.node.tiers.slab import SlabAllocator

# Headers may take up to capacity / 16 of host memory beside the arena (6 %): enough for blocks
# down to a few KiB with typical headers; smaller blocks are bounded by header room instead.
HEADER_BUDGET_DIV = 16


class MemoryTier(LruIndex):
    """A :class:`kvstore.node.tiers.base.SlotTier` over ``arena`` (a HostArena or CudaArena)."""

    durable = False
    headers_in_ram = True  # beside the arena: charged to the node's RAM budget

    def __init__(
        self,
        name: str,
        arena,
        slab_size: int,
        order: EvictionOrder | None = None,
        shares: TenantShares | None = None,
    ) -> None:
        super().__init__(order)
        self.shares = shares if shares is not None else TenantShares()  # the node's evictor asks it
        self.name = name
        self.arena = arena
        self.alloc = SlabAllocator(arena.size, slab_size)
        # span (start page) -> {key: encoded header} of the blocks whose payload is in it: one
        # map serves both the header lookup and emptying a span
        self._spans: dict[int, dict[bytes, bytes]] = {}
        self.header_budget = self.alloc.capacity // HEADER_BUDGET_DIV
        self.header_bytes = 0  # committed and reserved headers
        self.payload_bytes = 0
        self.evictions = 0
        self.slab_moves = 0  # spans emptied for another size class (see victims_for)

    # ------------------------------------------------------------------ sizes
    @property
    def capacity_bytes(self) -> int:
        return self.alloc.capacity

    @property
    def used_bytes(self) -> int:
        """Bytes of slots in use (what capacity limits), including slack inside slots."""
        return self.alloc.allocated_bytes

    @property
    def host_buffer(self) -> memoryview | None:
        """The whole arena when it is host memory (registered once for RDMA), else None."""
        return self.arena.view

    def fits(self, payload_len: int, header_len: int) -> bool:
        return 0 < payload_len <= self.alloc.slab_size and 0 < header_len <= min(
            MAX_HEADER_LEN, self.header_budget
        )

    def can_alloc(self, payload_len: int, header_len: int) -> bool:
        """Whether :meth:`reserve` would succeed now without eviction."""
        return self.header_room(header_len) and self.alloc.can_alloc(payload_len)

    def header_room(self, header_len: int) -> bool:
        """Room for one more header: in the tier's header budget and in the node's RAM budget
        (kvstore.node.tiers.ram; short of either, the evictor takes the oldest block)."""
        return self.header_bytes + header_len <= self.header_budget and self.ram_room(header_len)

    # ------------------------------------------------------------------ slabs
    def span_of(self, key: bytes) -> int:
        """The allocator span (see kvstore.node.tiers.slab) holding ``key``'s payload."""
        return self.alloc.span_of(entry_offset(self._index[key]))

    def span_blocks(self, span: int) -> list[bytes]:
        """The committed blocks whose payload sits in ``span`` (a snapshot)."""
        return list(self._spans.get(span, ()))

    def span_only_committed(self, span: int) -> bool:
        """No reservation holds a slot of ``span``: evicting its blocks empties it."""
        return self.alloc.span_used(span) == len(self._spans.get(span, ()))

    # ------------------------------------------------------------------ two-phase write
    def reserve(self, header: bytes, payload_len: int) -> Slot | None:
        """A slot for a block with this header; the header is kept, the payload is not written.
        Returns (payload offset, header), or None when no slab can serve the size or header
        room is spent (the caller evicts and retries). Raises ValueError when the block can
        never fit."""
        if not self.fits(payload_len, len(header)):
            raise ValueError(f"block of {payload_len}+{len(header)} bytes exceeds {self.name} slot size")
        if not self.header_room(len(header)):
            return None
        off = self.alloc.alloc(payload_len)
        if off is None:
            return None
        self.header_bytes += len(header)
        self._charge_ram(self.ram_cost(len(header)))  # refunded by abandon or the index's pop
        return off, bytes(header)

    def commit(
        self, key: bytes, slots: Slot, header_len: int, payload_len: int, demoted: bool = False
    ) -> None:
        """Index a reservation as ``key`` (most recently used). The key must be absent. The
        header's namespace goes into the index entry (see ``namespace``), its parent key to the
        eviction order."""
        if key in self._index:
            raise ValueError(f"{self.name}: key {key.hex()} already indexed")
        ns, parent = header_fields(slots[1])
        self._index_add(key, slots[0], header_len, payload_len, now_s(), ns, parent, demoted)
        self._spans.setdefault(self.alloc.span_of(slots[0]), {})[key] = slots[1]
        self.payload_bytes += payload_len

    def commit_many(self, items: Sequence[tuple[bytes, Slot, int, int, bytes, bytes]]) -> None:
        """:meth:`commit` of each (key, slots, header_len, payload_len, namespace id, parent
        key) in order (the order the eviction order sees them added), with the header's
        fields as the caller decoded them (no decode of the header again) and one access time
        for the batch. All or none: ValueError, before anything is indexed, when a key is
        already indexed or twice in ``items``."""
        index, spans, span_of, add = self._index, self._spans, self.alloc.span_of, self._index_add
        seen: set[bytes] = set()
        for key, *_ in items:  # check every key, then commit: a failure leaves the tier as it was
            if key in index or key in seen:
                raise ValueError(f"{self.name}: key {key.hex()} already indexed")
            seen.add(key)
        atime, total = now_s(), 0
        for key, slots, hlen, plen, ns, parent in items:
            add(key, slots[0], hlen, plen, atime, ns, parent, False)
            spans.setdefault(span_of(slots[0]), {})[key] = slots[1]
            total += plen
        self.payload_bytes += total

    def abandon(self, slots: Slot) -> None:
        """Return a reserved, uncommitted slot."""
        self.alloc.free(slots[0])
        self.header_bytes -= len(slots[1])
        self._charge_ram(-self.ram_cost(len(slots[1])))

    def slot_view(self, slots: Slot, payload_len: int) -> memoryview | None:
        """The payload area of a reserved slot in host memory (written in place by recv_into
        or RDMA WRITE); None on a GPU arena (use :meth:`fill`)."""
        if self.arena.view is None:
            return None
        return self.arena.slice(slots[0], payload_len)

    def fill(self, slots: Slot, payload) -> None:
        """Copy ``payload`` into a reserved slot."""
        self.arena.write(slots[0], memoryview(payload).cast("B"))

    def victims_for(
        self, payload_len: int, header_len: int, evictable: Callable[[bytes], bool]
    ) -> tuple[list[bytes], bool]:
        """What to evict for a block of these sizes (see kvstore.node.tiers.room); a slab
        move is counted in ``slab_moves``."""
        keys, slab_move = pick_victims(self, payload_len, header_len, evictable)
        if slab_move:
            self.slab_moves += 1
        return keys, slab_move

    def protect(self, protected: Callable[[bytes], bool]) -> None:
        """No-op: a memory tier never evicts on its own (the node evicts from it)."""

    # ------------------------------------------------------------------ batched interface
    async def put(self, items: Sequence[tuple[bytes, bytes, object]], demoted: bool = False) -> list[bool]:
        out = []
        for key, header, payload in items:
            if key in self._index:
                out.append(True)
                continue
            mv = memoryview(payload).cast("B")
            slots = self.reserve(header, mv.nbytes)
            if slots is None:
                out.append(False)
                continue
            self.arena.write(slots[0], mv)
            self.commit(key, slots, len(header), mv.nbytes, demoted)
            out.append(True)
        return out

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.remove(k) for k in keys]

    async def read_header(self, key: bytes) -> bytes | None:
        return self.header_sync(key)

    async def intact(self, key: bytes) -> bool:
        """Header decodes and names ``key``; payload matches its checksum. No I/O."""
        try:
            h = BlockHeader.decode(self.header_sync(key))
        except BlockFormatError:
            return False
        return h.key.raw == key and checksum(self.payload_host(key)) == h.checksum

    # ------------------------------------------------------------------ single-key, sync
    def header_sync(self, key: bytes) -> bytes | None:
        e = self._index.get(key)
        return None if e is None else self._spans[self.alloc.span_of(entry_offset(e))][key]

    def lease_view(self, key: bytes) -> tuple[memoryview, int | None]:
        """Read-only payload in place and its offset (host arena), or a private copy and None
        (GPU arena: the bytes must be in host memory to be sent)."""
        e = self._index[key]
        if self.arena.view is not None:
            return self.arena.slice(entry_offset(e), entry_payload_len(e)).toreadonly(), entry_offset(e)
        return memoryview(self.arena.read(entry_offset(e), entry_payload_len(e))), None

    def payload_host(self, key: bytes):
        """The payload as a host bytes-like: in place on host arenas, a copy from a GPU."""
        e = self._index[key]
        if self.arena.view is not None:
            return self.arena.slice(entry_offset(e), entry_payload_len(e))
        return self.arena.read(entry_offset(e), entry_payload_len(e))

    def slot_size(self, key: bytes) -> int:
        return self.alloc.slot_size(entry_offset(self._index[key]))

    def remove(self, key: bytes, evicted: bool = False) -> bool:
        """Free ``key``'s slot now (an eviction when ``evicted``); False when absent."""
        e = self._index_pop(key)
        if e is None:
            return False
        self.evictions += evicted
        self.payload_bytes -= entry_payload_len(e)
        span = self.alloc.span_of(entry_offset(e))
        blocks = self._spans[span]
        self.header_bytes -= len(blocks.pop(key))
        if not blocks:
            del self._spans[span]
        self.alloc.free(entry_offset(e))
        return True

    def stats(self) -> dict:
        return {
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "payload_bytes": self.payload_bytes,
            "blocks": len(self._index),
            "evictions": self.evictions,
            "free_slabs": self.alloc.free_slabs,
            "free_pages": self.alloc.free_pages,
            "page_bytes": self.alloc.page,
            "slab_moves": self.slab_moves,
            "header_bytes": self.header_bytes,
            # slack inside slots + slots of assigned slabs no block holds: DRAM held but unused
            "free_slot_bytes": self.alloc.free_slot_bytes(),
            "waste_bytes": self.used_bytes - self.payload_bytes + self.alloc.free_slot_bytes(),
            "pinned_memory": bool(getattr(self.arena, "pinned", False)),
            **self.eviction_stats(),
            "share_refusals": self.shares.refused,
        }

    def check(self) -> None:
        """Integrity check for tests: allocator consistent, index within capacity."""
        self.alloc.check()
        assert self.used_bytes <= self.capacity_bytes
        assert self.payload_bytes == sum(entry_payload_len(e) for e in self._index.values())
        assert sum(len(s) for s in self._spans.values()) == len(self._index)
        for key, e in self._index.items():
            assert key in self._spans[self.alloc.span_of(entry_offset(e))]
        assert self.header_bytes >= sum(len(h) for s in self._spans.values() for h in s.values())

    async def close(self) -> None:
        self._index_clear()
        self._spans.clear()
        self.arena.close()
