"""Leases: a reader's claim that keeps a block's payload in place until released or expired,
and the holds behind them. A leased memory block is read in place; a disk-only block is read
once, into a new top-tier slot when the node's placement promotes it, else into a private
buffer. Same threading rules as the node.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence

from kvstore.block import BlockHeader
from kvstore.keys import BlockKey
from kvstore.node.leases import Lease, LeaseTable
from kvstore.node.reads import Reader
from kvstore.node.tiers.base import BottomTier, Slot, SlotTier, Tier
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
        disk: BottomTier | None,
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
        self,
        keys: Sequence[BlockKey],
        ttl_s: float | None = None,
        max_read_bytes: int | None = None,
        sees: Callable[[bytes | None], bool] | None = None,
        owner: str | None = None,
    ) -> list[Lease | None]:
        """Claim each block for reading: its payload stays put (not evicted, overwritten or
        freed) until :meth:`release` or the TTL (the caller sweeps expired ones first). A
        disk-only block is first brought into DRAM (verified) when there is room, else copied
        privately. None where absent or corrupt, and (with ``max_read_bytes``) where reading it
        from disk would take this call's disk reads past that many bytes: the buffers one call
        allocates are bounded. A lease's view is exactly its header's ``payload_len`` bytes.

        ``sees`` (a namespace id -> bool, the caller's tenant check): a block whose indexed
        namespace it refuses is None at once, exactly as an absent one -- no disk read, no
        promotion, no lease, no counter and no share of ``max_read_bytes`` (docs/security.md).
        ``owner``: the leases read from disk count in that owner's share
        (:attr:`LeaseTable.disk_bytes`) until they end."""
        out: list[Lease | None] = []
        read = 0
        for key in keys:
            t = self._where(key.raw)
            if t is not None and sees is not None and not sees(t.namespace(key.raw)):
                out.append(None)  # another tenant's: answered before any work on it
                continue
            if t is not None and t is self._disk:
                plen = t.payload_len(key.raw)
                if max_read_bytes is not None and read + plen > max_read_bytes:
                    self._counters["lease_over_bound"] += 1
                    out.append(None)
                    continue
                read += plen
                lease = await self._lease_from_disk(key, plen, ttl_s)
                if lease is not None and owner is not None:
                    self._leases.charge(lease, owner)
                out.append(lease)
                continue
            if t is None:
                out.append(None)
                continue
            lease = self._lease_in(t, key, ttl_s)
            self._counters[f"hits_{t.name}"] += 1
            self._counters[f"hit_tokens_{t.name}"] += lease.header.num_tokens
            out.append(lease)
        return out

    def _lease_in(self, t: SlotTier, key: BlockKey, ttl_s: float | None, from_disk: bool = False) -> Lease:
        """Lease ``key``'s copy in memory tier ``t``, with that copy's own header."""
        raw = bytes(t.header_sync(key.raw))
        view, off = t.lease_view(key.raw)
        t.touch(key.raw)
        lease = self._add_lease(key, BlockHeader.decode(raw), view, off, t.name, ttl_s, raw)
        lease.from_disk = from_disk
        return lease

    def _add_lease(
        self, key, header, view, off, tier: str, ttl_s: float | None, raw: bytes | None = None
    ) -> Lease:
        """``raw``: the header's bytes as stored, when the caller has them (a memory copy's);
        a disk read hands over the decoded header, encoded again here (the encoding is
        deterministic, so the bytes equal the stored ones)."""
        raw = raw if raw is not None else header.encode()
        deadline = self._leases.deadline(ttl_s)
        lease = Lease(self._leases.next_id(), key, header, view, off, tier, deadline, raw, tier == "disk")
        self._leases.add_lease(lease)
        return lease

    async def _lease_from_disk(self, key: BlockKey, plen: int, ttl_s: float | None) -> Lease | None:
        """Lease a disk-only block of ``plen`` bytes (as indexed now). When it moves up into a
        host-memory top tier it is read from disk straight into its new slot: one copy, where
        reading it into a buffer and promoting that would copy it twice. Otherwise it is read
        into a private buffer. The key may be deleted, or deleted and stored anew with other
        bytes, while it is read: the slot is then given back, never committed."""
        k = key.raw
        disk = self._disk
        top = self._memory[0] if self._memory else None
        if top is None or top.host_buffer is None or not self._promote_on_read:
            scratch = bytearray(plen)
            [r] = await self._reader.get_into([key], [scratch])  # promotes by policy (a GPU top)
            if r.status is not Status.HIT:
                return None
            dram = next((t for t in self._memory if t.name == "dram"), None)
            if dram is not None and k in dram and k not in self._doomed:
                return self._lease_in(dram, key, ttl_s, from_disk=True)
            view = memoryview(scratch)[: r.header.payload_len].toreadonly()
            return self._add_lease(key, r.header, view, None, "disk", ttl_s)
        version = disk.version(k)  # type: ignore[union-attr]  # of the copy ``plen`` describes
        hdr = await disk.read_header(k)  # type: ignore[union-attr]
        slot = self._promotion_slot(k, bytes(hdr), plen) if hdr is not None else None
        buf = top.slot_view(slot, plen) if slot is not None else bytearray(plen)
        read = asyncio.ensure_future(self._reader.read_disk([key], [buf]))
        try:
            [r] = await asyncio.shield(read)
        except BaseException:
            if slot is not None:
                # cancelled (or failed): a disk thread may still be copying into the slot, so
                # it goes back when the read is over, never under it
                read.add_done_callback(lambda f: _abandon_after(top, slot, f))
            raise
        if r.status is not Status.HIT:
            if slot is not None:
                top.abandon(slot)
            return None
        n = r.header.payload_len  # the copy read: not ``plen`` when the key changed meanwhile
        if slot is None:
            return self._add_lease(key, r.header, memoryview(buf)[:n].toreadonly(), None, "disk", ttl_s)
        if n == plen and r.header.encode() == slot[1] and self._unchanged(k, version):
            top.commit(k, slot, len(slot[1]), plen)
            self._counters["promotions"] += 1
            return self._lease_in(top, key, ttl_s, from_disk=True)
        # the key changed while it was read: the slot goes back, the bytes read are copied out
        copy = bytes(buf[:n])
        top.abandon(slot)
        return self._add_lease(key, r.header, memoryview(copy), None, "disk", ttl_s)

    def _unchanged(self, key: bytes, version: int | None) -> bool:
        """After a read into a promotion slot: the copy read is still the one stored, on disk
        only, and the key is not deleted."""
        return (
            self._disk.version(key) == version  # type: ignore[union-attr]
            and key not in self._doomed
            and not any(key in t for t in self._memory)
        )

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


def _abandon_after(top: SlotTier, slot: Slot, read: asyncio.Future) -> None:
    """Give back ``slot`` once ``read`` (into it) is over; its outcome is of use to nobody."""
    if not read.cancelled():
        read.exception()  # retrieved, so not logged as never retrieved
    top.abandon(slot)
