"""The disk tier: one LMDB environment; headers and payloads in two named databases.

LMDB commits are atomic, so a process killed mid-write leaves either the whole block or none
of it; with ``sync`` every commit is flushed before the put returns, so an acknowledged durable
block survives ``kill -9`` and power loss. Every read verifies the payload's xxh3_64 checksum
in the reading thread; a bad copy is reported CORRUPT and deleted.

The in-memory index (key -> packed lengths, namespace id, copy version and access time, in LRU
order) is rebuilt from the header database at open. Reads run on a small thread pool, writes on one writer thread (LMDB
allows one writer); the event loop never waits on disk. Call from one event loop.

One file (~450 lines) on purpose: the reads, the writes, the map-full fallback and the index
rebuild all run against one LMDB environment under its transaction and thread rules (one
writer thread, readers on the pool, the close that waits for both); split, each part would
need those rules restated to be checked.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import lmdb

from kvstore.block import BlockHeader, checksum
from kvstore.errors import BlockFormatError, TierError
from kvstore.node.tiers.index import (
    MAX_HEADER_LEN,
    MAX_OFFSET,
    MAX_PAYLOAD_LEN,
    LruIndex,
    entry_header_len,
    entry_offset,
    entry_payload_len,
    header_fields,
    now_s,
)
from kvstore.node.tiers.order import EvictionOrder
from kvstore.node.tiers.shares import TenantShares
from kvstore.node.tiers.tasks import Finishing, to_the_end, until_the_thread_ends
from kvstore.results import Status

log = logging.getLogger("tierkv.disk")

# A full map is retried this many times, each after dropping twice as many LRU bytes as the
# write needs: enough to get past fragmentation, bounded so a write never loops.
_MAP_FULL_RETRIES = 6


class DiskTier(LruIndex):
    """A :class:`kvstore.node.tiers.base.BottomTier` over LMDB at ``path``. ``protected``: see
    :meth:`protect`. ``finishing``: the node's tracker of writes left finishing by cancelled
    callers (its own when not given); they must end before :meth:`close`."""

    name = "disk"

    def __init__(
        self,
        path: str,
        capacity: int,
        *,
        map_size: int = 0,
        sync: bool = True,
        writemap: bool = False,
        protected: Callable[[bytes], bool] = lambda k: False,
        finishing: Finishing | None = None,
        order: EvictionOrder | None = None,
        shares: TenantShares | None = None,
    ) -> None:
        super().__init__(order)
        self.shares = shares if shares is not None else TenantShares()
        self.path = path
        self._capacity = capacity
        self.sync = sync
        self._protected = protected
        self._finishing = finishing if finishing is not None else Finishing()
        map_size = map_size or int(capacity * 1.5) + (64 << 20)
        self.map_size = map_size
        try:
            os.makedirs(path, exist_ok=True)
            self.env = lmdb.open(
                path,
                map_size=map_size,
                max_dbs=2,
                sync=sync,
                metasync=sync,
                writemap=writemap,
                readahead=False,
                max_readers=64,
            )
        except (OSError, lmdb.Error) as exc:
            raise TierError(f"disk.path {path!r}: cannot open LMDB environment: {exc}") from exc
        self.env.reader_check()  # clear reader slots left by a killed process
        self._hdr = self.env.open_db(b"hdr")
        self._data = self.env.open_db(b"data")
        self.payload_bytes = 0
        self._used = 0
        self.evictions = 0
        self.checksum_failures = 0
        self.write_errors = 0
        self.ram_refusals = 0  # blocks refused for the node's RAM budget (kvstore.node.tiers.ram)
        self.map_full_evictions = 0  # blocks dropped because the map, not capacity, was full
        self._last_version = 0  # see version()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tierkv-disk-w")
        self._readers = ThreadPoolExecutor(4, thread_name_prefix="tierkv-disk-r")
        self._write_lock = asyncio.Lock()
        self._rebuild()

    # ------------------------------------------------------------------ startup
    def _rebuild(self) -> None:
        """Index every stored block, oldest first; drop headers that do not decode."""
        found: list[tuple[float, bytes, int, int, bytes, bytes]] = []
        seen_ns: dict[bytes, bytes] = {}
        bad: list[bytes] = []
        with self.env.begin() as txn:
            for key, hdr in txn.cursor(db=self._hdr):
                try:
                    h = BlockHeader.decode(hdr)
                except BlockFormatError:
                    bad.append(bytes(key))
                    continue
                if h.key.raw != key:
                    bad.append(bytes(key))
                    continue
                ns = seen_ns.setdefault(h.namespace.raw, h.namespace.raw)  # one object per namespace
                found.append((h.created, bytes(key), len(hdr), h.payload_len, ns, h.parent.raw))
        if bad:
            with self.env.begin(write=True) as txn:
                for k in bad:
                    txn.delete(k, db=self._hdr)
                    txn.delete(k, db=self._data)
            log.warning("event=disk_rebuild_dropped count=%d path=%s", len(bad), self.path)
        found.sort()
        t = now_s()
        for _, key, hlen, plen, ns, parent in found:
            self._index_add(key, self._next_version(), hlen, plen, t, ns, parent)
            self.payload_bytes += plen
            self._used += plen + hlen

    # ------------------------------------------------------------------ versions
    def version(self, key: bytes) -> int | None:
        """The version of the stored copy of ``key``, None when absent. Every copy indexed
        (stored, or found at open) gets a new one, so a version read before and again after
        an await is equal only when no delete, eviction or new store of ``key`` completed in
        between: the node promotes a copy it read only when it is still the one stored."""
        e = self._index.get(key)
        return None if e is None else entry_offset(e)

    def _next_version(self) -> int:
        # kept in the entry's offset field (a disk block has no slot); it wraps after 2**42
        # copies, far beyond any one read's lifetime
        self._last_version = self._last_version % MAX_OFFSET + 1
        return self._last_version

    # ------------------------------------------------------------------ sizes
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def durable(self) -> bool:
        """With ``sync``, a stored block is flushed before :meth:`put` returns."""
        return self.sync

    def fits(self, payload_len: int, header_len: int) -> bool:
        # the index packs both lengths in fixed fields: a longer one would overflow into the
        # next field (and such a header does not decode at the next open anyway)
        return (
            payload_len <= MAX_PAYLOAD_LEN
            and header_len <= MAX_HEADER_LEN
            and payload_len + header_len <= self._capacity
        )

    def protect(self, protected: Callable[[bytes], bool]) -> None:
        """Never evict a key for which ``protected`` is true to make room for a put (the node
        passes its leased and pinned keys: a reader's block stays on disk)."""
        self._protected = protected

    # ------------------------------------------------------------------ reads
    async def get_into(
        self, keys: Sequence[bytes], bufs: Sequence, drop_corrupt: bool = True
    ) -> list[tuple[Status, bytes | None]]:
        """Copy and verify each payload into its buffer. Per key: (HIT, header), (MISS, None),
        (BUF_TOO_SMALL, header) or (CORRUPT, None) — a corrupt copy is counted and, with
        ``drop_corrupt``, deleted before return."""
        want = [k if k in self._index else None for k in keys]
        loop = asyncio.get_running_loop()
        out = await until_the_thread_ends(loop.run_in_executor(self._readers, self._read_batch, want, bufs))
        corrupt = [k for k, (st, _) in zip(keys, out) if st is Status.CORRUPT]
        if corrupt and drop_corrupt:
            self.checksum_failures += len(corrupt)
            log.warning("event=checksum_failure tier=disk keys=%s", ",".join(k.hex() for k in corrupt))
            await self.delete(corrupt)
        for k, (st, _) in zip(keys, out):
            if st is Status.HIT:
                self.touch(k)
        return out

    def _read_batch(self, keys, bufs) -> list[tuple[Status, bytes | None]]:
        out: list[tuple[Status, bytes | None]] = []
        with self.env.begin(buffers=True) as txn:
            for key, buf in zip(keys, bufs):
                if key is None:
                    out.append((Status.MISS, None))
                    continue
                hdr, data = txn.get(key, db=self._hdr), txn.get(key, db=self._data)
                if hdr is None or data is None:
                    out.append((Status.MISS, None))
                    continue
                hdr = bytes(hdr)
                try:
                    h = BlockHeader.decode(hdr)
                except BlockFormatError:
                    out.append((Status.CORRUPT, None))
                    continue
                dst = memoryview(buf).cast("B")
                if dst.nbytes < len(data):
                    out.append((Status.BUF_TOO_SMALL, hdr))
                    continue
                n = len(data)
                dst[:n] = data
                ok = n == h.payload_len and checksum(dst[:n]) == h.checksum
                out.append((Status.HIT, hdr) if ok else (Status.CORRUPT, None))
        return out

    async def read_header(self, key: bytes) -> bytes | None:
        if key not in self._index:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, self._read_header, key)

    def _read_header(self, key: bytes) -> bytes | None:
        with self.env.begin() as txn:
            return txn.get(key, db=self._hdr)

    async def read_headers(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's stored header (None where absent): one read transaction in one reader
        thread for the whole batch (the orphan pass reads every block's parent)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, self._read_headers, list(keys))

    def _read_headers(self, keys: list[bytes]) -> list[bytes | None]:
        with self.env.begin() as txn:
            return [txn.get(k, db=self._hdr) if k in self._index else None for k in keys]

    async def intact(self, key: bytes) -> bool:
        """Whether the stored copy reads back and verifies; a bad copy is not dropped."""
        [(st, _)] = await self.get_into([key], [bytearray(self.payload_len(key))], drop_corrupt=False)
        return st is Status.HIT

    # ------------------------------------------------------------------ writes
    async def put(self, items: Sequence[tuple[bytes, bytes, object]], demoted: bool = False) -> list[bool]:
        """Store (key, header, payload) triples in one transaction, evicting least recently
        used unprotected blocks to stay within capacity. True where stored (and synced, if
        configured) on return; False where no room could be made or the write failed. The
        caller keeps each payload buffer unchanged until this returns. Runs to the end when
        the caller is cancelled (see :func:`kvstore.node.tiers.tasks.to_the_end`). ``demoted``:
        see :meth:`Tier.put`."""
        return await to_the_end(self._put(items, demoted), self._finishing)

    async def _put(self, items, demoted: bool) -> list[bool]:
        async with self._write_lock:  # room is computed and spent by one put at a time
            return await self._put_locked(items, demoted)

    async def _put_locked(self, items, demoted: bool) -> list[bool]:
        todo, evict, room = [], {}, self._capacity - self._used
        queued: set[bytes] = set()  # a key twice in ``items`` is written and counted once
        writer_ns: list[bytes | None] = [None]  # the namespace of the item the plan makes room for

        def evictable(victim: bytes) -> bool:
            return not self._protected(victim) and self.shares.allows(self, victim, writer_ns[0])

        # eviction order, the victims counted as gone for the rest of the plan (a chain's
        # parent follows its children); the index does not change before the await
        candidates = self._order.candidates(evictable)
        try:
            self._plan(items, todo, evict, room, queued, candidates, writer_ns)
        finally:
            candidates.close()
        if todo or evict:
            need = sum(memoryview(p).nbytes + len(h) for _, h, p in todo)
            if not await self._write_evicting(todo, list(evict), need, {k for k, _, _ in todo}):
                return [key in self._index for key, _, _ in items]
        for victim in evict:
            if self._drop(victim):
                self.evictions += 1
        t = now_s()
        for key, hdr, payload in todo:
            plen = memoryview(payload).nbytes
            ns, parent = header_fields(hdr)
            self._index_add(key, self._next_version(), len(hdr), plen, t, ns, parent, demoted)
            self.payload_bytes += plen
            self._used += plen + len(hdr)
        return [key in self._index for key, _, _ in items]

    def _plan(
        self, items, todo: list, evict: dict, room: int, queued: set[bytes], candidates, writer_ns: list
    ) -> None:
        """Which ``items`` to write (into ``todo``) and which unprotected blocks to evict for
        them (into ``evict``), taken from ``candidates`` in eviction order (the ones it
        accepts: unprotected, and where ``shares`` allow it for ``writer_ns[0]``, set here to
        each item's namespace); ``room``: free bytes now."""
        ram = self.ram_free()  # the node's RAM budget for indexes (kvstore.node.tiers.ram)
        for key, hdr, payload in items:
            if key in self._index or key in queued or not self.fits(memoryview(payload).nbytes, len(hdr)):
                continue
            need = memoryview(payload).nbytes + len(hdr)
            ram_need = self.ram_cost(len(hdr))
            writer_ns[0] = header_fields(hdr)[0]
            while room < need or ram < ram_need:
                victim = next(candidates, None)
                if victim is None:
                    break
                if victim in evict:
                    continue
                evict[victim] = None
                e = self._index[victim]
                room += entry_payload_len(e) + entry_header_len(e)
                ram += self.ram_cost(entry_header_len(e))
            if room >= need and ram >= ram_need:
                room -= need
                ram -= ram_need
                todo.append((key, hdr, payload))
                queued.add(key)
            elif ram < ram_need:
                self.ram_refusals += 1

    async def _write_evicting(self, todo, evict: list[bytes], need: int, keep: set[bytes]) -> bool:
        """Write ``todo`` and delete ``evict`` in one transaction. When the map (the bound on the
        file's size) is full although capacity says there is room -- LMDB's free pages are
        fragmented for the large values, or were still held by a reader -- drop more least
        recently used blocks in a transaction of their own (a transaction cannot reuse pages it
        frees itself) and retry, at most ``_MAP_FULL_RETRIES`` times, asking for twice the room
        each time. False (counted in ``write_errors``) when the write still fails."""
        loop = asyncio.get_running_loop()
        for attempt in range(_MAP_FULL_RETRIES + 1):
            try:
                await loop.run_in_executor(self._writer, self._write_batch, todo, evict)
                return True
            except lmdb.MapFullError as exc:
                more = self._lru_unprotected(need << attempt, keep | set(evict))
                if attempt == _MAP_FULL_RETRIES or not (more or evict):
                    self.write_errors += 1
                    log.error(
                        "event=disk_map_full blocks=%d map_size=%d error=%r", len(todo), self.map_size, exc
                    )
                    return False
                try:
                    await loop.run_in_executor(self._writer, self._write_batch, [], evict + more)
                except lmdb.Error as exc2:
                    self.write_errors += 1
                    log.error("event=disk_write_failed blocks=%d error=%r", len(todo), exc2)
                    return False
                for k in evict + more:
                    if self._drop(k):
                        self.evictions += 1
                self.map_full_evictions += len(more)
                evict = []
            except lmdb.Error as exc:
                self.write_errors += 1
                log.error("event=disk_write_failed blocks=%d error=%r", len(todo), exc)
                return False
        return False

    def _lru_unprotected(self, nbytes: int, skip: set[bytes]) -> list[bytes]:
        """The first unprotected keys in eviction order (not in ``skip``) holding ``nbytes``,
        or all of them when there are not that many."""
        out, got = [], 0
        # each taken key counted as gone for the rest of the pass (a chain's parent follows)
        candidates = self._order.candidates(lambda k: k not in skip and not self._protected(k))
        try:
            for k in candidates:
                if got >= nbytes:
                    break
                e = self._index[k]
                out.append(k)
                got += entry_payload_len(e) + entry_header_len(e)
        finally:
            candidates.close()
        return out

    def _write_batch(self, todo, evict) -> None:
        with self.env.begin(write=True) as txn:
            for key in evict:
                txn.delete(key, db=self._hdr)
                txn.delete(key, db=self._data)
            for key, hdr, payload in todo:
                txn.put(key, payload, db=self._data)
                txn.put(key, hdr, db=self._hdr)

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        """Remove keys; False where absent. Runs to the end when the caller is cancelled (see
        :func:`kvstore.node.tiers.tasks.to_the_end`)."""
        return await to_the_end(self._delete(keys), self._finishing)

    async def _delete(self, keys: Sequence[bytes]) -> list[bool]:
        present = [k for k in keys if k in self._index]
        if present:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._writer, self._write_batch, [], present)
        return [self._drop(k) for k in keys]

    def _drop(self, key: bytes) -> bool:
        e = self._index_pop(key)
        if e is None:
            return False
        self.payload_bytes -= entry_payload_len(e)
        self._used -= entry_payload_len(e) + entry_header_len(e)
        return True

    # ------------------------------------------------------------------ order, stats, close
    def stats(self) -> dict:
        return {
            "capacity_bytes": self._capacity,
            "used_bytes": self._used,
            "payload_bytes": self.payload_bytes,
            "blocks": len(self._index),
            "evictions": self.evictions,
            "checksum_failures": self.checksum_failures,
            "write_errors": self.write_errors,
            "map_full_evictions": self.map_full_evictions,
            "map_size_bytes": self.map_size,
            "file_bytes": self.file_bytes(),
            "sync": self.sync,
            **self.eviction_stats(),
            "share_refusals": self.shares.refused,
            "ram_refusals": self.ram_refusals,
        }

    def file_bytes(self) -> int:
        """Size of the LMDB data file on disk (bounded by the map size)."""
        try:
            return os.path.getsize(os.path.join(self.path, "data.mdb"))
        except OSError:
            return 0

    def check(self) -> None:
        assert self._used <= self._capacity
        with self.env.begin() as txn:
            assert txn.stat(self._hdr)["entries"] == len(self._index)
            assert txn.stat(self._data)["entries"] == len(self._index)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._writer, self.env.sync, True)
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self.env.close()
