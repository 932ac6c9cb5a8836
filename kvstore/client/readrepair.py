"""Read repair: a block a read found past its owners (its owners changed when a node joined)
is copied to the owners that answered MISS, in the background.

Contract: ``offer`` copies the payload out of the caller's buffer at once (the caller may reuse
it) and returns; at most ``max_blocks`` repairs are in flight, more are skipped and counted.
Best effort: failures are counted, never raised. Loop-bound.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvstore.block import BlockHeader
from kvstore.client.conn import byte_view
from kvstore.client.node import NodeClient


class Repairer:
    def __init__(self, nodes: dict[str, NodeClient], healthy: Callable[[str], bool], max_blocks: int) -> None:
        self.nodes = nodes
        self.healthy = healthy
        self.max_blocks = max_blocks
        self.counters: Counter[str] = Counter()
        self.in_flight = 0
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    def offer(self, owners: list[str], header: BlockHeader | None, buf: Any) -> None:
        if header is None or self._closed or not owners:
            return
        if self.in_flight >= self.max_blocks:
            self.counters["repairs_skipped"] += 1
            return
        payload = bytes(byte_view(buf)[: header.payload_len])
        self.in_flight += 1
        t = asyncio.get_running_loop().create_task(self._send(owners, header, payload))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _send(self, owners: list[str], header: BlockHeader, payload: bytes) -> None:
        try:
            for a in owners:
                node = self.nodes.get(a)
                if node is not None and self.healthy(a):
                    res = await node.put([(header, payload)])
                    self.counters["repaired" if res[0].status.ok else "repairs_failed"] += 1
        finally:
            self.in_flight -= 1

    def close(self) -> None:
        self._closed = True
        for t in self._tasks:
            t.cancel()
