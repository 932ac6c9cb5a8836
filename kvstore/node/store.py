"""One storage node: the tier stack (hbm -> dram -> disk) behind one batched asyncio API, and
the node's placement policy.

Placement: a write lands in the highest memory tier (and, write-through, on disk before it is
acknowledged durable). LRU eviction moves blocks down (hbm -> dram -> disk -> dropped; see
kvstore.node.eviction); a write-back block reaches disk when it leaves memory or at close. A
disk hit can be promoted into the top memory tier when that costs no I/O. Held blocks (leases,
in-flight copies) and pinned blocks are never evicted, overwritten or freed; capacity in bytes
is never exceeded.

The node drives its tiers only through kvstore.node.tiers.base (Tier, SlotTier). Reads,
leases, writes, eviction and inspection are objects it composes (kvstore.node.reads, leasing,
writes, eviction, inspection), each handed what it uses; this module keeps the placement:
where a write lands (:meth:`NodeStore._place`), when a disk hit moves up (``_promote``).

Every batched call returns one result per key in input order; failures of one key (corruption,
no space, I/O error) are per-key statuses and counters, never exceptions. All methods must be
called from the event loop that opened the node; none blocks it on disk I/O.
"""

from __future__ import annotations

import logging
import socket
from collections import Counter
from collections.abc import Callable, Sequence
from operator import itemgetter

import numpy as np

from kvstore.block import BlockHeader
from kvstore.config import StoreConfig
from kvstore.keys import BlockKey, KeyBatch
from kvstore.lookups import TIER_CODES
from kvstore.node.eviction import Evictor
from kvstore.node.inspection import Inspector
from kvstore.node.leases import Lease, LeaseTable, Reservation
from kvstore.node.leasing import Leaser
from kvstore.node.reads import Reader
from kvstore.node.tiers.base import BottomTier, Slot, SlotTier, Tier
from kvstore.node.tiers.build import build_tiers
from kvstore.node.tiers.index import header_namespace
from kvstore.node.tiers.tasks import Finishing, to_the_end
from kvstore.node.tombstones import Tombstones
from kvstore.node.writes import Writer
from kvstore.results import BlockInfo, Expect, GetResult, PutResult, Status

log = logging.getLogger("tierkv.node")

# How long close waits for work that cancelled callers left finishing (disk writes of a few
# blocks take well under a second); past it the tiers close anyway, so a stuck disk cannot
# hang a shutdown.
_FINISH_WAIT_S = 5.0


class NodeStore:
    """Use :meth:`open`; the constructor takes already-built tiers: ``memory`` top first, and
    the bottom ``disk`` tier (or None), and ``finishing``, the tracker the disk tier was built
    with: every part that leaves work finishing for a cancelled caller shares it."""

    def __init__(
        self, cfg: StoreConfig, memory: list[SlotTier], disk: BottomTier | None, finishing: Finishing
    ) -> None:
        self.cfg = cfg
        self.memory = memory
        self.disk = disk
        self.write_back = cfg.disk.write_mode == "write-back"
        self.leases = LeaseTable(cfg.node.lease_ttl_s)
        self.pinned: set[bytes] = set()
        self.dirty: set[bytes] = set()  # write-back: in memory only
        self.doomed: set[bytes] = set()  # deleted while held: freed at the last release
        self.counters: Counter[str] = Counter()
        self.name = cfg.node.name or socket.gethostname()
        self._closed = False
        self._finishing = finishing
        self._tiers: list[Tier] = [*memory, *([disk] if disk is not None else [])]
        c, promote = self.counters, cfg.node.promote_on_read
        self.reader = Reader(disk, self._where, self._promote, c)
        self.leaser = Leaser(
            memory, disk, self.leases, self._where, self.reader, self._promotion_slot, promote,
            self.doomed, self.dirty, c,
        )  # fmt: skip
        unhold = self.leaser.unhold
        self.evictor = Evictor(
            memory, disk, self.leases, self.pinned, self.dirty, self.doomed, unhold, c, finishing
        )
        self.writer = Writer(
            memory, disk, self.leases, self._place, self._where, self.doomed, self.dirty,
            self.write_back, unhold, c, finishing,
        )  # fmt: skip
        self.inspector = Inspector(
            self.name, self._tiers, self.leases, self.pinned, self.dirty, self.doomed, c
        )
        if disk is not None:
            disk.protect(self.evictor.protected)  # a leased or pinned block stays on disk too
        # what this node deleted, so another node's repair cannot bring it back (beside LMDB)
        self.tombstones = Tombstones.beside(cfg.disk.path if disk is not None else None)

    @classmethod
    async def open(cls, cfg: StoreConfig) -> NodeStore:
        """Build the configured tiers and rebuild the disk index. Raises TierError naming the
        tier that cannot be opened."""
        finishing = Finishing()
        memory, disk = await build_tiers(cfg, finishing)
        node = cls(cfg, memory, disk, finishing)
        log.info(
            "event=node_open tiers=%s disk_blocks=%d write_mode=%s",
            ",".join(t.name for t in node.tiers),
            len(disk) if disk is not None else 0,
            cfg.disk.write_mode,
        )
        return node

    # ------------------------------------------------------------------ helpers
    @property
    def tiers(self) -> list[Tier]:
        """Configured tiers, top first."""
        return self._tiers

    @property
    def dram(self) -> SlotTier | None:
        return next((t for t in self.memory if t.name == "dram"), None)

    @property
    def dram_buffer(self) -> memoryview | None:
        """The whole DRAM arena, for registering once with an RDMA device."""
        d = self.dram
        return d.host_buffer if d is not None else None

    def _where(self, key: bytes) -> Tier | None:
        """The highest tier holding ``key``, None when absent or deleted (doomed)."""
        if key in self.doomed:
            return None
        for t in self._tiers:  # a plain loop: this runs per key of every EXISTS
            if key in t:
                return t
        return None

    def _sweep(self) -> None:
        leases, reservations = self.leases.expired()
        if leases:
            self.counters["leases_expired"] += len(leases)
            self.release(leases)
        if reservations:
            self.counters["reservations_expired"] += len(reservations)
            self.abort(reservations)

    # ------------------------------------------------------------------ reads
    async def contains(self, keys: Sequence[BlockKey]) -> list[str | None]:
        """The highest tier holding each key, or None. No I/O."""
        return [t.name if (t := self._where(k.raw)) is not None else None for k in keys]

    async def get_into(
        self, keys: Sequence[BlockKey], bufs: Sequence, expect: Sequence[Expect | None] | None = None
    ) -> list[GetResult]:
        """Copy each block's payload into its buffer (first ``payload_len`` bytes). Disk copies
        are checksum-verified (CORRUPT: dropped); ``expect`` checks parent and token ids
        (MISMATCH). A buffer's content is unspecified unless its result is HIT."""
        return await self.reader.get_into(keys, bufs, expect)

    async def namespaces(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """The namespace id (raw 16 bytes) in each stored block's header, None where absent or
        unreadable: the daemon's per-tenant visibility check on every EXISTS/DELETE. From the
        tiers' indexes (kept at commit and at open): no I/O, no decode."""
        return [t.namespace(k.raw) if (t := self._where(k.raw)) is not None else None for k in keys]

    async def visible_tiers(self, keys: KeyBatch, sees: Callable[[bytes | None], bool]) -> bytes:
        """Per key one tier code (kvstore.lookups): the highest tier holding it when ``sees``
        accepts its namespace id there (see :meth:`namespaces`), else 0 -- exactly
        :meth:`contains` plus the tenant check, so another tenant's block reads as absent.
        The daemon's EXISTS and DELETE (8,192 keys for a long prompt): one pass per tier
        over the packed keys (:meth:`LruIndex.probe`), each tier asked only about the keys
        the tiers above it do not hold; no Python per key."""
        n = len(keys)
        codes = np.zeros(n, dtype=np.uint8)
        rest, left = keys.raws(), np.arange(n)
        if self.doomed:  # deleted while held: absent for every reader
            gone = np.fromiter(map(self.doomed.__contains__, rest), dtype=bool, count=n)
            if gone.any():
                left = left[~gone]
                rest = _pick(rest, left)
        for t in self._tiers:
            if not rest:
                break
            held, visible = t.probe(rest, sees)
            if not held.any():
                continue
            codes[left[held]] = np.where(visible[held], TIER_CODES[t.name], 0)
            keep = np.flatnonzero(~held)
            left = left[keep]
            rest = _pick(rest, keep)
        return codes.tobytes()

    def _promote(self, header: BlockHeader, payload) -> None:
        """Copy a verified disk block into the top memory tier when that costs no I/O (and
        ``node.promote_on_read``)."""
        if not self.cfg.node.promote_on_read:
            return
        slot = self._promotion_slot(header.key.raw, header.encode(), header.payload_len)
        if slot is not None:
            top = self.memory[0]
            top.fill(slot, memoryview(payload).cast("B")[: header.payload_len])
            top.commit(header.key.raw, slot, len(slot[1]), header.payload_len)
            self.counters["promotions"] += 1

    def _promotion_slot(self, key: bytes, hdr: bytes, plen: int) -> Slot | None:
        """A reserved slot of the top memory tier for a disk block moving up, or None when it
        is there already, deleted, being written (its writer's commit needs the key free), or
        would take evicting anything not also below."""
        if not self.memory or key in self.memory[0] or key in self.doomed or key in self.leases.reserved_keys:
            return None
        top = self.memory[0]
        ns = header_namespace(hdr)
        if not top.fits(plen, len(hdr)) or not self.evictor.room_without_io(top, plen, len(hdr), ns):
            return None
        return top.reserve(hdr, plen)

    # ------------------------------------------------------------------ writes
    async def put(self, blocks: Sequence[tuple[BlockHeader, object]]) -> list[PutResult]:
        """Store (header, payload) pairs: reserve, copy, commit. INVALID when the payload does
        not match its header, EXISTS when the key is stored, BUSY when it is being written."""
        self._sweep()
        return self._revive(await self.writer.put(blocks), [h.key for h, _ in blocks])

    async def reserve(
        self,
        headers: Sequence[BlockHeader],
        lazy: bool = False,
        make_room: bool = True,
        sees: Callable[[bytes | None], bool] | None = None,
    ) -> list[Reservation | Status]:
        """Phase one of a write: a slot per header (EXISTS / BUSY / NO_SPACE otherwise). The
        slot is invisible to readers until :meth:`commit`; it expires after the lease TTL.
        A reservation without a host slot (disk, GPU) gets a private buffer; with ``lazy`` that
        buffer is not allocated here: its ``view`` is empty and the caller hands the payload
        over with :meth:`attach_payload` (no memory is committed before the bytes come).
        Without ``make_room`` nothing is evicted: a memory slot only where one is free now,
        else the private (disk-bound) kind. With ``sees`` (the caller's tenant check), a key
        stored in a namespace it refuses is BUSY, never EXISTS."""
        self._sweep()
        return await self.writer.reserve(headers, lazy, make_room, sees)

    async def _place(self, h: BlockHeader, lazy: bool = False, make_room: bool = True) -> Reservation | None:
        """Where a new block lands: the highest memory tier it fits once room is made (moving
        blocks down; without ``make_room``, only one with room free now), else a private
        buffer bound for disk; None when no tier can take it."""
        hb = h.encode()
        size = 0 if lazy else h.payload_len  # private buffers only
        rid, expires = self.leases.next_id(), self.leases.deadline(None)
        for tier in self.memory:
            if not tier.fits(h.payload_len, len(hb)):
                continue
            if make_room:
                roomy = await self.evictor.make_room(tier, h.payload_len, len(hb), h.namespace.raw)
            else:
                roomy = tier.can_alloc(h.payload_len, len(hb))
            if roomy:
                slots = tier.reserve(hb, h.payload_len)
                if slots is None:
                    continue
                view = tier.slot_view(slots, h.payload_len)
                if view is not None:  # written in place (recv_into, RDMA WRITE)
                    return Reservation(rid, h, hb, view, slots[0], tier.name, expires, slots=slots)
                # a GPU slot: the bytes land in host memory and are copied up at commit
                buf = bytearray(size)
                return Reservation(
                    rid, h, hb, memoryview(buf), None, tier.name, expires, scratch=buf, slots=slots
                )
        if self.disk is not None and self.disk.fits(h.payload_len, len(hb)):
            buf = bytearray(size)
            return Reservation(rid, h, hb, memoryview(buf), None, None, expires, scratch=buf)
        return None

    async def commit(self, reservations: Sequence[Reservation]) -> list[PutResult]:
        """Phase two: verify each reservation's payload against its header checksum, index it,
        and (write-through) store it on disk in one transaction. Durable when synced to disk."""
        return self._revive(await self.writer.commit(reservations), [r.header.key for r in reservations])

    def _revive(self, results: list[PutResult], keys: Sequence[BlockKey]) -> list[PutResult]:
        """A key stored again is alive: its tombstone ends."""
        if len(self.tombstones):
            self.tombstones.discard([k.raw for k, r in zip(keys, results) if r.status is Status.STORED])
        return results

    def tombstoned(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key: whether this node deleted it lately (kvstore/node/tombstones.py)."""
        dead = self.tombstones
        return [k.raw in dead for k in keys] if len(dead) else [False] * len(keys)

    def abort(self, reservations: Sequence[Reservation]) -> None:
        """Give back uncommitted reservations (idempotent)."""
        self.writer.abort(reservations)

    # ------------------------------------------------------------------ leases
    async def lease(
        self,
        keys: Sequence[BlockKey],
        ttl_s: float | None = None,
        max_read_bytes: int | None = None,
        sees: Callable[[bytes | None], bool] | None = None,
        owner: str | None = None,
    ) -> list[Lease | None]:
        """Claim each block for reading: its payload stays put (not evicted, overwritten or
        freed) until :meth:`release` or the TTL. A disk-only block is first brought into DRAM
        (verified) when there is room, else copied privately. None where absent or corrupt,
        and (with ``max_read_bytes``) where reading it from disk would take this call's disk
        reads past that many bytes: the buffers one call allocates are bounded. With ``sees``
        (the caller's tenant check on a namespace id) a block it refuses is None before any
        work on it (kvstore/node/leasing.py). With ``owner`` the bytes read from disk count in
        :meth:`leased_disk_bytes` of ``owner`` while leased."""
        self._sweep()
        return await self.leaser.lease(keys, ttl_s, max_read_bytes, sees, owner)

    def leased_disk_bytes(self, owner: str) -> int:
        """Bytes of live leases read from disk for ``owner`` (see :meth:`lease`); O(1)."""
        self._sweep()
        return self.leases.disk_bytes.get(owner, 0)

    def attach_payload(self, r: Reservation, payload: bytearray) -> None:
        """Give a lazy reservation (see :meth:`reserve`) its received payload buffer."""
        self.writer.attach_payload(r, payload)

    def is_live(self, held: Lease | Reservation) -> bool:
        """Whether a lease or reservation is still in force (not released, expired, done)."""
        return self.leases.live(held)

    def begin_transfer(self, held: Sequence[Lease | Reservation]) -> list[bool]:
        """Mark leases/reservations whose bytes are about to move (a send from the slot, a
        receive into it): until :meth:`end_transfer` they cannot expire, so their slots are
        not freed or reused under the transfer. Per item: False when it is no longer live
        (released, expired, committed): its view must not be touched. The caller bounds the
        transfer with a deadline and calls :meth:`end_transfer` for exactly the items marked."""
        return [self.leases.start_moving(x) for x in held]

    def end_transfer(self, held: Sequence[Lease | Reservation]) -> None:
        for x in held:
            self.leases.stop_moving(x)

    def release(self, leases: Sequence[Lease]) -> None:
        """End leases (idempotent). A block deleted while leased is freed at its last release."""
        self.leaser.release(leases)

    # ------------------------------------------------------------------ delete, pin
    async def delete(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Remove blocks from every tier. A held block disappears at once for readers and is
        freed when its last lease ends. False where the key was absent."""
        out = []
        disk_keys = []
        for key in keys:
            k = key.raw
            present = self._where(k) is not None
            out.append(present)
            if not present:
                continue
            self.pinned.discard(k)
            self._forget(k)
            if self.disk is not None and k in self.disk:
                disk_keys.append(k)
        self.counters["deletes"] += sum(out)
        self.tombstones.add([k.raw for k in keys])  # absent ones too: a copy elsewhere may come back
        if disk_keys:
            # to its end even when the caller is cancelled: what raced the disk delete is
            # undone only after it
            await to_the_end(self._delete_on_disk(disk_keys), self._finishing)
        return out

    async def _delete_on_disk(self, keys: list[bytes]) -> None:
        """Drop ``keys``' disk copies, then what raced that delete while it ran (the keys
        still indexed on disk meanwhile)."""
        await self.disk.delete(keys)  # type: ignore[union-attr]
        for k in keys:
            self.pinned.discard(k)  # pinned meanwhile: a pin does not outlive the delete
            if any(k in t for t in self.memory):  # a racing read may have promoted it
                self._forget(k)

    def _forget(self, key: bytes) -> None:
        """Drop ``key`` from the memory tiers now, or (held) hide it until its last release."""
        if self.leases.held(key):
            self.doomed.add(key)
            return
        for t in self.memory:
            t.remove(key)
        self.dirty.discard(key)

    async def pin(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Exempt stored blocks from eviction until :meth:`unpin`. False where absent."""
        out = []
        for key in keys:
            ok = self._where(key.raw) is not None
            if ok:
                self.pinned.add(key.raw)
            out.append(ok)
        return out

    async def unpin(self, keys: Sequence[BlockKey]) -> list[bool]:
        out = []
        for key in keys:
            out.append(key.raw in self.pinned)
            self.pinned.discard(key.raw)
        return out

    # ------------------------------------------------------------------ close
    async def close(self) -> None:
        """Wait for work that cancelled callers left finishing (disk writes and what follows
        them; up to a few seconds, then logged and left), flush write-back blocks to disk,
        end leases, close tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # first: that work needs the tiers (the disk's writer thread, LMDB, held slots) to its end
        unfinished = await self._finishing.drain(_FINISH_WAIT_S)
        if unfinished:
            log.warning("event=close_unfinished tasks=%d wait_s=%s", unfinished, _FINISH_WAIT_S)
        left = await self.writer.flush()
        if left:
            log.warning("event=close_unflushed blocks=%d", left)
        for t in self._tiers:
            await t.close()
        self.tombstones.close()
        log.info("event=node_closed")

    # ------------------------------------------------------------------ inspection (see Inspector)
    async def list_blocks(
        self,
        tier: str | None = None,
        namespace: BlockKey | None = None,
        after: BlockKey | None = None,
        limit: int = 100,
    ) -> list[BlockInfo]:
        """See :meth:`Inspector.list_blocks`."""
        return await self.inspector.list_blocks(tier, namespace, after, limit)

    async def describe(self, key: BlockKey) -> tuple[BlockHeader, BlockInfo] | None:
        """See :meth:`Inspector.describe`."""
        return await self.inspector.describe(key)

    async def verify(self, keys: Sequence[BlockKey] | None = None, repair: bool = False) -> dict:
        """See :meth:`Inspector.verify`."""
        return await self.inspector.verify(keys, repair)

    def stats(self) -> dict:
        """See :meth:`Inspector.stats`."""
        return self.inspector.stats()

    def check(self) -> None:
        """See :meth:`Inspector.check`."""
        self.inspector.check()


def _pick(items: list[bytes], idx: np.ndarray) -> list[bytes]:
    """``items`` at positions ``idx`` (C-level: one itemgetter call, not a loop per item)."""
    if len(idx) == 0:
        return []
    if len(idx) == 1:
        return [items[int(idx[0])]]
    return list(itemgetter(*idx.tolist())(items))
