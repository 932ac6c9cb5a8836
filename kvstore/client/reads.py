"""Replicated reads of the cluster client (an object :class:`ClusterClient` owns).

Contract: :meth:`ClusterReads.fill` (the fill of the cluster client's one ``read``,
kvstore/client/read.py) fills each caller buffer from the first candidate node (owners, then
``lookahead`` nodes further in rendezvous order) that has the block whole and verified; never
raises for a node problem. Bytes of a buffer whose result is not HIT are unspecified. Each
node is asked with its own ``read`` (kvstore/client/node.py).

- Rounds: each pending key goes to its next healthy candidate; a key that misses there (or
  whose node fails) goes to the next candidate in a following round while the deadline lasts.
- Hedging: a node's read that passes ``hedge_factor`` times its expected time
  (kvstore/client/health.py; at least ``hedge_floor_s``; ``hedge`` of the time left before
  there are estimates) is sent again to each key's next candidate, into private buffers.
  Whichever answers first wins: when the hedge has every key, the late read is cancelled (its
  connection closed, never half-copied into the caller's buffers), the private copies move
  into the caller's buffers and the late node's lateness is noted (it loses weight; health
  ejects it only as an outlier among its peers); when the first read finishes
  first, it is used and the hedge is cancelled. The late node is never timed out by the
  hedge, so lateness alone does not count as a failure of the node client.
- Preference: an owner whose health weight (kvstore/client/health.py) fell below one half
  (late reads in the current window) is read after its co-owner, not skipped.
- Read repair: a block found past its owners is offered to kvstore/client/readrepair.py.

Given in its constructor: the owner's :class:`~kvstore.client.route.Route` (node clients,
healthy view, rendezvous order), the health tracker, the read repairer, the configs and the
counters it adds to (the owner's).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvstore.client.config import ClientConfig, ClusterConfig
from kvstore.client.conn import byte_view
from kvstore.client.health import Health
from kvstore.client.node import NodeClient
from kvstore.client.readrepair import Repairer
from kvstore.client.route import Route
from kvstore.keys import BlockKey, KeyBatch
from kvstore.results import Expect, GetResult, GetResults, Status

_PREFER_BELOW = 0.5  # a node whose health weight is under this is read after its co-owner


class ClusterReads:
    def __init__(
        self,
        route: Route,
        health: Health,
        repairer: Repairer,
        cfg: ClusterConfig,
        client_cfg: ClientConfig,
        counters: Counter[str],
    ) -> None:
        self.route = route
        self.health = health
        self.repairer = repairer
        self.cfg = cfg
        self.client_cfg = client_cfg
        self.counters = counters

    async def fill(
        self,
        keys: Sequence[BlockKey],
        bufs: Sequence[Any],
        exp: list[Expect | None],
        deadline_s: float | None = None,
    ) -> list[GetResult]:
        """Fill ``bufs[i]`` with block ``keys[i]`` (``exp``: one expectation per key, checked by
        the read); see the module docstring."""
        out = [GetResult(Status.MISS)] * len(keys)
        view = await self.route.healthy_view(deadline_s)
        if not keys or not view:
            return out
        width = self.cfg.replicas + self.cfg.lookahead
        cands = [o[:width] for o in self.route.ranks(KeyBatch.of(keys))]
        slow = {n.id for n in view if self.health.weight(n.id) < _PREFER_BELOW}
        if slow:  # a late owner is read after its healthier co-owner (never skipped)
            cands = [_prefer(c, slow, self.cfg.replicas) for c in cands]
        pos = [0] * len(keys)
        missed: dict[int, list[str]] = {}  # owners that answered MISS, per key
        pending = list(range(len(keys)))
        end = time.monotonic() + (deadline_s or self.client_cfg.op_timeout_s)
        first = True
        while pending and end - time.monotonic() > 0:
            groups: dict[str, list[int]] = {}
            for i in pending:
                while pos[i] < len(cands[i]) and not self.route.healthy(cands[i][pos[i]]):
                    pos[i] += 1  # went down since: skip without spending time on it
                if pos[i] < len(cands[i]):
                    groups.setdefault(cands[i][pos[i]], []).append(i)
            if not groups:
                break
            if not first:
                self.counters["read_fallback_rounds"] += 1
            first = False
            answers: dict[int, tuple[str, GetResult]] = {}
            req = _Req(keys, bufs, exp, cands, pos, end)
            await asyncio.gather(*(self._read_group(a, idx, req, answers) for a, idx in groups.items()))
            pending = []
            for i, (addr, r) in answers.items():
                out[i] = r
                pos[i] = max(pos[i], cands[i].index(addr)) + 1
                owner = addr in cands[i][: self.cfg.replicas]
                if r.status is Status.MISS and owner:
                    missed.setdefault(i, []).append(addr)
                elif r.status is Status.HIT and i in missed and not owner and self.cfg.read_repair:
                    self.repairer.offer(missed[i], r.header, bufs[i])
                if r.status is not Status.HIT and r.status is not Status.BUF_TOO_SMALL:
                    pending.append(i)
        return out

    async def _wait_running(self, prim: asyncio.Future, wait_s: float, q: _Req) -> None:
        """Wait for ``prim`` up to ``wait_s`` of time the loop could run: while this client's
        loop was blocked, an answer that arrived could not be read, so that time is not the
        node's lateness (kvstore/client/looplag.py)."""
        t0 = time.monotonic()
        left = wait_s
        while left > 0:
            await asyncio.wait({prim}, timeout=min(left, q.left()))
            if prim.done() or q.left() <= 1e-3:
                return
            ran = time.monotonic() - t0 - self.health.lag.blocked(t0)
            left = wait_s - ran
            if left > 0:
                self.counters["hedges_delayed_for_loop_lag"] += 1

    def _hedge_after(self, addr: str, nbytes: int, left: float) -> float:
        exp_s = self.health.expected(addr, nbytes)
        if exp_s is None:
            return left * self.cfg.hedge
        return min(left, max(self.cfg.hedge_floor_s, self.cfg.hedge_factor * exp_s))

    async def _read_group(self, addr: str, idx: list[int], q: _Req, answers: dict) -> None:
        """Read ``idx`` from ``addr``, hedged to the keys' next candidates when it is late."""
        t0 = time.monotonic()
        node = self.route.nodes[addr]
        prim = asyncio.ensure_future(
            _results(
                node, [q.keys[i] for i in idx], [q.bufs[i] for i in idx], [q.exp[i] for i in idx], q.left()
            )
        )
        alt: dict[str, list[int]] = {}
        for i in idx:
            nxt = next((a for a in q.cands[i][q.pos[i] + 1 :] if a != addr and self.route.healthy(a)), None)
            if nxt is not None:
                alt.setdefault(nxt, []).append(i)
        nbytes = sum(_cap(q.bufs[i]) for i in idx)
        if alt:
            await self._wait_running(prim, self._hedge_after(addr, nbytes, q.left()), q)
        if prim.done() or not alt:
            self._take(addr, idx, await prim, answers, t0)
            return
        self.counters["reads_hedged"] += sum(len(v) for v in alt.values())
        tmp = {i: bytearray(_cap(q.bufs[i])) for ks in alt.values() for i in ks}
        alts = {
            asyncio.ensure_future(
                _results(
                    self.route.nodes[b],
                    [q.keys[i] for i in ks],
                    [tmp[i] for i in ks],
                    [q.exp[i] for i in ks],
                    q.left(),
                )
            ): (b, ks)
            for b, ks in alt.items()
        }
        waiting = set(alts)
        while waiting and not prim.done():
            _, waiting = await asyncio.wait({prim, *waiting}, return_when=asyncio.FIRST_COMPLETED)
            waiting.discard(prim)
        won: dict[int, tuple[str, GetResult]] = {}
        for t, (b, ks) in alts.items():
            if t.done() and not t.cancelled():
                self.health.observe(b, time.monotonic() - t0, 0, "hedge")
                won.update({i: (b, r) for i, r in zip(ks, t.result()) if r.status is Status.HIT})
        if not prim.done() and len(won) == len(idx):  # the hedge has it all: stop the late read
            prim.cancel()
            await asyncio.gather(prim, return_exceptions=True)
            self.counters["hedges_won"] += 1
            self.health.late(addr, time.monotonic() - t0)
            res = [GetResult(Status.MISS)] * len(idx)
        else:
            res = await prim  # bounded by the deadline given to it
            self._take(addr, idx, res, answers, t0)
        for t in waiting:
            t.cancel()
        for i, r in zip(idx, res):
            if r.status is not Status.HIT and i in won:
                b, rr = won[i]
                byte_view(q.bufs[i])[: rr.header.payload_len] = tmp[i][: rr.header.payload_len]
                answers[i] = (b, rr)

    def _take(self, addr: str, idx: list[int], res: GetResults, answers: dict, t0: float) -> None:
        self.health.observe(addr, time.monotonic() - t0, res.hit_bytes, "get")
        for i, r in zip(idx, res):
            answers[i] = (addr, r)


async def _results(
    node: NodeClient, keys: list[BlockKey], bufs: list[Any], exp: list, left: float
) -> GetResults:
    """``node``'s read of ``keys`` into ``bufs``: its results (nothing is lent by a node)."""
    return GetResults.of((await node.read(keys, bufs, exp, left)).results)


def _prefer(cand: tuple[str, ...], slow: set[str], owners: int) -> tuple[str, ...]:
    """``cand``'s owners with the ``slow`` ones after the others; the rest as it was."""
    head = cand[:owners]
    if not slow.intersection(head):
        return cand
    return (*[a for a in head if a not in slow], *[a for a in head if a in slow], *cand[owners:])


class _Req:
    """One fill's inputs, shared by its per-node reads."""

    def __init__(self, keys, bufs, exp, cands, pos, end: float) -> None:
        self.keys, self.bufs, self.exp, self.cands, self.pos, self.end = keys, bufs, exp, cands, pos, end

    def left(self) -> float:
        return max(self.end - time.monotonic(), 1e-3)


def _cap(buf: Any) -> int:
    """A buffer's size in bytes (an upper bound of the payload read into it)."""
    return byte_view(buf).nbytes
