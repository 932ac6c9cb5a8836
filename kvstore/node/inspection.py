"""The operator's view of a node: listing, describing, verifying, statistics, integrity check.

Kept apart from the data path (kvstore.node.store); it reads the node's state it is handed and
changes nothing but corrupt copies (verify with repair). Same threading rules as the node:
one event loop, and every pass over many blocks yields to it (kvstore.node.listing), so the
data port keeps serving while an operator lists or verifies a large node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvstore.block import BlockHeader
from kvstore.errors import BlockFormatError
from kvstore.keys import BlockKey
from kvstore.node.listing import KeyOrder, LoopSlices, window
from kvstore.node.state import NodeState
from kvstore.node.tiers.stack import TierStack
from kvstore.results import BlockInfo

# Keys of the key order one page looks at, at least: a page filtered by namespace or tier
# that matches few blocks ends there (a short page, with a cursor) instead of walking the node.
SCAN_MIN = 4096
# Blocks whose headers are read and rows made at a time: what a page keeps is its rows only,
# so a page of 10,000 never holds 10,000 headers for the garbage collector to walk.
_ROW_CHUNK = 256
Row = TypeVar("Row")


@dataclass(frozen=True, slots=True)
class ListPage(Generic[Row]):
    """One page of a listing: its blocks' rows in key order, and the cursor of the next page
    (the last key the page looked at), None only when the page reached the end of the keys."""

    blocks: list[Row]
    next: BlockKey | None


@dataclass(frozen=True, slots=True)
class KeyPage:
    """One page of stored keys (for a paged verify): the keys still stored, how many the
    snapshot holds in all, and the cursor of the next page (None at the end)."""

    keys: list[BlockKey]
    total: int
    next: BlockKey | None


class Inspector:
    """Inspection of one node named ``name``: its ``tiers`` (top first) and its ``state``
    (leases, pinned, dirty and doomed keys, counters: a verify that drops a copy counts a
    checksum failure)."""

    def __init__(self, name: str, tiers: TierStack, state: NodeState) -> None:
        self.name = name
        self.stack = tiers
        self.tiers = tiers.all
        self.leases = state.leases
        self.pinned = state.pinned
        self.dirty = state.dirty
        self.doomed = state.doomed
        self.counters = state.counters
        self.tombstones = state.tombstones
        self.order = KeyOrder()

    def _stored(self, key: bytes) -> bool:
        return key not in self.doomed and any(key in t for t in self.tiers)

    def _sources(self, tier: str | None) -> list:
        if tier is None:
            return self.tiers
        sources = [t for t in self.tiers if t.name == tier]
        if not sources:
            raise ValueError(f"tier {tier!r} is not configured (have {[t.name for t in self.tiers]})")
        return sources

    async def _headers(self, keys: Sequence[bytes]) -> list[BlockHeader | None]:
        """Each key's stored header (None where it is gone or does not decode): memory tiers
        answer from memory, the disk's blocks in one batched read."""
        raws: list[bytes | None] = [None] * len(keys)
        on_disk: list[int] = []
        disk = self.stack.disk
        slices = LoopSlices()
        for i, k in enumerate(keys):
            for t in self.stack.memory:
                if k in t:
                    raws[i] = t.header_sync(k)
                    break
            else:
                if disk is not None and k in disk:
                    on_disk.append(i)
            await slices.tick()
        if on_disk:
            for i, raw in zip(on_disk, await disk.read_headers([keys[i] for i in on_disk])):
                raws[i] = raw
        out: list[BlockHeader | None] = []
        for raw in raws:
            try:
                out.append(None if raw is None else BlockHeader.decode(raw))
            except BlockFormatError:
                out.append(None)
            await slices.tick()
        return out

    async def _header(self, key: bytes) -> BlockHeader | None:
        (h,) = await self._headers([key])
        return h

    def _info(self, key: bytes, header: BlockHeader) -> BlockInfo:
        tiers = tuple(t.name for t in self.tiers if key in t)
        atime = max((t.atime(key) for t in self.tiers if key in t), default=0)
        return BlockInfo(
            key=header.key,
            namespace=header.namespace,
            tiers=tiers,
            payload_len=header.payload_len,
            num_tokens=header.num_tokens,
            created=header.created,
            last_access=float(atime),
            leases=self.leases.holds.get(key, 0),
            pinned=key in self.pinned,
        )

    async def page(
        self,
        tier: str | None = None,
        namespace: BlockKey | None = None,
        after: BlockKey | None = None,
        limit: int = 100,
        row: Callable[[BlockInfo], Row] = lambda info: info,
    ) -> ListPage[Row]:
        """One page of blocks in key order after the cursor ``after`` (exclusive; None: a new
        listing), at most ``limit``, filtered by the tier holding them and by namespace; each
        block's :class:`BlockInfo` goes through ``row`` as it is read (default: kept as is; the
        admin route keeps its JSON text instead). A page looks at no more than
        ``max(limit, SCAN_MIN)`` keys, so a filtered page may be short, even empty, and not be
        the last: only ``next`` None ends a listing (module doc of kvstore.node.listing).
        Raises ValueError for an unknown tier name."""
        sources = self._sources(tier)
        snap = await self.order.current(self.tiers, fresh=after is None)
        keys, at_end = window(snap, None if after is None else after.raw, max(limit, SCAN_MIN))
        want = None if namespace is None else namespace.raw
        picked: list[bytes] = []
        last: bytes | None = None
        slices = LoopSlices()
        for k in keys:
            last = k
            await slices.tick()
            if k in self.doomed:
                continue
            holder = next((t for t in sources if k in t), None)
            if holder is None or (want is not None and holder.namespace(k) != want):
                continue
            picked.append(k)
            if len(picked) >= limit:
                break
        out: list[Row] = []
        for off in range(0, len(picked), _ROW_CHUNK):
            part = picked[off : off + _ROW_CHUNK]
            for k, h in zip(part, await self._headers(part)):
                if h is not None and (namespace is None or h.namespace == namespace) and self._stored(k):
                    out.append(row(self._info(k, h)))  # gone meanwhile: the page is shorter, not the end
                await slices.tick()
        done = at_end and last == (keys[-1] if keys else None)
        return ListPage(out, None if done or last is None else BlockKey(last))

    async def list_blocks(
        self,
        tier: str | None = None,
        namespace: BlockKey | None = None,
        after: BlockKey | None = None,
        limit: int = 100,
    ) -> list[BlockInfo]:
        """Blocks in key order, after ``after`` (exclusive), at most ``limit``; filtered by the
        tier holding them and by namespace: pages (:meth:`page`) followed until ``limit`` or
        the end. Raises ValueError for an unknown tier name."""
        out: list[BlockInfo] = []
        cursor = after
        while len(out) < limit:
            p = await self.page(tier, namespace, cursor, min(limit - len(out), SCAN_MIN))
            out += p.blocks
            if p.next is None:
                break
            cursor = p.next
        return out

    async def key_page(self, after: BlockKey | None, limit: int) -> KeyPage:
        """The next ``limit`` keys of the key order after the cursor ``after`` (None: a new
        pass) that are still stored, with the snapshot's size and the next cursor."""
        snap = await self.order.current(self.tiers, fresh=after is None)
        keys, at_end = window(snap, None if after is None else after.raw, limit)
        kept = [BlockKey(k) for k in keys if self._stored(k)]
        nxt = None if at_end or not keys else BlockKey(keys[-1])
        return KeyPage(kept, len(snap), nxt)

    async def describe(self, key: BlockKey) -> tuple[BlockHeader, BlockInfo] | None:
        """The block's header and what the node knows of it, or None when absent."""
        if not self._stored(key.raw):
            return None
        h = await self._header(key.raw)
        return None if h is None or not self._stored(key.raw) else (h, self._info(key.raw, h))

    async def verify(self, keys: Sequence[BlockKey] | None = None, repair: bool = False) -> dict:
        """Re-check the checksum of every copy (every tier) of the given blocks, or of all.
        With ``repair``, corrupt copies are dropped. Returns counts and the corrupt keys."""
        if keys is not None:
            todo = [k.raw for k in keys]
        else:
            todo, _ = window(await self.order.build(self.tiers), None, 1 << 62)
        corrupt: list[str] = []
        checked = dropped = 0
        slices = LoopSlices()
        for k in todo:
            for t in self.tiers:
                await slices.tick()
                if k not in t:
                    continue
                checked += 1
                if await t.intact(k):
                    continue
                corrupt.append(f"{k.hex()}@{t.name}")  # reported, not counted: verify may run often
                if repair and not self.leases.held(k) and k in t:
                    await t.delete([k])
                    dropped += 1
                    self.counters["checksum_failures"] += 1  # like the read path: once per dropped copy
        return {"checked": checked, "corrupt": corrupt, "dropped": dropped}

    def stats(self) -> dict:
        """Counters of the node and usage of each tier (plain JSON-able dict)."""
        return {
            "node": {
                "name": self.name,
                "time": time.time(),
                "leases_active": len(self.leases.leases),
                "reservations_active": len(self.leases.reservations),
                "pinned": len(self.pinned),
                "dirty": len(self.dirty),
                **dict(self.counters),
            },
            "tiers": {t.name: t.stats() for t in self.tiers},
            # the node's live tombstones per deleting tenant ("*": the operator's admin routes)
            "tombstones": self.tombstones.by_tenant(),
        }
