"""The operator's view of a node: listing, describing, verifying, statistics, integrity check.

Kept apart from the data path (kvstore.node.store); it reads the node's state it is handed and
changes nothing but corrupt copies (verify with repair). Same threading rules as the node:
one event loop, and every pass over many blocks yields to it (kvstore.node.listing), so the
data port keeps serving while an operator lists or verifies a large node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgpack
import numpy as np

from kvstore.block import BlockHeader
from kvstore.errors import BlockFormatError
from kvstore.keys import KEY_BYTES, BlockKey, trusted_key
from kvstore.node.listing import KEY_CHUNK, KeyOrder, LoopSlices, key_chunks, key_list, window
from kvstore.node.state import NodeState
from kvstore.node.tiers.stack import TierStack
from kvstore.node.tiers.visibility import Visibility
from kvstore.results import BlockInfo

# Keys of the key order one page looks at, at least: a page filtered by namespace or tier
# that matches few blocks ends there (a short page, with a cursor) instead of walking the node.
SCAN_MIN = 4096
# Blocks whose disk headers one read asks for: the disk's reader thread runs Python per key
# and holds the interpreter lock meanwhile (~1 us a key), so the loop waits for it at most that.
_DISK_CHUNK = 64
# Keys of the key order a page picks from in one numpy pass per tier (~0.1 ms a tier).
_PICK_CHUNK = 256
Row = TypeVar("Row")


def listed_fields(raw: bytes) -> tuple[bytes, int, float] | None:
    """The namespace, token count and creation time a listing shows of an encoded header
    (kvstore.block.BlockHeader's map), None where it is no such map. One msgpack decode and
    none of :meth:`BlockHeader.decode`'s checks of the rest (a quarter of its cost): a
    listing reads every block's header; ``verify`` is what checks them."""
    try:
        d = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        ns, tokens, created = d["ns"], d["tokens"], d["created"]
    except Exception:  # msgpack raises several unrelated types; a list or a short map too
        return None
    if type(ns) is not bytes or len(ns) != KEY_BYTES or type(tokens) is not bytes:
        return None
    if type(created) not in (float, int):
        return None
    return ns, len(tokens) // 4, float(created)


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

    async def _raw_headers(self, keys: Sequence[bytes], slices: LoopSlices) -> list[bytes | None]:
        """Each key's stored header, encoded (None where it is gone): memory tiers answer from
        memory, the disk's blocks in batched reads of ``_DISK_CHUNK`` (its reader thread runs
        Python per key, holding the interpreter lock the loop needs meanwhile)."""
        raws: list[bytes | None] = [None] * len(keys)
        on_disk: list[int] = []
        disk = self.stack.disk
        for i, k in enumerate(keys):
            for t in self.stack.memory:
                if k in t:
                    raws[i] = t.header_sync(k)
                    break
            else:
                if disk is not None and k in disk:
                    on_disk.append(i)
            await slices.tick()
        for off in range(0, len(on_disk), _DISK_CHUNK):
            at = on_disk[off : off + _DISK_CHUNK]
            for i, raw in zip(at, await disk.read_headers([keys[i] for i in at])):
                raws[i] = raw
            await slices.tick()
        return raws

    async def _header(self, key: bytes) -> BlockHeader | None:
        (raw,) = await self._raw_headers([key], LoopSlices())
        try:
            return None if raw is None else BlockHeader.decode(raw)
        except BlockFormatError:
            return None

    def _info(self, key: bytes, namespace: bytes, num_tokens: int, created: float) -> BlockInfo | None:
        """What the node knows of ``key`` beside its header's fields; None when it is no
        longer stored (deleted, or in no tier)."""
        if key in self.doomed:
            return None
        held = [t for t in self.tiers if key in t]
        if not held:
            return None
        return BlockInfo(
            key=trusted_key(key),
            namespace=trusted_key(namespace),
            tiers=tuple([t.name for t in held]),
            payload_len=held[0].payload_len(key),
            num_tokens=num_tokens,
            created=created,
            last_access=float(max([t.atime(key) for t in held])),
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
        A block whose stored header does not decode as a header map is left out (``verify``
        names it). Raises ValueError for an unknown tier name."""
        sources = self._sources(tier)
        snap = await self.order.current(self.tiers, fresh=after is None)
        part, at_end = window(snap, None if after is None else after.raw, max(limit, SCAN_MIN))
        want = None if namespace is None else namespace.raw
        sees = Visibility(everything=True) if want is None else Visibility(frozenset([want]))
        out: list[Row] = []
        last: bytes | None = None
        slices = LoopSlices()
        for off in range(0, len(part), _PICK_CHUNK):
            chunk = part[off : off + _PICK_CHUNK]
            picked = await self._pick(chunk, sources, sees, slices)
            need = limit - len(out)
            full = len(picked) >= need
            if full:  # the page ends at the key that fills it: the cursor says so
                picked = picked[:need]
                last = chunk[picked[-1] : picked[-1] + 1].tobytes()
            else:
                last = chunk[-1:].tobytes()
            await slices.tick()
            for at in range(0, len(picked), KEY_CHUNK):
                keys = key_list(chunk[picked[at : at + KEY_CHUNK]])
                for k, raw in zip(keys, await self._raw_headers(keys, slices)):
                    fields = None if raw is None else listed_fields(raw)
                    ok = fields is not None and (want is None or fields[0] == want)
                    info = self._info(k, *fields) if ok else None
                    if info is not None:  # else gone meanwhile (or unreadable): a shorter page, not the end
                        out.append(row(info))
                    await slices.tick()
            if full:
                break
        done = at_end and (not len(part) or last == part[-1:].tobytes())
        return ListPage(out, None if done or last is None else BlockKey(last))

    async def _pick(
        self, chunk: np.ndarray, sources: list, sees: Visibility, slices: LoopSlices
    ) -> np.ndarray:
        """Positions in ``chunk`` (a slice of the key order) of the keys a ``sources`` tier
        holds in a namespace ``sees`` accepts, not deleted: numpy passes over each tier's
        index (:meth:`LruIndex.probe`, ~0.1 ms a tier), no Python per key (a filtered page
        looks at thousands of keys to answer a few)."""
        pairs = chunk.view("<u8").reshape(len(chunk), KEY_BYTES // 8)
        keep = np.zeros(len(chunk), dtype=bool)
        for t in sources:
            keep |= t.probe(pairs, sees)[1]
            await slices.tick()
        if self.doomed:
            keep &= np.fromiter((k not in self.doomed for k in key_list(chunk)), dtype=bool, count=len(chunk))
        return np.flatnonzero(keep)

    async def key_page(self, after: BlockKey | None, limit: int) -> KeyPage:
        """The next ``limit`` keys of the key order after the cursor ``after`` (None: a new
        pass) that are still stored, with the snapshot's size and the next cursor."""
        snap = await self.order.current(self.tiers, fresh=after is None)
        part, at_end = window(snap, None if after is None else after.raw, limit)
        kept: list[BlockKey] = []
        slices = LoopSlices()
        for keys in key_chunks(part):
            kept += [trusted_key(k) for k in keys if self._stored(k)]
            await slices.tick()
        nxt = None if at_end or not len(part) else BlockKey(key_list(part[-1:])[0])
        return KeyPage(kept, len(snap), nxt)

    async def where(self, keys: Sequence[BlockKey]) -> list[tuple[tuple[str, ...], int | None, bool]]:
        """Per key: the tiers holding it (top first), its payload length (None when absent)
        and whether it is pinned; from the tiers' indexes (no header read), in slices."""
        out: list[tuple[tuple[str, ...], int | None, bool]] = []
        slices = LoopSlices()
        for key in keys:
            k = key.raw
            held = [] if k in self.doomed else [t for t in self.tiers if k in t]
            size = held[0].payload_len(k) if held else None
            out.append((tuple(t.name for t in held), size, bool(held) and k in self.pinned))
            await slices.tick()
        return out

    async def describe(self, key: BlockKey) -> tuple[BlockHeader, BlockInfo] | None:
        """The block's header and what the node knows of it, or None when absent."""
        if not self._stored(key.raw):
            return None
        h = await self._header(key.raw)
        info = None if h is None else self._info(key.raw, h.namespace.raw, h.num_tokens, h.created)
        return None if info is None else (h, info)

    async def verify(self, keys: Sequence[BlockKey] | None = None, repair: bool = False) -> dict:
        """Re-check the checksum of every copy (every tier) of the given blocks, or of all.
        With ``repair``, corrupt copies are dropped. Returns counts and the corrupt keys."""
        if keys is not None:
            chunks: Iterable[list[bytes]] = [[k.raw for k in keys]]
        else:
            chunks = key_chunks(await self.order.build(self.tiers))
        corrupt: list[str] = []
        checked = dropped = 0
        slices = LoopSlices()
        for k in (k for chunk in chunks for k in chunk):
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
