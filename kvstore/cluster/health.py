"""Which nodes the cluster client uses: up (its node client is connected) and not suspect.

Contract: a node whose call failed or missed its deadline (its :class:`NodeClient` marked it
down) becomes *suspect*; a probe task waits until the node client has reconnected, then asks
the node for STATS with ``probe_deadline_s``. Only an answer within that deadline clears the
suspicion, so a node that accepts connections but answers slower than the deadline (a
congested link, an overloaded host) stays out. Loop-bound, like the node clients.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from kvstore.client import NodeClient

log = logging.getLogger("kvstore.cluster")


class Health:
    def __init__(
        self, nodes: dict[str, NodeClient], probe_interval_s: float, probe_deadline_s: float
    ) -> None:
        self.nodes = nodes  # shared with the cluster client, which adds and removes members
        self.probe_interval_s = probe_interval_s
        self.probe_deadline_s = probe_deadline_s
        self.counters: Counter[str] = Counter()
        self._suspect: set[str] = set()
        self._probes: dict[str, asyncio.Task] = {}
        self._closed = False

    def healthy(self, addr: str) -> bool:
        node = self.nodes.get(addr)
        return node is not None and node.up and addr not in self._suspect

    def forget(self, addr: str) -> None:
        """The member left."""
        self._suspect.discard(addr)
        t = self._probes.pop(addr, None)
        if t is not None:
            t.cancel()

    def after_call(self, addr: str) -> None:
        """Call after each call to ``addr``: a node that went down stays out until probed."""
        node = self.nodes.get(addr)
        if node is None or node.up or addr in self._suspect or self._closed:
            return
        self._suspect.add(addr)
        self.counters["marked_down"] += 1
        if addr not in self._probes or self._probes[addr].done():
            self._probes[addr] = asyncio.get_running_loop().create_task(self._probe(addr))

    async def _probe(self, addr: str) -> None:
        while not self._closed and addr in self.nodes:
            await asyncio.sleep(self.probe_interval_s)
            node = self.nodes.get(addr)
            if node is None or not node.up:
                continue  # the node client reconnects by itself first
            if await node.stats(self.probe_deadline_s) is not None:
                self._suspect.discard(addr)
                self.counters["marked_up"] += 1
                log.info("event=cluster_node_up node=%s", addr)
                return

    def close(self) -> None:
        self._closed = True
        for t in self._probes.values():
            t.cancel()
        self._probes.clear()
