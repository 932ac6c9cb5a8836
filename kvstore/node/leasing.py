"""Leases: a reader's claim that keeps a block's payload in place until released or expired,
and the holds behind them. A leased memory block is read in place; a disk-only block is read
once, into a new top-tier slot when the node's placement promotes it, else into a private
buffer. Same threading rules as the node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence

from msgpack import unpackb

from kvstore.block import BlockHeader
from kvstore.keys import BlockKey, KeyBatch
from kvstore.node.disk_reads import DiskReads
from kvstore.node.leases import Lease, PackedLease
from kvstore.node.placement import Placement
from kvstore.node.state import NodeState
from kvstore.node.tiers.base import Slot, SlotTier
from kvstore.node.tiers.stack import TierStack
from kvstore.results import Status

# a namespace id -> whether the caller may see its blocks (the caller's tenant check)
Sees = Callable[[bytes | None], bool]


class Leaser:
    """Leases over ``tiers``, recorded in ``state`` (which ends them: :meth:`NodeState.release`);
    a disk block moves up where ``placement`` says so."""

    def __init__(self, tiers: TierStack, state: NodeState, placement: Placement) -> None:
        self._tiers = tiers
        self._disk = tiers.disk
        self._state = state
        self._leases = state.leases
        self._placement = placement
        self._disk_reads = DiskReads(tiers, state)
        self._counters = state.counters

    async def lease(
        self,
        keys: Sequence[BlockKey],
        ttl_s: float | None = None,
        max_read_bytes: int | None = None,
        sees: Sees | None = None,
        owner: str | None = None,
    ) -> list[Lease | None]:
        """Claim each block for reading: its payload stays put (not evicted, overwritten or
        freed) until :meth:`NodeState.release` or the TTL (expired ones are swept first). A
        disk-only block is first brought into DRAM (verified) when there is room, else copied
        privately. None where absent or corrupt, and (with ``max_read_bytes``) where reading it
        from disk would take this call's disk reads past that many bytes: the buffers one call
        allocates are bounded. A lease's view is exactly its header's ``payload_len`` bytes.

        ``sees`` (a namespace id -> bool, the caller's tenant check): a block whose indexed
        namespace it refuses is None at once, exactly as an absent one -- no disk read, no
        promotion, no lease, no counter and no share of ``max_read_bytes`` (docs/security.md).
        ``owner``: the leases read from disk count in that owner's share
        (:meth:`NodeState.leased_disk_bytes`) until they end."""
        got = await self._each(keys, _EachLease(self, ttl_s, owner), max_read_bytes, sees)
        return [x if isinstance(x, Lease) else None for x in got]

    async def claim(self, keys: Sequence[BlockKey]) -> list[Lease | Status]:
        """:meth:`lease` (the default TTL, no bound, tenant or owner), with the reason in
        place of each None: MISS (absent) or the disk read's status (CORRUPT, MISMATCH)."""
        return await self._each(keys, _EachLease(self, None, None), None, None)

    async def _each(
        self, keys: Sequence[BlockKey], take: _EachLease, max_read_bytes: int | None, sees: Sees | None
    ) -> list[Lease | Status]:
        """The lease loop for a lease per key. Cancelled (or failed) during a disk read, it
        releases the leases it took before raising: its caller never sees them, so nobody
        else would end them before their TTL."""
        self._state.sweep()
        try:
            await self._walk([k.raw for k in keys], take.ttl_s, max_read_bytes, sees, take)
        except BaseException:
            self._state.release([x for x in take.out if isinstance(x, Lease)])
            raise
        return take.out

    async def lease_packed(
        self,
        keys: KeyBatch,
        ttl_s: float | None = None,
        max_read_bytes: int | None = None,
        sees: Sees | None = None,
    ) -> PackedLease:
        """:meth:`lease` of a whole batch as one :class:`PackedLease` (a streamed GET's: one
        lease, one mark in transfer, one release for the batch; no header decoded, no lease
        object per block). It holds the blocks that :meth:`lease` would lease, in key order;
        the others are not in it. Disk blocks are read as :meth:`lease` reads them and join
        it; should it lapse while they are read, it takes no more (its holder finds it not
        live and must not touch its views); cancelled meanwhile, it is released at once."""
        st, lt = self._state, self._leases
        st.sweep()
        p = PackedLease(lt.next_id(), lt.deadline(ttl_s))
        lt.add_packed(p)
        try:
            await self._walk(keys.raws(), ttl_s, max_read_bytes, sees, _Packed(self, p))
        except BaseException:  # cancelled (or failed): what it holds goes back now
            st.release([p])
            raise
        return p

    async def _walk(
        self,
        keys: Iterable[bytes],
        ttl_s: float | None,
        max_read_bytes: int | None,
        sees: Sees | None,
        take: _Take,
    ) -> None:
        """The one lease loop, for :meth:`_each` and :meth:`lease_packed` (``take`` says what
        a lease is to each): per key where it lies, whether the caller sees it (another
        tenant's block is a miss before any work on it), the bound on this call's disk reads,
        a memory copy held in place or a disk copy read (:meth:`_lease_from_disk`); the
        blocks read from memory are marked used when it ends, deepest first. It stops early
        when ``take`` is closed (a packed lease that lapsed during a disk read)."""
        where, disk = self._state.where, self._disk
        read = 0
        touched: list[tuple[SlotTier, bytes]] = []
        try:
            for i, k in enumerate(keys):
                if not take.open():
                    break
                t = where(k)
                if t is None or (sees is not None and not sees(t.namespace(k))):
                    take.miss()  # absent, or another tenant's: answered before any work on it
                    continue
                if t is not disk:
                    take.memory(i, t, k)  # the hold first: nothing below frees the slot
                    touched.append((t, k))
                    continue
                plen = t.payload_len(k)
                if max_read_bytes is not None and read + plen > max_read_bytes:
                    self._counters["lease_over_bound"] += 1
                    take.miss()
                    continue
                read += plen
                take.disk(i, k, plen, await self._lease_from_disk(BlockKey(k), plen, ttl_s, touched))
        finally:
            self._touch_deepest_first(touched)

    def _count_hit(self, tier: str, tokens: int) -> None:
        """A block leased from memory (a disk read counts itself: kvstore/node/disk_reads.py)."""
        self._counters[f"hits_{tier}"] += 1
        self._counters[f"hit_tokens_{tier}"] += tokens

    def _touch_deepest_first(self, touched: list[tuple[SlotTier, bytes]]) -> None:
        """Mark the blocks one read leased from memory used, in reverse key order: a read's
        keys come in chain order, so its chain's head ends the most recently used and every
        node eats a chain read together from its tail, as one node's prefix order does (on
        three nodes a node's run of a chain whose parent is elsewhere is a leaf there; touched
        in key order the chain's head would be its node's first victim, cutting the chain for
        the others: docs/eviction-policy.md, "A GET touches deepest first"). A key gone
        meanwhile is skipped (a touch of an absent key is a no-op)."""
        touch = self._tiers.touch
        for t, k in reversed(touched):
            touch(t, k)

    def _lease_in(self, t: SlotTier, key: BlockKey, ttl_s: float | None, from_disk: bool = False) -> Lease:
        """Lease ``key``'s copy in memory tier ``t``, with that copy's own header (the caller
        records the use: :meth:`_touch_deepest_first`)."""
        raw = bytes(t.header_sync(key.raw))
        view, off = t.lease_view(key.raw)
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

    async def _lease_from_disk(
        self, key: BlockKey, plen: int, ttl_s: float | None, touched: list[tuple[SlotTier, bytes]]
    ) -> Lease | Status:
        """Lease a disk-only block of ``plen`` bytes (as indexed now). When it moves up into a
        host-memory top tier it is read from disk straight into its new slot: one copy, where
        reading it into a buffer and promoting that would copy it twice. Otherwise it is read
        into a private buffer (and offered to the placement: a GPU top tier). The key may be
        deleted, or deleted and stored anew with other bytes, while it is read: the slot is
        then given back, never committed. The read's status where it is not a HIT."""
        k = key.raw
        disk = self._disk
        top = self._tiers.top
        if top is None or top.host_buffer is None or not self._placement.promote_on_read:
            return await self._lease_copied(key, plen, ttl_s, touched)
        version = disk.version(k)  # type: ignore[union-attr]  # of the copy ``plen`` describes
        hdr = await disk.read_header(k)  # type: ignore[union-attr]
        slot = self._placement.promotion_slot(k, bytes(hdr), plen) if hdr is not None else None
        buf = top.slot_view(slot, plen) if slot is not None else bytearray(plen)
        read = asyncio.ensure_future(self._disk_reads.read([key], [buf]))
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
            return r.status
        n = r.header.payload_len  # the copy read: not ``plen`` when the key changed meanwhile
        if slot is None:
            return self._add_lease(key, r.header, memoryview(buf)[:n].toreadonly(), None, "disk", ttl_s)
        if n == plen and r.header.encode() == slot[1] and self._unchanged(k, version):
            top.commit(k, slot, len(slot[1]), plen)
            self._counters["promotions"] += 1
            touched.append((top, k))
            return self._lease_in(top, key, ttl_s, from_disk=True)
        # the key changed while it was read: the slot goes back, the bytes read are copied out
        copy = bytes(buf[:n])
        top.abandon(slot)
        return self._add_lease(key, r.header, memoryview(copy), None, "disk", ttl_s)

    async def _lease_copied(
        self, key: BlockKey, plen: int, ttl_s: float | None, touched: list[tuple[SlotTier, bytes]]
    ) -> Lease | Status:
        """A disk block read into a private buffer, offered to the placement (which may copy it
        up into a GPU top tier) when the copy read is still the one stored."""
        k = key.raw
        scratch = bytearray(plen)
        version = self._disk.version(k)  # type: ignore[union-attr]
        [r] = await self._disk_reads.read([key], [scratch])
        if r.status is not Status.HIT:
            return r.status
        if self._disk.version(k) == version:  # type: ignore[union-attr]
            # a copy deleted (or deleted and stored anew) while it was read must not move up
            self._placement.promote(r.header, scratch)
        dram = self._tiers.dram
        if dram is not None and k in dram and k not in self._state.doomed:
            touched.append((dram, k))
            return self._lease_in(dram, key, ttl_s, from_disk=True)
        view = memoryview(scratch)[: r.header.payload_len].toreadonly()
        return self._add_lease(key, r.header, view, None, "disk", ttl_s)

    def _unchanged(self, key: bytes, version: int | None) -> bool:
        """After a read into a promotion slot: the copy read is still the one stored, on disk
        only, and the key is not deleted."""
        return (
            self._disk.version(key) == version  # type: ignore[union-attr]
            and key not in self._state.doomed
            and not self._tiers.in_memory(key)
        )


def _abandon_after(top: SlotTier, slot: Slot, read: asyncio.Future) -> None:
    """Give back ``slot`` once ``read`` (into it) is over; its outcome is of use to nobody."""
    if not read.cancelled():
        read.exception()  # retrieved, so not logged as never retrieved
    top.abandon(slot)


class _Take:
    """What a lease is to one caller of :meth:`Leaser._walk`: told of each key's outcome."""

    def open(self) -> bool:
        """Whether the walk goes on (False: stop before the next key)."""
        return True

    def miss(self) -> None:
        """The key is absent, not the caller's, or over the disk-read bound."""

    def memory(self, i: int, t: SlotTier, k: bytes) -> None:
        """Key ``i`` (``k``) lies in memory tier ``t``: hold it."""
        raise NotImplementedError

    def disk(self, i: int, k: bytes, plen: int, got: Lease | Status) -> None:
        """Key ``i`` was read from disk (``plen`` bytes as indexed): its lease, or the read's status."""
        raise NotImplementedError


class _EachLease(_Take):
    """:meth:`Leaser._each`'s: one :class:`Lease` (or the reason for none) per key, in ``out``
    as it goes (so that what it took is there to release when it is cancelled)."""

    def __init__(self, leaser: Leaser, ttl_s: float | None, owner: str | None) -> None:
        self.out: list[Lease | Status] = []
        self._leaser, self.ttl_s, self._owner = leaser, ttl_s, owner

    def miss(self) -> None:
        self.out.append(Status.MISS)

    def memory(self, i: int, t: SlotTier, k: bytes) -> None:
        lease = self._leaser._lease_in(t, BlockKey(k), self.ttl_s)
        self._leaser._count_hit(t.name, lease.header.num_tokens)
        self.out.append(lease)

    def disk(self, i: int, k: bytes, plen: int, got: Lease | Status) -> None:
        if isinstance(got, Lease) and self._owner is not None:
            self._leaser._leases.charge(got, self._owner)
        self.out.append(got)


class _Packed(_Take):
    """:meth:`Leaser.lease_packed`'s: each block held joins packed lease ``p`` (its hold, view,
    stored header and tier); nothing for a miss. A lease that lapsed while the disk was read
    takes no more (a failed read too: nothing would ever drop what it took after)."""

    def __init__(self, leaser: Leaser, p: PackedLease) -> None:
        self._leaser, self._p = leaser, p
        self._leases = leaser._leases

    def open(self) -> bool:
        return self._leases.live(self._p)

    def memory(self, i: int, t: SlotTier, k: bytes) -> None:
        p = self._p
        self._leases.holds[k] += 1
        p.keys.append(k)
        p.at.append(i)
        p.views.append(t.lease_view(k)[0])
        header = t.header_sync(k)
        p.headers.append(header)
        p.tiers.append(t.name)
        # the token count off the stored header: one C-level unpack, no BlockHeader
        self._leaser._count_hit(t.name, len(unpackb(header)["tokens"]) // 4)

    def disk(self, i: int, k: bytes, plen: int, got: Lease | Status) -> None:
        if not isinstance(got, Lease):
            return
        p = self._p
        if not self._leases.live(p):  # lapsed while the disk was read: it holds nothing any more
            self._leaser._state.release([got])
            return
        self._leases.pop_lease(got.id)  # its hold passes to ``p``
        p.read_bytes += plen
        p.keys.append(k)
        p.at.append(i)
        p.views.append(got.view)
        p.headers.append(got.raw_header)
        p.tiers.append(got.tier)
