"""Reading disk copies into buffers: one copy per block, verified (the disk tier checks each
payload against its checksum; here each header is decoded and checked against its key and the
caller's expectations) and counted in the node's counters. The leaser's way to disk
(kvstore.node.leasing); same threading rules as the node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvstore.block import BlockHeader, check_block
from kvstore.errors import BlockFormatError
from kvstore.keys import BlockKey
from kvstore.node.state import NodeState
from kvstore.node.tiers.stack import TierStack
from kvstore.results import Expect, GetResult, Status


class DiskReads:
    """Reads from the bottom tier of ``tiers``, counted in ``state``'s counters."""

    def __init__(self, tiers: TierStack, state: NodeState) -> None:
        self._disk = tiers.disk
        self._counters = state.counters

    async def read(
        self,
        keys: Sequence[BlockKey],
        bufs: Sequence,
        expect: Sequence[Expect | None] | None = None,
        count: bool = True,
    ) -> list[GetResult]:
        """Read disk copies straight into ``bufs`` (one copy each), verified and judged against
        their keys and ``expect``; with ``count``, counted as reads. A corrupt copy is dropped
        (by the disk tier) and answered CORRUPT."""
        got = await self._disk.get_into([k.raw for k in keys], bufs)  # type: ignore[union-attr]
        exp = expect or [None] * len(keys)
        out = [self._judge(k, st, hdr, e) for k, (st, hdr), e in zip(keys, got, exp)]
        if count:
            for r in out:
                count_read(self._counters, r)
        return out

    def _judge(self, key: BlockKey, st: Status, hdr: bytes | None, exp: Expect | None) -> GetResult:
        if st is Status.CORRUPT:
            self._counters["checksum_failures"] += 1
            return GetResult(Status.CORRUPT, None, "disk")
        if hdr is None:
            return GetResult(st)
        try:
            header = BlockHeader.decode(hdr)
        except BlockFormatError:
            self._counters["checksum_failures"] += 1
            return GetResult(Status.CORRUPT, None, "disk")
        if st is not Status.HIT:
            return GetResult(st, header, "disk")
        if check_block(header, key, exp) is not Status.HIT:  # the disk tier checked its bytes
            return GetResult(Status.MISMATCH, header, "disk")
        return GetResult(Status.HIT, header, "disk")


def count_read(counters: Counter[str], r: GetResult) -> None:
    """Count one read's outcome (get_<status>; for a hit hits_<tier>, hit_tokens_<tier>,
    bytes_out)."""
    counters[f"get_{r.status.name.lower()}"] += 1
    if r.status is Status.HIT:
        counters[f"hits_{r.tier}"] += 1
        counters[f"hit_tokens_{r.tier}"] += r.header.num_tokens
        counters["bytes_out"] += r.header.payload_len
