"""Reading blocks out of a node's tiers into callers' buffers: one copy per block, verified
(disk copies against their checksum, every copy against the key and the caller's
expectations), counted in the node's counters. Same threading rules as the node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from kvstore.block import BlockHeader
from kvstore.errors import BlockFormatError
from kvstore.keys import BlockKey
from kvstore.node.tiers.base import BottomTier, Tier
from kvstore.results import Expect, GetResult, Status


class Reader:
    """Reads for a node whose bottom tier is ``disk`` (or None). ``where(key)``: the highest
    tier holding a visible key, or None. ``promote(header, payload)``: offered each verified
    disk hit whose copy is still the one stored when the read ends (the node's placement
    decides whether it moves up)."""

    def __init__(
        self,
        disk: BottomTier | None,
        where: Callable[[bytes], Tier | None],
        promote: Callable[[BlockHeader, object], None],
        counters: Counter[str],
    ) -> None:
        self._disk = disk
        self._where = where
        self._promote = promote
        self._counters = counters

    async def get_into(
        self,
        keys: Sequence[BlockKey],
        bufs: Sequence,
        expect: Sequence[Expect | None] | None = None,
    ) -> list[GetResult]:
        """Copy each block's payload into its buffer (first ``payload_len`` bytes). Disk copies
        are checksum-verified (CORRUPT: dropped); ``expect`` checks parent and token ids
        (MISMATCH). A buffer's content is unspecified unless its result is HIT. Every disk
        hit of a copy still stored when the read ends is offered to ``promote``."""
        results: list[GetResult | None] = [None] * len(keys)
        disk_idx: list[int] = []
        for i, key in enumerate(keys):
            t = self._where(key.raw)
            if t is None:
                results[i] = GetResult(Status.MISS)
            elif t is self._disk:
                disk_idx.append(i)
            else:
                [(st, hdr)] = await t.get_into([key.raw], [bufs[i]])
                results[i] = self._judge(key, st, hdr, t.name, expect[i] if expect else None)
                if results[i].status is Status.HIT:
                    t.touch(key.raw)
        if disk_idx:
            exp = [expect[i] for i in disk_idx] if expect else None
            disk = self._disk
            # a copy deleted (or deleted and stored anew) while it was read must not move up:
            # it would bring a deleted block back, or shadow the new copy with the old bytes
            versions = [disk.version(keys[i].raw) for i in disk_idx]  # type: ignore[union-attr]
            got = await self.read_disk(
                [keys[i] for i in disk_idx], [bufs[i] for i in disk_idx], exp, count=False
            )
            for i, v, r in zip(disk_idx, versions, got):
                results[i] = r
                if r.status is Status.HIT and disk.version(keys[i].raw) == v:  # type: ignore[union-attr]
                    self._promote(r.header, bufs[i])
        for r in results:
            self.count(r)  # type: ignore[arg-type]
        return results  # type: ignore[return-value]

    async def read_disk(
        self,
        keys: Sequence[BlockKey],
        bufs: Sequence,
        expect: Sequence[Expect | None] | None = None,
        count: bool = True,
    ) -> list[GetResult]:
        """Read disk copies straight into ``bufs`` (one copy each), verified and judged against
        their keys and ``expect``; with ``count``, counted as reads. A corrupt copy is dropped."""
        got = await self._disk.get_into([k.raw for k in keys], bufs)  # type: ignore[union-attr]
        exp = expect or [None] * len(keys)
        out = [self._judge(k, st, hdr, "disk", e) for k, (st, hdr), e in zip(keys, got, exp)]
        if count:
            for r in out:
                self.count(r)
        return out

    def count(self, r: GetResult) -> None:
        """Count one read's outcome (get_<status>, hits_<tier>, bytes_out)."""
        self._counters[f"get_{r.status.name.lower()}"] += 1
        if r.status is Status.HIT:
            self._counters[f"hits_{r.tier}"] += 1
            self._counters[f"hit_tokens_{r.tier}"] += r.header.num_tokens
            self._counters["bytes_out"] += r.header.payload_len

    def _judge(
        self, key: BlockKey, st: Status, hdr: bytes | None, tier: str, exp: Expect | None
    ) -> GetResult:
        if st is Status.CORRUPT:
            self._counters["checksum_failures"] += 1
            return GetResult(Status.CORRUPT, None, tier)
        if hdr is None:
            return GetResult(st)
        try:
            header = BlockHeader.decode(hdr)
        except BlockFormatError:
            self._counters["checksum_failures"] += 1
            return GetResult(Status.CORRUPT, None, tier)
        if st is not Status.HIT:
            return GetResult(st, header, tier)
        if not header.matches(key, exp.parent if exp else None, exp.token_bytes if exp else None):
            return GetResult(Status.MISMATCH, header, tier)
        return GetResult(Status.HIT, header, tier)
