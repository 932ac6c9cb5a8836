"""Leases: a reader's claim that keeps a block's payload in place until released or expired,
and the holds behind them. A leased memory block is read in place; a disk-only block is read
once, into a new top-tier slot when the node's placement promotes it, else into a private
buffer. Same threading rules as the node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from kvstore.block import BlockHeader
from kvstore.keys import BlockKey
from kvstore.node.leases import Lease, LeaseTable
from kvstore.node.reads import Reader
from kvstore.node.tiers.base import Slot, SlotTier, Tier
from kvstore.results import Status


class Leaser:
    """Leases over ``memory`` (top first) and ``disk`` tiers, recorded in ``leases``.
    ``where(key)``: the highest tier holding a visible key; ``reader``: reads disk copies
    (verified, counted); ``promotion_slot(key, header, payload_len)``: the node's placement,
    a reserved top-tier slot for a disk block moving up or None; ``promote_on_read``: whether
    disk hits move up at all. ``doomed`` (deleted while held) and ``dirty`` are the node's key
    sets; a doomed key is freed at its last hold."""

    def __init__(
        self,
        memory: list[SlotTier],
        disk: Tier | None,
        leases: LeaseTable,
        where: Callable[[bytes], Tier | None],
        reader: Reader,
        promotion_slot: Callable[[bytes, bytes, int], Slot | None],
        promote_on_read: bool,
        doomed: set[bytes],
        dirty: set[bytes],
        counters: Counter[str],
    ) -> None:
        self._memory = memory
        self._disk = disk
        self._leases = leases
        self._where = where
        self._reader = reader
        self._promotion_slot = promotion_slot
        self._promote_on_read = promote_on_read
        self._doomed = doomed
        self._dirty = dirty
        self._counters = counters

    async def lease(
        self, keys: Sequence[BlockKey], ttl_s: float | None = None, max_read_bytes: int | None = None
    ) -> list[Lease | None]:
        """Claim each block for reading: its payload stays put (not evicted, overwritten or
        freed) until :meth:`release` or the TTL (the caller sweeps expired ones first). A
        disk-only block is first brought into DRAM (verified) when there is room, else copied
        privately. None where absent or corrupt, and (with ``max_read_bytes``) where reading it
        from disk would take this call's disk reads past that many bytes: the buffers one call
        allocates are bounded."""
        out: list[Lease | None] = []
        read = 0
        for key in keys:
            t = self._where(key.raw)
            if t is not None and t is self._disk:
                plen = t.payload_len(key.raw)
                if max_read_bytes is not None and read + plen > max_read_bytes:
                    self._counters["lease_over_bound"] += 1
                    out.append(None)
                    continue
                read += plen
                out.append(await self._lease_from_disk(key, plen, ttl_s))
                continue
            if t is None:
                out.append(None)
                continue
            self._counters[f"hits_{t.name}"] += 1
            out.append(self._lease_in(t, key, BlockHeader.decode(t.header_sync(key.raw)), ttl_s))
        return out

    def _lease_in(self, t: SlotTier, key: BlockKey, header: BlockHeader, ttl_s: float | None) -> Lease:
        view, off = t.lease_view(key.raw)
        t.touch(key.raw)
        return self._add_lease(key, header, view, off, t.name, ttl_s)

    def _add_lease(self, key, header, view, off, tier: str, ttl_s: float | None) -> Lease:
        lease = Lease(self._leases.next_id(), key, header, view, off, tier, self._leases.deadline(ttl_s))
        self._leases.add_lease(lease)
        return lease

    async def _lease_from_disk(self, key: BlockKey, plen: int, ttl_s: float | None) -> Lease | None:
        """Lease a disk-only block. When it moves up into a host-memory top tier it is read
        from disk straight into its new slot: one copy, where reading it into a buffer and
        promoting that would copy it twice. Otherwise it is read into a private buffer."""
        top = self._memory[0] if self._memory else None
        if top is None or top.host_buffer is None or not self._promote_on_read:
            scratch = bytearray(plen)
            [r] = await self._reader.get_into([key], [scratch])  # promotes by policy (a GPU top)
            if r.status is not Status.HIT:
                return None
            dram = next((t for t in self._memory if t.name == "dram"), None)
            if dram is not None and key.raw in dram:
                return self._lease_in(dram, key, r.header, ttl_s)
            return self._add_lease(key, r.header, memoryview(scratch).toreadonly(), None, "disk", ttl_s)
        hdr = await self._disk.read_header(key.raw)
        slot = self._promotion_slot(key.raw, bytes(hdr), plen) if hdr is not None else None
        buf = top.slot_view(slot, plen) if slot is not None else bytearray(plen)
        try:
            [r] = await self._reader.read_disk([key], [buf])
        except BaseException:
            if slot is not None:
                top.abandon(slot)
            raise
        if slot is None:
            if r.status is not Status.HIT:
                return None
            return self._add_lease(key, r.header, memoryview(buf).toreadonly(), None, "disk", ttl_s)
        k = key.raw
        if r.status is Status.HIT and r.header.encode() == slot[1] and self._still_disk_only(k):
            top.commit(k, slot, len(slot[1]), plen)
            self._counters["promotions"] += 1
            return self._lease_in(top, key, r.header, ttl_s)
        # a miss, or the key changed while it was read: the slot goes back (a hit is copied)
        copy = bytes(buf) if r.status is Status.HIT else None
        top.abandon(slot)
        if copy is None:
            return None
        return self._add_lease(key, r.header, memoryview(copy), None, "disk", ttl_s)

    def _still_disk_only(self, key: bytes) -> bool:
        """After a read into a promotion slot: the key is still on disk only and not deleted."""
        return key in self._disk and key not in self._doomed and not any(key in t for t in self._memory)

    def release(self, leases: Sequence[Lease]) -> None:
        """End leases (idempotent). A block deleted while leased is freed at its last release."""
        for lease in leases:
            if self._leases.pop_lease(lease.id) is not None:
                self.unhold(lease.key.raw)

    def unhold(self, key: bytes) -> None:
        """Drop one hold on ``key``; at its last, a key deleted while held (doomed) is freed."""
        if self._leases.unhold(key) and key in self._doomed:
            self._doomed.discard(key)
            for t in self._memory:
                t.remove(key)
            self._dirty.discard(key)
