"""The operator's view of a node: listing, describing, verifying, statistics, integrity check.

Kept apart from the data path (kvstore.node.store); it reads the node's state it is handed and
changes nothing but corrupt copies (verify with repair). Same threading rules as the node.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence

from kvstore.block import BlockHeader
from kvstore.errors import BlockFormatError
from kvstore.keys import BlockKey
from kvstore.node.state import NodeState
from kvstore.node.tiers.stack import TierStack
from kvstore.results import BlockInfo


class Inspector:
    """Inspection of one node named ``name``: its ``tiers`` (top first) and its ``state``
    (leases, pinned, dirty and doomed keys, counters: a verify that drops a copy counts a
    checksum failure)."""

    def __init__(self, name: str, tiers: TierStack, state: NodeState) -> None:
        self.name = name
        self.tiers = tiers.all
        self.leases = state.leases
        self.pinned = state.pinned
        self.dirty = state.dirty
        self.doomed = state.doomed
        self.counters = state.counters

    def _stored(self, key: bytes) -> bool:
        return key not in self.doomed and any(key in t for t in self.tiers)

    async def _header(self, key: bytes) -> BlockHeader | None:
        for t in self.tiers:
            if key in t:
                raw = await t.read_header(key)
                if raw is None:
                    continue
                try:
                    return BlockHeader.decode(raw)
                except BlockFormatError:
                    return None
        return None

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

    async def list_blocks(
        self,
        tier: str | None = None,
        namespace: BlockKey | None = None,
        after: BlockKey | None = None,
        limit: int = 100,
    ) -> list[BlockInfo]:
        """Blocks in key order, after ``after`` (exclusive), at most ``limit``; filtered by the
        tier holding them and by namespace. Raises ValueError for an unknown tier name."""
        sources = self.tiers
        if tier is not None:
            sources = [t for t in self.tiers if t.name == tier]
            if not sources:
                raise ValueError(f"tier {tier!r} is not configured (have {[t.name for t in self.tiers]})")
        keys: set[bytes] = set()
        for t in sources:
            keys.update(t.keys())
        keys -= self.doomed
        lo = after.raw if after is not None else b""
        out: list[BlockInfo] = []
        cand = (
            sorted(k for k in keys if k > lo)
            if namespace is not None
            else heapq.nsmallest(limit, (k for k in keys if k > lo))
        )
        for k in cand:
            h = await self._header(k)
            if h is None or (namespace is not None and h.namespace != namespace):
                continue
            out.append(self._info(k, h))
            if len(out) >= limit:
                break
        return out

    async def describe(self, key: BlockKey) -> tuple[BlockHeader, BlockInfo] | None:
        """The block's header and what the node knows of it, or None when absent."""
        if not self._stored(key.raw):
            return None
        h = await self._header(key.raw)
        return None if h is None else (h, self._info(key.raw, h))

    async def verify(self, keys: Sequence[BlockKey] | None = None, repair: bool = False) -> dict:
        """Re-check the checksum of every copy (every tier) of the given blocks, or of all.
        With ``repair``, corrupt copies are dropped. Returns counts and the corrupt keys."""
        todo = (
            [k.raw for k in keys] if keys is not None else sorted({k for t in self.tiers for k in t.keys()})  # noqa: SIM118
        )
        corrupt: list[str] = []
        checked = dropped = 0
        for k in todo:
            for t in self.tiers:
                if k not in t:
                    continue
                checked += 1
                if await t.intact(k):
                    continue
                corrupt.append(f"{k.hex()}@{t.name}")  # reported, not counted: verify may run often
                if repair and not self.leases.held(k):
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
        }
