"""The probes of kvstore/client/health.py: readmission sized to what the cluster does now, and
the one small call that confirms a missed lookup deadline.

Contract: :meth:`Prober.probe_ok` sends ``probe_rounds`` EXISTS of ``probe_keys`` keys to the
suspect node and, at the same time, the same to one healthy peer (the reference of this
moment: a busy host slows both); True when the suspect's probe ended without an error or
timeout within ``max(probe_deadline_s, probe_factor x the peer's time)`` (both probes run at
once on the same loop, so a busy host slows them alike: a tight factor), both less the
client's loop lag meanwhile. With no healthy peer the limit is ``outlier_factor x
probe_deadline_s`` (a slow node beats none). :meth:`answers` is one STATS under a deadline
(extended by the loop lag meanwhile). Neither raises.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvstore.client.node import NodeClient
from kvstore.keys import BlockKey, KeyBatch


class Prober:
    def __init__(self, health: Any, cfg: Any) -> None:
        self.health = health
        self.cfg = cfg
        self._keys = KeyBatch.of([BlockKey(i.to_bytes(16, "big")) for i in range(1, cfg.probe_keys + 1)])

    async def _timed_probe(self, node: NodeClient, deadline_s: float) -> float | None:
        """Seconds the probe took (less loop lag), None on an error or a missed deadline."""
        t0 = time.monotonic()
        end = t0 + deadline_s
        for _ in range(self.cfg.probe_rounds):
            left = end - time.monotonic()
            if left <= 0:
                return None
            before = node.counters["timeouts"] + node.counters["errors"]
            await node.lookup(self._keys, left)
            if not node.up or node.counters["timeouts"] + node.counters["errors"] != before:
                return None
        return self.health.discounted(time.monotonic() - t0)

    def _reference(self, addr: str) -> NodeClient | None:
        peers = [a for a in sorted(self.health.nodes) if a != addr and self.health.healthy(a)]
        return self.health.nodes[peers[0]] if peers else None

    async def probe_ok(self, addr: str) -> bool:
        node = self.health.nodes.get(addr)
        if node is None:
            return False
        cfg = self.cfg
        ceiling = cfg.outlier_factor * cfg.probe_deadline_s * 4  # the most one probe may wait
        ref = self._reference(addr)
        if ref is None:
            took = await self._timed_probe(node, ceiling)
            return took is not None and took <= cfg.outlier_factor * cfg.probe_deadline_s
        took, ref_took = await asyncio.gather(
            self._timed_probe(node, ceiling), self._timed_probe(ref, ceiling)
        )
        if took is None:
            return False
        if ref_took is None:  # the reference failed meanwhile: no verdict, probe again later
            return False
        return took <= max(cfg.probe_deadline_s, cfg.probe_factor * ref_took)

    async def answers(self, node: NodeClient, deadline_s: float) -> bool:
        """Whether the node answers one STATS (a small reply) within ``deadline_s`` of time the
        client's loop could run: the time it was blocked meanwhile extends the wait for the
        same request (a second request would wait a whole ``deadline_s`` again, and a node
        that answers nothing would stay in the view twice as long)."""
        t0 = time.monotonic()
        cap = 4 * deadline_s  # the most loop lag this makes up for
        call = asyncio.ensure_future(node.stats(cap))
        until = deadline_s
        while True:
            await asyncio.wait({call}, timeout=max(t0 + until - time.monotonic(), 0.0))
            if call.done():
                return call.result() is not None
            longer = min(deadline_s + self.health.lag.blocked(t0), cap)
            if longer <= until + 1e-3:
                break
            until = longer
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        return False
