"""What a tier offers the node: the :class:`Tier` protocol every tier implements,
:class:`SlotTier`, the part a memory tier adds (slots written and read in place), and
:class:`BottomTier`, the part the disk tier adds (versions of its copies).

A tier stores (key, encoded header, payload) triples and keeps its own LRU order and index
(see kvstore.node.tiers.index). Batched calls take and return lists in input order. The node
owns placement and policy: which tier takes a block, when a block moves down, which blocks may
not be evicted (leases, pins). The node drives tiers only through these protocols.

Methods without ``async`` never do I/O; the async ones may run I/O on threads but never block
the event loop. Not thread-safe: call from the event loop that opened the node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from kvstore.results import Status

# A reserved slot of a SlotTier: (payload offset in the tier, encoded header). Opaque to the
# node, which hands it back to the tier that gave it.
Slot = tuple[int, bytes]


class Tier(Protocol):
    """Every tier: an index of whole blocks with reads, writes, deletes and usage."""

    name: str

    @property
    def capacity_bytes(self) -> int:
        """Bytes the tier may hold (payloads, and headers where the tier counts them)."""
        ...

    @property
    def used_bytes(self) -> int:
        """Bytes in use now; never above :attr:`capacity_bytes`."""
        ...

    @property
    def durable(self) -> bool:
        """Whether a block :meth:`put` reported stored is on stable storage."""
        ...

    def __contains__(self, key: bytes) -> bool:
        """Whether ``key`` is stored (committed) here. No I/O."""
        ...

    def __len__(self) -> int: ...

    def keys(self) -> Iterator[bytes]:
        """Stored keys, least recently used first (iterate before mutating the tier)."""
        ...

    def payload_len(self, key: bytes) -> int:
        """Payload bytes of a stored key (KeyError when absent). No I/O."""
        ...

    def atime(self, key: bytes) -> int:
        """Last access of a stored key, wall-clock seconds (KeyError when absent)."""
        ...

    def namespace(self, key: bytes) -> bytes | None:
        """The raw namespace id in the stored header of ``key``; None when absent or when the
        header has none. No I/O, no decode: it is kept in the index when the block is stored
        (or its header read at open)."""
        ...

    def touch(self, key: bytes) -> None:
        """Mark ``key`` most recently used (no-op when absent)."""
        ...

    def victims(self, limit: int = 256) -> Iterator[bytes]:
        """Up to ``limit`` eviction candidates, least recently used first (a snapshot)."""
        ...

    def first_victim(self, accept: Callable[[bytes], bool], limit: int) -> bytes | None:
        """The first of the first ``limit`` eviction candidates ``accept`` takes, or None."""
        ...

    def fits(self, payload_len: int, header_len: int) -> bool:
        """Whether a block of these sizes can ever be stored here (room aside)."""
        ...

    def protect(self, protected: Callable[[bytes], bool]) -> None:
        """Never drop a key for which ``protected`` is true when the tier evicts on its own to
        make room for a :meth:`put` (a tier that never evicts on its own ignores it)."""
        ...

    async def read_header(self, key: bytes) -> bytes | None:
        """The stored encoded header, None when absent."""
        ...

    async def intact(self, key: bytes) -> bool:
        """Whether this tier's copy of a stored ``key`` reads back whole: its header decodes
        and names ``key``, its payload matches the header's checksum. Drops nothing."""
        ...

    async def put(self, items: Sequence[tuple[bytes, bytes, object]], demoted: bool = False) -> list[bool]:
        """Store (key, header, payload) triples; True where stored (or already there), False
        where there is no room. The caller keeps each payload unchanged until this returns.
        ``demoted``: the blocks move down from a tier above (the eviction order's
        ``add(..., demoted)``), not a client's write."""
        ...

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        """Remove keys; False where absent."""
        ...

    def stats(self) -> dict:
        """Usage and counters (plain JSON-able)."""
        ...

    def check(self) -> None:
        """Integrity check for tests: raises AssertionError when the tier is inconsistent."""
        ...

    async def close(self) -> None:
        """Flush and release the tier's resources. Nothing may be called after."""
        ...


class BottomTier(Tier, Protocol):
    """The tier under the memory tiers (disk). A copy read from it may move up into a memory
    tier after the read's await, so it names its stored copies."""

    async def get_into(self, keys: Sequence[bytes], bufs: Sequence) -> list[tuple[Status, bytes | None]]:
        """Copy each payload into its buffer (one copy, verified against its checksum): the
        node's way to a disk copy (kvstore/node/disk_reads.py; memory copies are read in place
        under a lease). Per key: (HIT, header), (MISS, None), (BUF_TOO_SMALL, header) or
        (CORRUPT, None); a corrupt copy is deleted before return."""
        ...

    def version(self, key: bytes) -> int | None:
        """The version of the stored copy of ``key``, None when absent: new for every copy
        stored, so equal before and after an await only when no delete, eviction or new
        store of ``key`` completed in between. No I/O."""
        ...


class SlotTier(Tier, Protocol):
    """A memory tier (DRAM, HBM): payloads sit in slots of one arena, written and read in
    place. A slot is reserved, filled, then committed (visible) or abandoned."""

    @property
    def host_buffer(self) -> memoryview | None:
        """The whole arena when it is host memory (to register once for RDMA), else None."""
        ...

    def can_alloc(self, payload_len: int, header_len: int) -> bool:
        """Whether :meth:`reserve` would succeed now, without eviction."""
        ...

    def reserve(self, header: bytes, payload_len: int) -> Slot | None:
        """A slot for a block with this header, invisible to readers; None when there is no
        room now (the node evicts and retries). ValueError when the block never fits."""
        ...

    def slot_view(self, slot: Slot, payload_len: int) -> memoryview | None:
        """The writable host memory of a reserved slot's payload, None when the slot is not in
        host memory (write it with :meth:`fill`)."""
        ...

    def fill(self, slot: Slot, payload) -> None:
        """Copy ``payload`` into a reserved slot."""
        ...

    def commit(self, key: bytes, slot: Slot, header_len: int, payload_len: int) -> None:
        """Make a filled slot visible as ``key`` (most recently used). ``key`` must be absent."""
        ...

    def abandon(self, slot: Slot) -> None:
        """Give back a reserved, uncommitted slot."""
        ...

    def header_sync(self, key: bytes) -> bytes | None:
        """The stored encoded header, None when absent. No I/O."""
        ...

    def payload_host(self, key: bytes):
        """A stored payload as a host bytes-like: in place in host memory, a copy otherwise.
        Valid until the block is removed."""
        ...

    def lease_view(self, key: bytes) -> tuple[memoryview, int | None]:
        """A read-only view of a stored payload for a lease, and its offset in
        :attr:`host_buffer`: in place (valid until the slot is freed) when the arena is host
        memory, else a private copy and None."""
        ...

    def victims_for(
        self, payload_len: int, header_len: int, evictable: Callable[[bytes], bool]
    ) -> tuple[list[bytes], bool]:
        """What to evict next so that a block of these sizes can be reserved, least recently
        used first, among keys ``evictable`` allows; and whether they empty whole spans for
        another size class (a slab move). Empty when nothing evictable helps."""
        ...

    def remove(self, key: bytes, evicted: bool = False) -> bool:
        """Free a stored block's slot now (counted as an eviction with ``evicted``); False
        when absent. The caller makes sure nobody reads the slot any more."""
        ...
