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
healthy view and cached as a small int (:class:`~kvstore.client.placement.RankCache`), so a repeated lookup costs one
dict probe per key plus flat-list grouping and merging; no per-key objects are made. Keys no
owner held at their last lookup (:class:`MissHints`) are asked of their lookahead nodes in
round 1 too, so a partly cached prompt looked up again costs one round trip, not two; the
owners' answers still decide, so this changes no result.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from operator import itemgetter

from kvstore.client.config import ClusterConfig
from kvstore.client.placement import Node, RankCache
from kvstore.client.route import Route
from kvstore.keys import BlockKey
from kvstore.protocol import MAX_BATCH

TIER_ORDER = {"hbm": 0, "dram": 1, "disk": 2}  # best first; an unknown tier ranks last


class MissHints:
    """The keys that no owner held at their last lookup (bounded: at ``max_entries`` it
    starts over). A hinted key is asked of its lookahead nodes in the same round as of its
    owners, which saves the second round trip of a prompt looked up again while partly
    cached; the owners' answer still wins, so a hint changes no result, only what is asked
    when. A key its owners hold again is dropped from it."""

    def __init__(self, max_entries: int = 1 << 16) -> None:
        if max_entries < 1:
            raise ValueError(f"miss hints max_entries must be >= 1, got {max_entries}")
        self._max = max_entries
        self._keys: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._keys)

    def among(self, raws: Sequence[bytes]) -> list[int]:
        """The (ascending) indices of hinted keys in ``raws``."""
        have = self._keys
        return [i for i, r in enumerate(raws) if r in have]

    def note(self, raws: Sequence[bytes], missed: Sequence[int], found: Sequence[int]) -> None:
        """``raws[missed]`` no owner held; ``raws[found]`` (hinted ones) an owner held."""
        have = self._keys
        for i in found:
            have.discard(raws[i])
        if len(have) + len(missed) > self._max:
            have.clear()
        have.update([raws[i] for i in missed][: self._max])

    def clear(self) -> None:
        self._keys.clear()


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
        self.hints = MissHints()

    async def exists(self, keys: Sequence[BlockKey], deadline_s: float | None = None) -> list[str | None]:
        """Per key, its tier as the module docstring says (``None``: nowhere)."""
        out: list[str | None] = [None] * len(keys)
        view = await self.route.healthy_view(deadline_s)
        if not keys or not view:
            return out
        end = time.monotonic() + (deadline_s or self.op_timeout_s)
        owners, hi = self.cfg.replicas, self.cfg.replicas + self.cfg.lookahead
        second = owners < len(view) and hi > owners  # is there a lookahead round at all
        raws = [k.raw for k in keys] if owners < len(view) else []  # empty: no ranking needed
        codes = self.ranks.codes(raws) if raws else None
        groups, codes = self.plan(keys, range(len(keys)), 0, owners, view, codes)
        tasks = self._send(keys, groups, max(end - time.monotonic(), 1e-3))
        hinted: list[int] = []
        ahead: dict[asyncio.Future, list[int]] = {}
        if second and self.hints:  # the lookahead round of hinted keys goes out now, too
            hinted = self.hints.among(raws)
            if hinted:
                groups_ahead, _ = self.plan(keys, hinted, owners, hi, view, codes)
                ahead = self._send(keys, groups_ahead, max(end - time.monotonic(), 1e-3))
        if await self._collect(tasks, out, len(keys)) or not second:
            self._leave(ahead)
            if hinted:
                self.hints.note(raws, (), hinted)  # every one found on its owners
            return out
        pending = [i for i, t in enumerate(out) if t is None]  # no owner has these
        self.hints.note(raws, pending, [i for i in hinted if out[i] is not None])
        if ahead:
            late: list[str | None] = [None] * len(keys)
            await self._collect(ahead, late, len(hinted))
            if pending == hinted:  # the steady state: exactly the hinted keys were missing
                for i in pending:
                    out[i] = late[i]
                pending = []
            else:
                asked = set(hinted)
                for i in pending:
                    if i in asked:
                        out[i] = late[i]
                pending = [i for i in pending if i not in asked]
        if pending:
            self.counters["lookup_second_rounds"] += 1
            groups, _ = self.plan(keys, pending, owners, hi, view, codes)
            await self._collect(
                self._send(keys, groups, max(end - time.monotonic(), 1e-3)), out, len(pending)
            )
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

    def _send(
        self, keys: Sequence[BlockKey], groups: dict[str, list[int]], deadline_s: float
    ) -> dict[asyncio.Future, list[int]]:
        """Start the EXISTS of ``groups`` (per node, at most ``MAX_BATCH`` keys a request, all
        in parallel); each request's future with the indices it asked about."""
        nodes, timed = self.route.nodes, self.route.timed
        tasks: dict[asyncio.Future, list[int]] = {}
        for a, idx in groups.items():
            for part in _split(idx, MAX_BATCH):
                ks = keys if len(part) == len(keys) else _pick(keys, part)
                tasks[asyncio.ensure_future(timed(a, "exists", nodes[a].exists(ks, deadline_s)))] = part
            self.counters["lookup_keys_asked"] += len(idx)
        return tasks

    async def _collect(
        self, tasks: dict[asyncio.Future, list[int]], out: list[str | None], asked: int
    ) -> bool:
        """Merge the answers of ``tasks`` into ``out`` (the best tier wins) as they come;
        ``asked`` distinct keys, all missing in ``out`` at the start. True, early, once every
        one of them was found (the rest are left to finish: :meth:`_leave`)."""
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
            if missing <= 0:
                if pending:
                    self.counters["lookups_answered_early"] += 1
                    self._leave(pending)
                return True
        return False

    def _leave(self, tasks: Iterable[asyncio.Future]) -> None:
        """Calls whose answer is no longer needed: a late node cannot turn a hit into a miss.
        They go on in the background (bounded by the deadline) so their time feeds health;
        the client cancels them at close."""
        for t in tasks:
            if not t.done():
                self.stragglers.add(t)
                t.add_done_callback(self.stragglers.discard)

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
