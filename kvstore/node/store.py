"""One storage node: the tier stack (hbm -> dram -> disk) behind one batched asyncio API.

Placement: a write lands in the highest memory tier (and, write-through, on disk before it is
acknowledged durable). LRU eviction moves blocks down (hbm -> dram -> disk -> dropped); a
write-back block reaches disk when it leaves memory or at close. A disk hit can be promoted into
DRAM. Held blocks (leases, in-flight copies) and pinned blocks are never evicted, overwritten or
freed; capacity in bytes is never exceeded.

Every batched call returns one result per key in input order; failures of one key (corruption,
no space, I/O error) are per-key statuses and counters, never exceptions. All methods must be
called from the event loop that opened the node; none blocks it on disk I/O.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from collections.abc import Sequence

import msgpack

from kvstore.block import BlockHeader, checksum
from kvstore.config import StoreConfig
from kvstore.errors import BlockFormatError
from kvstore.keys import BlockKey
from kvstore.node.eviction import NodeEviction
from kvstore.node.inspection import NodeInspection
from kvstore.node.leases import Lease, LeaseTable, Reservation
from kvstore.node.tiers.arena import CudaArena, HostArena
from kvstore.node.tiers.disk import DiskTier
from kvstore.node.tiers.memory import MemoryTier
from kvstore.results import Expect, GetResult, PutResult, Status

log = logging.getLogger("tierkv.node")


def _header_namespace(raw) -> bytes | None:
    """The ``ns`` field of an encoded header, without building a BlockHeader."""
    if raw is None:
        return None
    try:
        ns = msgpack.unpackb(raw, raw=False).get("ns")
    except Exception:  # a header that does not parse belongs to no namespace
        return None
    return ns if isinstance(ns, bytes) else None


class NodeStore(NodeEviction, NodeInspection):
    """Use :meth:`open`; the constructor takes already-built tiers (top first)."""

    def __init__(self, cfg: StoreConfig, memory: list[MemoryTier], disk: DiskTier | None) -> None:
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
        self._tiers = [*memory, *([disk] if disk is not None else [])]
        if disk is not None:
            disk._protected = self._protected

    @classmethod
    async def open(cls, cfg: StoreConfig) -> NodeStore:
        """Build the configured tiers and rebuild the disk index. Raises TierError naming the
        tier that cannot be opened."""
        memory: list[MemoryTier] = []
        if cfg.hbm.capacity:
            memory.append(MemoryTier("hbm", CudaArena(cfg.hbm.capacity, cfg.hbm.device), cfg.hbm.slab_size))
        if cfg.dram.capacity:
            size = cfg.dram.capacity // cfg.dram.slab_size * cfg.dram.slab_size
            # in a thread: prefaulting or pinning a large arena takes seconds, and the daemon's
            # loop answers /readyz (503) meanwhile
            arena = await asyncio.to_thread(HostArena, size, cfg.dram.pin, cfg.dram.prefault)
            memory.append(MemoryTier("dram", arena, cfg.dram.slab_size))
        disk = None
        if cfg.disk.enabled:
            d = cfg.disk
            disk = DiskTier(d.path, d.capacity, map_size=d.map_size, sync=d.sync, writemap=d.writemap)
        node = cls(cfg, memory, disk)
        log.info(
            "event=node_open tiers=%s disk_blocks=%d write_mode=%s",
            ",".join(t.name for t in node.tiers),
            len(disk) if disk is not None else 0,
            cfg.disk.write_mode,
        )
        return node

    # ------------------------------------------------------------------ helpers
    @property
    def tiers(self) -> list:
        """Configured tiers, top first."""
        return self._tiers

    @property
    def dram(self) -> MemoryTier | None:
        return next((t for t in self.memory if t.name == "dram"), None)

    @property
    def dram_buffer(self) -> memoryview | None:
        """The whole DRAM arena, for registering once with an RDMA device."""
        d = self.dram
        return d.arena.view if d is not None else None

    def _visible(self, key: bytes) -> bool:
        return key not in self.doomed

    def _where(self, key: bytes):
        if key in self.doomed:
            return None
        for t in self.memory:
            if key in t:
                return t
        if self.disk is not None and key in self.disk:
            return self.disk
        return None

    def _protected(self, key: bytes) -> bool:
        return self.leases.held(key) or key in self.pinned

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
        out = []
        for k in keys:
            t = self._where(k.raw)
            out.append(t.name if t is not None else None)
        return out

    async def get_into(
        self, keys: Sequence[BlockKey], bufs: Sequence, expect: Sequence[Expect | None] | None = None
    ) -> list[GetResult]:
        """Copy each block's payload into its buffer (first ``payload_len`` bytes). Disk copies
        are checksum-verified (CORRUPT: dropped); ``expect`` checks parent and token ids
        (MISMATCH). A buffer's content is unspecified unless its result is HIT."""
        results: list[GetResult | None] = [None] * len(keys)
        disk_idx: list[int] = []
        for i, key in enumerate(keys):
            t = self._where(key.raw)
            if t is None:
                results[i] = GetResult(Status.MISS)
            elif t is self.disk:
                disk_idx.append(i)
            else:
                [(st, hdr)] = await t.get_into([key.raw], [bufs[i]])
                results[i] = self._judge(key, st, hdr, t.name, expect[i] if expect else None)
                if results[i].status is Status.HIT:
                    t.touch(key.raw)
        if disk_idx:
            got = await self.disk.get_into([keys[i].raw for i in disk_idx], [bufs[i] for i in disk_idx])
            for i, (st, hdr) in zip(disk_idx, got):
                r = self._judge(keys[i], st, hdr, "disk", expect[i] if expect else None)
                results[i] = r
                if r.status is Status.HIT and self.cfg.node.promote_on_read:
                    self._promote(r.header, bufs[i])
        for r in results:
            self.counters[f"get_{r.status.name.lower()}"] += 1
            if r.status is Status.HIT:
                self.counters[f"hits_{r.tier}"] += 1
                self.counters["bytes_out"] += r.header.payload_len
        return results  # type: ignore[return-value]

    def _judge(
        self, key: BlockKey, st: Status, hdr: bytes | None, tier: str, exp: Expect | None
    ) -> GetResult:
        if st is Status.CORRUPT:
            self.counters["checksum_failures"] += 1
            return GetResult(Status.CORRUPT, None, tier)
        if hdr is None:
            return GetResult(st)
        try:
            header = BlockHeader.decode(hdr)
        except BlockFormatError:
            self.counters["checksum_failures"] += 1
            return GetResult(Status.CORRUPT, None, tier)
        if st is not Status.HIT:
            return GetResult(st, header, tier)
        if not header.matches(key, exp.parent if exp else None, exp.token_bytes if exp else None):
            return GetResult(Status.MISMATCH, header, tier)
        return GetResult(Status.HIT, header, tier)

    def _promote(self, header: BlockHeader, payload) -> None:
        """Copy a verified disk block into the top memory tier when that costs no I/O."""
        if not self.memory or header.key.raw in self.memory[0] or not self._visible(header.key.raw):
            return
        top = self.memory[0]
        hb = header.encode()
        if not top.fits(header.payload_len, len(hb)) or not self._room_without_io(
            top, header.payload_len, len(hb)
        ):
            return
        slots = top.reserve(hb, header.payload_len)
        if slots is None:
            return
        top.arena.write(slots[0], memoryview(payload).cast("B")[: header.payload_len])
        top.commit(header.key.raw, slots, len(hb), header.payload_len)
        self.counters["promotions"] += 1

    async def namespaces(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """The namespace id (raw 16 bytes) of each stored block, None where absent or
        unreadable. Reads headers only (no payload, no full decode): the daemon's per-tenant
        visibility check on every EXISTS/DELETE."""
        out: list[bytes | None] = [None] * len(keys)
        disk_idx = []
        for i, key in enumerate(keys):
            t = self._where(key.raw)
            if t is None:
                continue
            if t is self.disk:
                disk_idx.append(i)
            else:
                out[i] = _header_namespace(t.header_sync(key.raw))
        if disk_idx:
            raws = await self.disk.read_headers([keys[i].raw for i in disk_idx])
            for i, raw in zip(disk_idx, raws):
                out[i] = _header_namespace(raw)
        return out

    # ------------------------------------------------------------------ writes
    async def put(self, blocks: Sequence[tuple[BlockHeader, object]]) -> list[PutResult]:
        """Store (header, payload) pairs: reserve, copy, commit. INVALID when the payload does
        not match its header, EXISTS when the key is stored, BUSY when it is being written."""
        results: list[PutResult | None] = [None] * len(blocks)
        headers, payloads, idx = [], [], []
        for i, (h, p) in enumerate(blocks):
            mv = memoryview(p).cast("B")
            if mv.nbytes != h.payload_len:  # the checksum is verified once, at commit
                self.counters["put_invalid"] += 1
                results[i] = PutResult(Status.INVALID)
                continue
            headers.append(h)
            payloads.append(mv)
            idx.append(i)
        reserved = await self.reserve(headers)
        to_commit = []
        for i, mv, r in zip(idx, payloads, reserved):
            if isinstance(r, Status):
                results[i] = PutResult(r)
            else:
                r.view[:] = mv
                to_commit.append((i, r))
        committed = await self.commit([r for _, r in to_commit])
        for (i, _), res in zip(to_commit, committed):
            results[i] = res
        return results  # type: ignore[return-value]

    async def reserve(self, headers: Sequence[BlockHeader], lazy: bool = False) -> list[Reservation | Status]:
        """Phase one of a write: a slot per header (EXISTS / BUSY / NO_SPACE otherwise). The
        slot is invisible to readers until :meth:`commit`; it expires after the lease TTL.
        A reservation without a host slot (disk, GPU) gets a private buffer; with ``lazy`` that
        buffer is not allocated here: its ``view`` is empty and the caller hands the payload
        over with :meth:`attach_payload` (no memory is committed before the bytes come)."""
        self._sweep()
        out: list[Reservation | Status] = []
        for h in headers:
            key = h.key.raw
            if self._where(key) is not None:
                self.counters["put_exists"] += 1
                out.append(Status.EXISTS)
                continue
            if key in self.leases.reserved_keys or key in self.doomed:
                out.append(Status.BUSY)
                continue
            r = await self._reserve_one(h, lazy)
            if r is None:
                self.counters["put_no_space"] += 1
                out.append(Status.NO_SPACE)
            elif self._where(key) is not None or key in self.leases.reserved_keys:
                self._free_reservation(r)  # another writer won the race while we made room
                out.append(Status.EXISTS)
            else:
                self.leases.add_reservation(r)
                out.append(r)
        return out

    async def _reserve_one(self, h: BlockHeader, lazy: bool = False) -> Reservation | None:
        hb = h.encode()
        size = 0 if lazy else h.payload_len  # private buffers only
        rid, expires = self.leases.next_id(), self.leases.deadline(None)
        for tier in self.memory:
            if not tier.fits(h.payload_len, len(hb)):
                continue
            if await self._make_room(tier, h.payload_len, len(hb)):
                slots = tier.reserve(hb, h.payload_len)
                if slots is None:
                    continue
                if isinstance(tier.arena, HostArena):  # written in place (recv_into, RDMA WRITE)
                    view = tier.writable(slots[0], h.payload_len)
                    return Reservation(rid, h, hb, view, slots[0], tier.name, expires, slots=slots)
                # a GPU slot: the bytes land in host memory and are copied up at commit
                buf = bytearray(size)
                return Reservation(
                    rid, h, hb, memoryview(buf), None, tier.name, expires, scratch=buf, slots=slots
                )
        if self.disk is not None and h.payload_len + len(hb) <= self.disk.capacity_bytes:
            buf = bytearray(size)
            return Reservation(rid, h, hb, memoryview(buf), None, None, expires, scratch=buf)
        return None

    async def commit(self, reservations: Sequence[Reservation]) -> list[PutResult]:
        """Phase two: verify each reservation's payload against its header checksum, index it,
        and (write-through) store it on disk in one transaction. Durable when synced to disk."""
        results: list[PutResult] = []
        to_disk: list[tuple[int, Reservation]] = []
        for r in reservations:
            key = r.header.key.raw
            if not self.leases.pop_reservation(r):
                results.append(PutResult(Status.INVALID))  # expired or already done
                continue
            if checksum(r.view) != r.header.checksum:
                self._free_slot(r)
                self.counters["put_invalid"] += 1
                results.append(PutResult(Status.INVALID))
                continue
            if r.tier is not None:
                tier = self._tier(r.tier)
                if r.scratch is not None:
                    tier.arena.write(r.slots[0], r.view)
                tier.commit(key, r.slots, len(r.header_bytes), r.header.payload_len)
                self.counters["puts"] += 1
                self.counters["bytes_in"] += r.header.payload_len
                if self.disk is None:
                    results.append(PutResult(Status.STORED, r.tier, False))
                    continue
                if self.write_back:
                    self.dirty.add(key)
                    results.append(PutResult(Status.STORED, r.tier, False))
                    continue
            results.append(None)  # type: ignore[arg-type]
            to_disk.append((len(results) - 1, r))
        if to_disk:
            keys = [r.header.key.raw for _, r in to_disk]
            for k in keys:
                self.leases.hold(k)  # the slot must not be freed while the writer thread reads it
            try:
                stored = await self.disk.put(
                    [(k, r.header_bytes, r.view) for k, (_, r) in zip(keys, to_disk)]
                )
            finally:
                for k in keys:
                    self._unhold(k)
            for (i, r), ok in zip(to_disk, stored):
                if r.tier is not None:
                    results[i] = PutResult(Status.STORED, r.tier, ok and self.disk.sync)
                    continue
                if ok:
                    self.counters["puts"] += 1
                    self.counters["bytes_in"] += r.header.payload_len
                else:
                    self.counters["put_no_space"] += 1
                results[i] = PutResult(
                    Status.STORED if ok else Status.NO_SPACE, "disk", ok and self.disk.sync
                )
        return results

    def abort(self, reservations: Sequence[Reservation]) -> None:
        """Give back uncommitted reservations (idempotent)."""
        for r in reservations:
            if self.leases.pop_reservation(r):
                self._free_reservation(r)

    def _free_reservation(self, r: Reservation) -> None:
        if r.tier is not None:
            self._tier(r.tier).abandon(r.slots)

    _free_slot = _free_reservation

    def _tier(self, name: str):
        return next(t for t in self.tiers if t.name == name)

    # ------------------------------------------------------------------ leases
    async def lease(
        self, keys: Sequence[BlockKey], ttl_s: float | None = None, max_read_bytes: int | None = None
    ) -> list[Lease | None]:
        """Claim each block for reading: its payload stays put (not evicted, overwritten or
        freed) until :meth:`release` or the TTL. A disk-only block is first brought into DRAM
        (verified) when there is room, else copied privately. None where absent or corrupt,
        and (with ``max_read_bytes``) where reading it from disk would take this call's disk
        reads past that many bytes: the buffers one call allocates are bounded."""
        self._sweep()
        out: list[Lease | None] = []
        read = 0
        for key in keys:
            t = self._where(key.raw)
            if t is None:
                out.append(None)
                continue
            if t is self.disk:
                dram = self.dram
                plen = self.disk.payload_len(key.raw)
                if max_read_bytes is not None and read + plen > max_read_bytes:
                    self.counters["lease_over_bound"] += 1
                    out.append(None)
                    continue
                read += plen
                scratch = bytearray(plen)
                [r] = await self.get_into([key], [scratch])
                if r.status is not Status.HIT:
                    out.append(None)
                    continue
                t = dram if dram is not None and key.raw in dram else None
                if t is None:
                    lease = Lease(
                        self.leases.next_id(),
                        key,
                        r.header,
                        memoryview(scratch).toreadonly(),
                        None,
                        "disk",
                        self.leases.deadline(ttl_s),
                    )
                    self.leases.add_lease(lease)
                    out.append(lease)
                    continue
            else:
                self.counters[f"hits_{t.name}"] += 1
            header = BlockHeader.decode(t.header_sync(key.raw))
            if isinstance(t.arena, HostArena):
                view, off = t.payload_view(key.raw)
                view = view.toreadonly()
            else:
                view, off = memoryview(bytes(t.payload_host(key.raw))), None
            t.touch(key.raw)
            lease = Lease(self.leases.next_id(), key, header, view, off, t.name, self.leases.deadline(ttl_s))
            self.leases.add_lease(lease)
            out.append(lease)
        return out

    def attach_payload(self, r: Reservation, payload: bytearray) -> None:
        """Give a lazy reservation (see :meth:`reserve`) its received payload buffer."""
        if r.scratch is None or r.view.nbytes:
            raise ValueError(f"reservation {r.id} is not a lazy one")
        r.scratch, r.view = payload, memoryview(payload)

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
        for lease in leases:
            if self.leases.pop_lease(lease.id) is not None:
                self._unhold(lease.key.raw)

    def _unhold(self, key: bytes) -> None:
        if self.leases.unhold(key) and key in self.doomed:
            self.doomed.discard(key)
            for t in self.memory:
                t.remove(key)
            self.dirty.discard(key)

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
            if self.leases.held(k):
                self.doomed.add(k)
            else:
                for t in self.memory:
                    t.remove(k)
                self.dirty.discard(k)
            if self.disk is not None and k in self.disk:
                disk_keys.append(k)
        if disk_keys:
            await self.disk.delete(disk_keys)
        self.counters["deletes"] += sum(out)
        return out

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
        """Flush write-back blocks to disk, end leases, close tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.disk is not None and self.dirty:
            for tier in self.memory:
                items = [
                    (k, tier.header_sync(k), tier.payload_host(k)) for k in list(self.dirty) if k in tier
                ]
                if items:
                    ok = await self.disk.put(items)
                    for (k, _, _), stored in zip(items, ok):
                        if stored:
                            self.dirty.discard(k)
            if self.dirty:
                log.warning("event=close_unflushed blocks=%d", len(self.dirty))
        for t in self.memory:
            t.close()
        if self.disk is not None:
            await self.disk.close()
        log.info("event=node_closed")
