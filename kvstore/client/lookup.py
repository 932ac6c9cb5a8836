"""The cluster client's lookups: per key, the best tier its nodes hold it in, in at most two rounds.

Contract (what :meth:`ClusterClient.exists <kvstore.client.cluster.ClusterClient.exists>`
returns): per key, the best tier its *owners* (the first ``replicas`` nodes of its rendezvous
order over the healthy view) hold it in; for a key no owner holds, the best tier of the next
``lookahead`` nodes of that order; ``None`` when none of them has it. Round 1 asks each owner
about its keys, round 2 asks the lookahead nodes about the keys round 1 left missing. Each
node's keys of a round go out as one EXISTS per at most ``MAX_BATCH`` keys, all requests of a
round in parallel. A round ends as soon as every key it asked about was found: a node still
answering cannot turn a hit into a miss, and its call goes on in the background (bounded by
the deadline) so its time still feeds health. Never raises for a node problem (a node that
fails answers all misses).

Speed (a 128K-token prompt is 8,192 keys): a key's rendezvous order is computed once per
healthy view and cached as a small int (:class:`RankCache`), so a repeated lookup costs one
dict probe per key plus flat-list grouping and merging; no per-key objects are made.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from operator import itemgetter

from kvstore.client.config import ClusterConfig
from kvstore.client.placement import Node, rank_many
from kvstore.client.route import Route
from kvstore.keys import BlockKey
from kvstore.protocol import MAX_BATCH

TIER_ORDER = {"hbm": 0, "dram": 1, "disk": 2}  # best first; an unknown tier ranks last


class RankCache:
    """Each key's rendezvous order over one healthy view, as a code: an index into
    ``orders`` (a view of n nodes has at most n! orders, and equal orders share one code).

    Bounded in entries: two generations of at most ``max_entries // 2`` keys each; a key
    found in the old generation moves to the new one, and when the new one is full the old
    one is dropped. That is an LRU at generation granularity with no per-hit bookkeeping
    (a lookup of 8,192 cached keys is 8,192 dict probes). :meth:`reset` with a different view
    or ``replicas`` empties it (placement changed)."""

    def __init__(self, max_entries: int = 1 << 17) -> None:
        if max_entries < 2:
            raise ValueError(f"rank cache max_entries must be >= 2, got {max_entries}")
        self._gen = max_entries // 2
        self._new: dict[bytes, int] = {}
        self._old: dict[bytes, int] = {}
        self.orders: list[tuple[str, ...]] = []
        self._code_of: dict[tuple[str, ...], int] = {}
        self._view: tuple[Node, ...] = ()
        self._replicas = 1

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def reset(self, view: Sequence[Node], replicas: int) -> None:
        """Rank over ``view`` (the healthy members) with ``replicas`` owners from now on."""
        view = tuple(view)
        if view == self._view and replicas == self._replicas:
            return
        self._view, self._replicas = view, replicas
        self._new, self._old = {}, {}
        self.orders, self._code_of = [], {}

    def codes(self, raws: Sequence[bytes]) -> list[int]:
        """Per raw key, the code of its order (``orders[code]``: node ids, owners first).
        Misses are ranked in one batch (:func:`~kvstore.client.placement.rank_many`)."""
        codes: list[int | None] = list(map(self._new.get, raws))
        if None not in codes:
            return codes  # type: ignore[return-value]
        missed = []
        old = self._old
        for i, c in enumerate(codes):
            if c is None:
                c = old.get(raws[i])
                if c is None:
                    missed.append(i)
                else:
                    codes[i] = c
                    self._put(raws[i], c)
        if missed:
            fresh = rank_many([raws[i] for i in missed], self._view, self._replicas)
            for i, order in zip(missed, fresh):
                c = self._code_of.get(order)
                if c is None:
                    c = self._code_of[order] = len(self.orders)
                    self.orders.append(order)
                codes[i] = c
                self._put(raws[i], c)
        return codes  # type: ignore[return-value]

    def order(self, raw: bytes) -> tuple[str, ...]:
        """The view's node ids in ``raw``'s rendezvous order (owners first)."""
        return self.orders[self.codes((raw,))[0]]

    def _put(self, raw: bytes, code: int) -> None:
        if len(self._new) >= self._gen:
            self._old, self._new = self._new, {}
        self._new[raw] = code


class Lookups:
    """The lookup rounds of one cluster client. ``route`` gives the node clients, the healthy
    view and timed calls; ``ranks`` is the client's rank cache (reset by the client when its
    healthy view changes); ``counters`` and ``stragglers`` (late node calls, cancelled at
    close) are the client's."""

    def __init__(
        self,
        route: Route,
        ranks: RankCache,
        cfg: ClusterConfig,
        op_timeout_s: float,
        counters: Counter[str],
        stragglers: set[asyncio.Future],
    ) -> None:
        self.route = route
        self.ranks = ranks
        self.cfg = cfg
        self.op_timeout_s = op_timeout_s
        self.counters = counters
        self.stragglers = stragglers

    async def exists(self, keys: Sequence[BlockKey], deadline_s: float | None = None) -> list[str | None]:
        """Per key, its tier as the module docstring says (``None``: nowhere)."""
        out: list[str | None] = [None] * len(keys)
        view = await self.route.healthy_view(deadline_s)
        if not keys or not view:
            return out
        end = time.monotonic() + (deadline_s or self.op_timeout_s)
        owners = self.cfg.replicas
        pending: Sequence[int] = range(len(keys))
        codes: list[int] | None = None
        for lo, hi in ((0, owners), (owners, owners + self.cfg.lookahead)):
            if lo >= len(view) or lo >= hi:
                break
            groups, codes = self.plan(keys, pending, lo, hi, view, codes)
            await self._round(keys, groups, out, len(pending), max(end - time.monotonic(), 1e-3))
            pending = [i for i in pending if out[i] is None]
            if not pending:
                break
        return out

    def plan(
        self,
        keys: Sequence[BlockKey],
        idx: Sequence[int],
        lo: int,
        hi: int,
        view: list[Node],
        codes: list[int] | None = None,
    ) -> tuple[dict[str, list[int]], list[int] | None]:
        """:meth:`groups` of ``keys[idx]`` for ranks ``lo..hi-1``, and the keys' codes (pass
        them back for the next round; ``None`` while no ranking was needed)."""
        if lo == 0 and hi >= len(view):  # every node is a candidate for every key: no ranking
            every = list(idx)
            return {n.id: every for n in view}, codes
        if codes is None:
            codes = self.ranks.codes([k.raw for k in keys])
        return self.groups(codes, idx, lo, hi), codes

    def groups(self, codes: Sequence[int], idx: Sequence[int], lo: int, hi: int) -> dict[str, list[int]]:
        """Per node, the indices ``idx`` (ascending) of the keys whose rendezvous ranks
        ``lo..hi-1`` it holds; ``codes`` are the keys' :meth:`RankCache.codes`."""
        orders = self.ranks.orders
        buckets: list[list[int]] = [[] for _ in orders]  # the keys of each order
        add = [b.append for b in buckets]
        if isinstance(idx, range) and idx == range(len(codes)):
            for i, c in enumerate(codes):
                add[c](i)
        else:
            for i in idx:
                add[codes[i]](i)
        groups: dict[str, list[int]] = {}
        for c, b in enumerate(buckets):
            if b:
                for a in orders[c][lo:hi]:
                    groups.setdefault(a, []).extend(b)
        for g in groups.values():
            g.sort()  # ascending runs: a linear merge; requests stay in key order
        return groups

    async def _round(
        self,
        keys: Sequence[BlockKey],
        groups: dict[str, list[int]],
        out: list[str | None],
        asked: int,
        deadline_s: float,
    ) -> None:
        """The EXISTS of ``groups`` in parallel, each answer merged into ``out`` (the best
        tier wins); ``asked`` keys of the round, all missing in ``out`` when it starts.
        Returns early once every one of them was found."""
        nodes, timed = self.route.nodes, self.route.timed
        tasks: dict[asyncio.Future, list[int]] = {}
        for a, idx in groups.items():
            for part in _split(idx, MAX_BATCH):
                ks = keys if len(part) == len(keys) else _pick(keys, part)
                tasks[asyncio.ensure_future(timed(a, "exists", nodes[a].exists(ks, deadline_s)))] = part
        self.counters["lookup_keys_asked"] += sum(len(g) for g in groups.values())
        missing, rank = asked, TIER_ORDER.get
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                for i, tier in zip(tasks[t], t.result()):
                    if tier is not None:
                        have = out[i]
                        if have is None:
                            out[i] = tier
                            missing -= 1
                        elif tier != have and rank(tier, 9) < rank(have, 9):
                            out[i] = tier
            if pending and missing <= 0:
                # every key was found: a late node cannot change a hit into a miss. Its call
                # goes on in the background (bounded by the deadline), its time feeding health.
                self.counters["lookups_answered_early"] += 1
                for t in pending:
                    self.stragglers.add(t)
                    t.add_done_callback(self.stragglers.discard)
                return

    async def lookup_prefix(self, keys: Sequence[BlockKey], deadline_s: float | None = None) -> int:
        """How many leading ``keys`` are stored somewhere (the longest prefix over replicas)."""
        tiers = await self.exists(keys, deadline_s)
        return next((i for i, t in enumerate(tiers) if t is None), len(tiers))


def _split(idx: list[int], most: int) -> list[list[int]]:
    """``idx`` cut into the fewest even parts of at most ``most`` (sent in parallel, so the
    node answers the first while the client encodes the next)."""
    n = -(-len(idx) // most)
    if n <= 1:
        return [idx]
    size = -(-len(idx) // n)
    return [idx[i : i + size] for i in range(0, len(idx), size)]


def _pick(keys: Sequence[BlockKey], idx: list[int]) -> Sequence[BlockKey]:
    return [keys[idx[0]]] if len(idx) == 1 else itemgetter(*idx)(keys)
