"""Replicated writes of the cluster client (an object :class:`ClusterClient` owns).

Contract: :meth:`put` stores each block on its ``replicas`` owners, the first healthy
nodes of the block's rendezvous order; a write that fails on a node (error, timeout, no
space, node down) goes to the next node in that order while the caller's deadline lasts (a
node-side repair moves the copy back to its owner later: kvstore/member/repair.py). It
never raises for a node problem and tells exactly what happened
(:class:`~kvstore.client.api.PutReport`: ``under_replicated`` counts the blocks stored on fewer
than ``wanted`` nodes; counters ``blocks_under_replicated``, ``puts_under_replicated``,
``blocks_with_all_copies``). When the healthy view has fewer than ``replicas`` nodes, the
members out only for being slow (connection up: :meth:`Route.standby`) come next in each
block's order, ranked by rendezvous among themselves: a slow copy beats a missing one.

Deadlines: one node never gets the whole save deadline. A node this client never reached
first gets its connections opened within the caller's deadline (``start()`` does that ahead). Its blocks go in chunks of at most
``write_chunk_bytes`` (up to ``pool_size`` chunks at once); each chunk has its own deadline
``write_floor_s + bytes in flight to the node / write_min_bytes_per_s``, capped by the time
left. So a dead or partitioned node costs about ``write_floor_s`` and its blocks are
redirected within the same call, while a healthy node that moves a large batch at least at
``write_min_bytes_per_s`` never misses a chunk deadline, however long the whole batch takes.

Given in its constructor: the owner's :class:`~kvstore.client.route.Route` (node clients,
healthy view, rendezvous order, connection set-up, timed fan-out), the configs and the
counters it adds to (the owner's).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvstore.block import BlockHeader
from kvstore.client.api import PutReport
from kvstore.client.config import ClientConfig, ClusterConfig
from kvstore.client.placement import rank
from kvstore.client.route import Route
from kvstore.keys import KeyBatch
from kvstore.results import PutResult, Status

# a node that answered these for a block did not store it; the next node in order may
_REDIRECT = frozenset({Status.ERROR, Status.TIMEOUT, Status.NO_SPACE, Status.MISS})


class ClusterWrites:
    def __init__(
        self, route: Route, cfg: ClusterConfig, client_cfg: ClientConfig, counters: Counter[str]
    ) -> None:
        self.route = route
        self.cfg = cfg
        self.client_cfg = client_cfg
        self.counters = counters

    async def put(
        self, blocks: Sequence[tuple[BlockHeader, Any]], deadline_s: float | None = None
    ) -> PutReport:
        """Store ``blocks`` on their owners; see the module docstring."""
        n = len(blocks)
        out = [PutResult(Status.ERROR)] * n
        copies = [0] * n
        view = await self.route.healthy_view(deadline_s)
        # copies the cluster wants (members, down ones included) vs copies placeable now
        wanted = min(self.cfg.replicas, max(len(self.route.nodes), 1))
        if not blocks or not view:
            self.counters["blocks_stored_nowhere"] += n
            return PutReport(out, copies, wanted)
        order = self.route.ranks(KeyBatch.of([h.key for h, _ in blocks]))
        spare: frozenset[str] = frozenset()
        if len(view) < wanted:  # too few healthy owners: the next ranked nodes are the slow ones
            standby = self.route.standby()
            spare = frozenset(x.id for x in standby)
            if standby:
                self.counters["puts_to_standby_nodes"] += 1
                order = [
                    o + tuple(x.id for x in rank(h.key.raw, standby)) for o, (h, _) in zip(order, blocks)
                ]
        need = [min(wanted, len(view) + len(spare))] * n
        pos = [0] * n
        end = time.monotonic() + (deadline_s or self.client_cfg.op_timeout_s)
        failures = redirected = 0
        first = True
        while True:
            groups: dict[str, list[int]] = {}
            for i in range(n):
                while need[i] > 0 and pos[i] < len(order[i]):
                    a = order[i][pos[i]]
                    pos[i] += 1
                    if self.route.healthy(a) or a in spare:
                        groups.setdefault(a, []).append(i)
                        need[i] -= 1
            if not groups or end - time.monotonic() <= 0:
                break
            if not first:
                redirected += sum(len(v) for v in groups.values())
            first = False
            # connection set-up is bounded by the caller's deadline, not a node's write budget
            await self.route.connect(groups, end - time.monotonic())
            for addr, res in await self.route.fan(
                groups, lambda node, idx: self._put_node(node, blocks, idx, end)
            ):
                for i, r in zip(groups[addr], res):
                    if r.status.ok:
                        copies[i] += 1
                        if not out[i].status.ok or (r.durable and not out[i].durable):
                            out[i] = r
                        continue
                    failures += 1
                    if not out[i].status.ok:
                        out[i] = r
                    if r.status in _REDIRECT:
                        need[i] += 1  # the next node in rendezvous order takes it
        report = PutReport(out, copies, wanted, failures, redirected)
        self.counters["writes_redirected"] += redirected
        self.counters["blocks_stored_nowhere"] += report.dropped
        self.counters["blocks_under_replicated"] += report.under_replicated
        if report.under_replicated:
            self.counters["puts_under_replicated"] += 1
        self.counters["blocks_with_all_copies"] += n - report.under_replicated - report.dropped
        return report

    async def _put_node(self, node, blocks, idx: list[int], end: float) -> list[PutResult]:
        """``blocks[idx]`` to one node in chunks, each under its own byte-scaled deadline."""
        cfg = self.cfg
        chunks: list[list[int]] = [[]]
        size = 0
        for i in idx:
            nbytes = blocks[i][0].payload_len
            if chunks[-1] and size + nbytes > cfg.write_chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += nbytes
        par = min(len(chunks), self.client_cfg.pool_size)
        slots = asyncio.Semaphore(par)

        async def one(chunk: list[int]) -> list[PutResult]:
            async with slots:
                nbytes = sum(blocks[i][0].payload_len for i in chunk)
                budget = cfg.write_floor_s + nbytes * par / cfg.write_min_bytes_per_s
                left = end - time.monotonic()
                if left <= 0:
                    return [PutResult(Status.TIMEOUT)] * len(chunk)
                return await node.put([blocks[i] for i in chunk], min(left, budget))

        done = await asyncio.gather(*(one(c) for c in chunks))
        return [r for part in done for r in part]
