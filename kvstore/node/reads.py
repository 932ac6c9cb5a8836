"""The node's one read into a caller's buffers: lease -> copy -> release.

Every read of the node is this sequence (kvstore.node.leasing): a lease keeps each block's
bytes in place while they are copied into the caller's buffer, then ends. A transport that
moves the bytes itself (the daemon's streamed GET, RDMA READ, in-process views) takes the
same lease and releases it when its bytes have left. Same threading rules as the node.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.block import check_block
from kvstore.keys import BlockKey
from kvstore.node.disk_reads import count_read
from kvstore.node.leases import Lease
from kvstore.node.leasing import Leaser
from kvstore.node.state import NodeState
from kvstore.results import Expect, GetResult, Status


class Reader:
    """Reads through ``leaser``, whose leases ``state`` ends."""

    def __init__(self, state: NodeState, leaser: Leaser) -> None:
        self._state = state
        self._leaser = leaser

    async def read(
        self,
        keys: Sequence[BlockKey],
        bufs: Sequence,
        expect: Sequence[Expect | None] | None = None,
    ) -> list[GetResult]:
        """Copy each block's payload into its buffer (first ``payload_len`` bytes): one result
        per key, in order. A disk copy is checksum-verified (CORRUPT: dropped) and may move up
        (the leaser's placement); ``expect`` checks parent and token ids (MISMATCH); a buffer
        smaller than the payload is BUF_TOO_SMALL. A buffer's content is unspecified unless its
        result is HIT. A hit read from disk says tier ``disk``, wherever the block is now."""
        claims = await self._leaser.claim(keys)
        counters = self._state.counters
        out: list[GetResult] = []
        try:
            for i, (key, c) in enumerate(zip(keys, claims)):
                if not isinstance(c, Lease):
                    r = GetResult(c)
                    if c is Status.MISS:  # a disk read's own outcome is counted where it ran
                        count_read(counters, r)
                    out.append(r)
                    continue
                h, tier = c.header, ("disk" if c.from_disk else c.tier)
                e = expect[i] if expect else None
                dst = memoryview(bufs[i]).cast("B")
                if check_block(h, key, e) is not Status.HIT:  # verified when stored: identity only
                    r = GetResult(Status.MISMATCH, h, tier)
                elif dst.nbytes < h.payload_len:
                    r = GetResult(Status.BUF_TOO_SMALL, h, tier)
                else:
                    dst[: h.payload_len] = c.view
                    r = GetResult(Status.HIT, h, tier)
                if not c.from_disk:  # a disk read counted itself (hits_disk, bytes_out)
                    counters[f"get_{r.status.name.lower()}"] += 1
                    if r.status is Status.HIT:
                        counters["bytes_out"] += h.payload_len
                out.append(r)
        finally:
            self._state.release([c for c in claims if isinstance(c, Lease)])
        return out
