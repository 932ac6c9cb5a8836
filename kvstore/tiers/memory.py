"""A memory tier: an arena (host DRAM or GPU HBM) cut into slots by a slab allocator.

A block takes two slots of the same arena: one for its payload (so a payload of a model's block
size fills a slot exactly, and RDMA or zero-copy sends read it in place) and a small one for its
encoded header. No per-block allocation: a put takes slots from the allocator, a delete gives
them back.

Two-phase writes: :meth:`reserve` hands out a slot (header already written), the caller fills
the payload, then :meth:`commit` indexes it or :meth:`abandon` returns it. A reserved slot is
invisible to readers until commit. Not thread-safe; no I/O (copies only).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvstore.results import Status
from kvstore.tiers.base import (
    MAX_HEADER_LEN,
    LruIndex,
    entry_header_len,
    entry_header_offset,
    entry_offset,
    entry_payload_len,
    now_s,
    pack_entry,
)
from kvstore.tiers.slab import SlabAllocator


class MemoryTier(LruIndex):
    def __init__(self, name: str, arena, slab_size: int) -> None:
        self.name = name
        self.arena = arena
        self.alloc = SlabAllocator(arena.size, slab_size)
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self.payload_bytes = 0
        self.evictions = 0

    # ------------------------------------------------------------------ sizes
    @property
    def capacity_bytes(self) -> int:
        return self.alloc.capacity

    @property
    def used_bytes(self) -> int:
        """Bytes of slots in use (what capacity limits), including slack inside slots."""
        return self.alloc.allocated_bytes

    @property
    def max_block_bytes(self) -> int:
        return self.alloc.slab_size

    def fits(self, payload_len: int, header_len: int) -> bool:
        return 0 < payload_len <= self.alloc.slab_size and 0 < header_len <= min(
            MAX_HEADER_LEN, self.alloc.slab_size
        )

    def can_alloc(self, payload_len: int, header_len: int) -> bool:
        """Whether :meth:`reserve` would succeed now without eviction."""
        a = self.alloc
        if a.class_of(payload_len) == a.class_of(header_len):
            return a.can_alloc_n(payload_len, 2)
        return a.can_alloc(payload_len) and a.can_alloc(header_len)

    # ------------------------------------------------------------------ two-phase write
    def reserve(self, header: bytes, payload_len: int) -> tuple[int, int] | None:
        """Slots for a block with this header; the header is written, the payload is not.
        Returns (payload offset, header offset), or None when no slab can serve the sizes
        (the caller evicts and retries). Raises ValueError when the block can never fit."""
        if not self.fits(payload_len, len(header)):
            raise ValueError(f"block of {payload_len}+{len(header)} bytes exceeds {self.name} slot size")
        off = self.alloc.alloc(payload_len)
        if off is None:
            return None
        hoff = self.alloc.alloc(len(header))
        if hoff is None:
            self.alloc.free(off)
            return None
        self.arena.write(hoff, header)
        return off, hoff

    def commit(self, key: bytes, slots: tuple[int, int], header_len: int, payload_len: int) -> None:
        """Index reserved slots as ``key`` (most recently used). The key must be absent."""
        if key in self._index:
            raise ValueError(f"{self.name}: key {key.hex()} already indexed")
        self._index[key] = pack_entry(slots[0], slots[1], header_len, payload_len, now_s())
        self.payload_bytes += payload_len

    def abandon(self, slots: tuple[int, int]) -> None:
        """Return reserved, uncommitted slots."""
        self.alloc.free(slots[0])
        self.alloc.free(slots[1])

    def writable(self, offset: int, payload_len: int):
        """The payload area of a reserved slot (a memoryview on host, a tensor on GPU)."""
        return self.arena.slice(offset, payload_len)

    # ------------------------------------------------------------------ batched interface
    async def put(self, items: Sequence[tuple[bytes, bytes, object]]) -> list[bool]:
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
            self.commit(key, slots, len(header), mv.nbytes)
            out.append(True)
        return out

    async def get_into(self, keys: Sequence[bytes], bufs: Sequence) -> list[tuple[Status, bytes | None]]:
        """Per key: (HIT, header) with the payload copied, (MISS, None) or (BUF_TOO_SMALL, header)."""
        out: list[tuple[Status, bytes | None]] = []
        for k, b in zip(keys, bufs):
            e = self._index.get(k)
            if e is None:
                out.append((Status.MISS, None))
            elif memoryview(b).nbytes < entry_payload_len(e):
                out.append((Status.BUF_TOO_SMALL, self.header_sync(k)))
            else:
                out.append((Status.HIT, self.read_into(k, b)))
        return out

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.remove(k) for k in keys]

    async def read_header(self, key: bytes) -> bytes | None:
        return self.header_sync(key)

    # ------------------------------------------------------------------ single-key, sync
    def read_into(self, key: bytes, buf) -> bytes | None:
        """Copy the payload into ``buf`` (at least payload_len bytes); return the header."""
        e = self._index.get(key)
        if e is None:
            return None
        self.arena.read_into(entry_offset(e), buf, entry_payload_len(e))
        return self.arena.read(entry_header_offset(e), entry_header_len(e))

    def header_sync(self, key: bytes) -> bytes | None:
        e = self._index.get(key)
        if e is None:
            return None
        return self.arena.read(entry_header_offset(e), entry_header_len(e))

    def payload_view(self, key: bytes):
        """The stored payload in place (valid until the block is removed) and its offset."""
        e = self._index[key]
        return self.arena.slice(entry_offset(e), entry_payload_len(e)), entry_offset(e)

    def payload_host(self, key: bytes):
        """The payload as a host bytes-like: in place on host arenas, a copy from a GPU."""
        e = self._index[key]
        if self.arena.view is not None:
            return self.arena.slice(entry_offset(e), entry_payload_len(e))
        return self.arena.read(entry_offset(e), entry_payload_len(e))

    def slot_size(self, key: bytes) -> int:
        return self.alloc.slot_size(entry_offset(self._index[key]))

    def remove(self, key: bytes) -> bool:
        e = self._index.pop(key, None)
        if e is None:
            return False
        self.payload_bytes -= entry_payload_len(e)
        self.alloc.free(entry_offset(e))
        self.alloc.free(entry_header_offset(e))
        return True

    def stats(self) -> dict:
        return {
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "payload_bytes": self.payload_bytes,
            "blocks": len(self._index),
            "evictions": self.evictions,
            "free_slabs": self.alloc.free_slabs,
            "pinned_memory": bool(getattr(self.arena, "pinned", False)),
        }

    def check(self) -> None:
        """Integrity check for tests: allocator consistent, index within capacity."""
        self.alloc.check()
        assert self.used_bytes <= self.capacity_bytes
        assert self.payload_bytes == sum(entry_payload_len(e) for e in self._index.values())

    def close(self) -> None:
        self._index.clear()
        self.arena.close()
