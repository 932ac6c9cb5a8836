"""Replicated reads of the cluster client (a mixin of :class:`ClusterClient`).

Contract: ``get_into`` fills each caller buffer from the first candidate node (owners, then
``lookahead`` nodes further in rendezvous order) that has the block whole and verified; never
raises for a node problem. A key that misses on a node, or whose node fails, goes to the next
candidate in a following round while the deadline lasts. A round that can still fall back
waits at most ``hedge`` of the time left, so one dead or slow node costs at most part of one
deadline. A block found past its owners is offered to read repair (kvstore/cluster/readrepair.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvstore.keys import BlockKey
from kvstore.results import Expect, GetResult, Status


class ClusterReads:
    async def get_into(
        self,
        keys: Sequence[BlockKey],
        bufs: Sequence[Any],
        expect: Sequence[Expect | None] | None = None,
        deadline_s: float | None = None,
    ) -> list[GetResult]:
        """Fill ``bufs[i]`` with block ``keys[i]`` from the first candidate that has it whole
        and verified; see the module docstring for rounds and hedging."""
        if len(bufs) != len(keys) or (expect is not None and len(expect) != len(keys)):
            raise ValueError(f"get_into: {len(keys)} keys but {len(bufs)} buffers / expectations")
        exp = list(expect) if expect is not None else [None] * len(keys)
        out = [GetResult(Status.MISS)] * len(keys)
        view = await self._healthy_view(deadline_s)
        if not keys or not view:
            return out
        width = self.cfg.replicas + self.cfg.lookahead
        cands = [self._rank(k)[:width] for k in keys]
        pos = [0] * len(keys)
        missed: dict[int, list[str]] = {}  # owners that answered MISS, per key
        pending = list(range(len(keys)))
        end = time.monotonic() + (deadline_s or self.client_cfg.op_timeout_s)
        first = True
        while pending:
            left = end - time.monotonic()
            if left <= 0:
                break
            groups: dict[str, list[int]] = {}
            for i in pending:
                while pos[i] < len(cands[i]) and not self.healthy(cands[i][pos[i]]):
                    pos[i] += 1  # went down since: skip without spending time on it
                if pos[i] < len(cands[i]):
                    groups.setdefault(cands[i][pos[i]], []).append(i)
            if not groups:
                break
            fallback = any(pos[i] + 1 < len(cands[i]) for i in pending)
            budget = left * self.cfg.hedge if fallback else left
            if not first:
                self._own_counters["read_fallback_rounds"] += 1
            first = False
            pending = []
            for addr, res in await self._fan(
                groups,
                lambda n, idx, b=budget: n.get_into(
                    [keys[i] for i in idx], [bufs[i] for i in idx], [exp[i] for i in idx], b
                ),
            ):
                for i, r in zip(groups[addr], res):
                    out[i] = r
                    pos[i] += 1
                    owner = addr in cands[i][: self.cfg.replicas]
                    if r.status is Status.MISS and owner:
                        missed.setdefault(i, []).append(addr)
                    elif r.status is Status.HIT and i in missed and not owner and self.cfg.read_repair:
                        self.repairer.offer(missed[i], r.header, bufs[i])
                    if r.status is not Status.HIT and r.status is not Status.BUF_TOO_SMALL:
                        pending.append(i)
        return out
