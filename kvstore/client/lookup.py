"""The cluster client's lookups: per key, the best tier its nodes hold it in, in at most two rounds.

Contract (the codes of :meth:`ClusterClient.lookup <kvstore.client.cluster.ClusterClient.lookup>`):
per key, the best tier its *owners* (the first ``replicas`` nodes of its rendezvous
order over the healthy view) hold it in; for a key no owner holds, the best tier of the next
``lookahead`` nodes of that order; 0 when none of them has it. Round 1 asks each owner
about its keys, round 2 asks the lookahead nodes about the keys round 1 left missing. Each
node's keys of a round go out as one EXISTS per at most ``MAX_EXISTS_KEYS`` keys, all requests of a
round in parallel. A round ends as soon as every key it asked about was found: a node still
answering cannot turn a hit into a miss, and its call goes on in the background (bounded by
the deadline) so its time still feeds health. Never raises for a node problem (a node that
fails answers all misses).

Speed (a 128K-token prompt is 8,192 keys): keys travel as one :class:`~kvstore.keys.KeyBatch`
and answers as one tier code byte per key (kvstore.lookups); a key's rendezvous order is
computed in bulk (numpy) once per healthy view and cached as a small int
(:class:`~kvstore.client.placement.RankCache`), grouping keys by node and merging answers
are numpy passes; no Python runs per key and no per-key object is made. Keys no
owner held at their last lookup (:class:`MissHints`) are asked of their lookahead nodes in
round 1 too, so a partly cached prompt looked up again costs one round trip, not two; the
owners' answers still decide, so this changes no result.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from kvstore.client.config import ClusterConfig
from kvstore.client.placement import Node, RankCache, Ranking, rank_positions, unique_rows
from kvstore.client.route import Route
from kvstore.keys import KeyBatch
from kvstore.keytable import KeyTable, key_pairs
from kvstore.protocol import MAX_EXISTS_KEYS

_NONE = 255  # "not found yet" while merging codes (every real code is smaller)
_EMPTY = np.zeros(0, dtype=np.int64)


class MissHints:
    """The keys that no owner held at their last lookup (bounded: at ``max_entries`` it
    starts over). A hinted key is asked of its lookahead nodes in the same round as of its
    owners, which saves the second round trip of a prompt looked up again while partly
    cached; the owners' answer still wins, so a hint changes no result, only what is asked
    when. A key its owners hold again is dropped from it. Probes are numpy passes over the
    packed keys (:class:`~kvstore.keytable.KeyTable`). ``keys`` below: a
    :class:`KeyBatch`, its :func:`key_pairs`, or 16-byte raw keys."""

    def __init__(self, max_entries: int = 1 << 16) -> None:
        if max_entries < 1:
            raise ValueError(f"miss hints max_entries must be >= 1, got {max_entries}")
        self._max = max_entries
        self._keys = KeyTable(max_entries)

    def __len__(self) -> int:
        return len(self._keys)

    def among(self, keys) -> np.ndarray:
        """The (ascending) indices of hinted keys in ``keys``."""
        if not len(self._keys):
            return _EMPTY
        return np.flatnonzero(self._keys.find(_pairs(keys)) >= 0)

    def note(self, keys, missed: Sequence[int], found: Sequence[int]) -> None:
        """``keys[missed]`` no owner held; ``keys[found]`` (hinted ones) an owner held."""
        pairs = _pairs(keys)
        have = self._keys
        if len(found):
            have.remove(pairs[np.asarray(found, dtype=np.int64)])
        missed = np.asarray(missed, dtype=np.int64)[: self._max]
        if len(have) + len(missed) > self._max:
            have.clear()
        if len(missed):
            have.insert(pairs[missed], np.zeros(len(missed), dtype=np.int32))

    def clear(self) -> None:
        self._keys.clear()


def _pairs(keys) -> np.ndarray:
    if isinstance(keys, np.ndarray):
        return keys
    return key_pairs(keys if isinstance(keys, KeyBatch) else KeyBatch(b"".join(keys)))


class Lookups:
    """The lookup rounds of one cluster client. ``route`` gives the node clients, the healthy
    view and timed calls; ``ranks`` is the client's rank cache (reset by the client when its
    healthy view changes); ``counters`` and ``stragglers`` (late node calls, cancelled at
    close) are the client's. A lookup takes the view and a :class:`Ranking` of its keys at
    its start and keeps both through all its rounds: a view change meanwhile (another call
    resets the cache) changes nothing it asks."""

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

    def ranking(self, keys: KeyBatch, view: list[Node]) -> Ranking:
        """``keys``' orders over ``view``: from the cache when it ranks over ``view`` (it does
        right after ``healthy_view``), else computed for this call alone."""
        if self.ranks.view == tuple(view):
            return self.ranks.ranking(keys)
        ids, rows = rank_positions(keys, view, self.cfg.replicas)
        uniq, inverse = unique_rows(rows)
        return Ranking(ids, inverse.astype(np.int64), uniq.astype(np.int16))

    async def codes(self, keys: KeyBatch, deadline_s: float | None = None) -> bytes:
        """Per key one tier code (kvstore.lookups), as the module docstring says (0: nowhere)."""
        n = len(keys)
        view = await self.route.healthy_view(deadline_s)
        if not n or not view:
            return bytes(n)
        end = time.monotonic() + (deadline_s or self.op_timeout_s)
        owners, hi = self.cfg.replicas, self.cfg.replicas + self.cfg.lookahead
        addrs = [x.id for x in view]
        every = owners >= len(view)  # every node owns every key: no ranking, no second round
        second = not every and hi > owners
        pairs = key_pairs(keys)  # the keys as numpy rows (no copy), for the hint probes
        ranking = None if every else self.ranking(keys, view)  # kept for every round
        best = np.full(n, _NONE, dtype=np.uint8)
        if every:
            groups = {a: np.arange(n) for a in addrs}
        else:
            groups = ranking.groups(None, 0, owners)
        hinted = np.zeros(0, dtype=np.int64)
        ahead: dict[str, np.ndarray] = {}
        if second and self.hints:  # the lookahead round of hinted keys goes out now, too
            hinted = self.hints.among(pairs)
            if len(hinted):
                ahead = ranking.groups(hinted, owners, hi)
        late = np.full(n, _NONE, dtype=np.uint8) if ahead else None
        # a node's owned keys and its hinted lookahead keys share its requests (a key's
        # owners and its lookahead nodes are distinct nodes, so no key is asked twice there)
        tasks = self._send(keys, groups, max(end - time.monotonic(), 1e-3), ahead)
        if await self._collect(tasks, best, None, late) or not second:
            if len(hinted):
                self.hints.note(pairs, _EMPTY, hinted)  # every one found on its owners
            return _codes(best)
        pending = np.flatnonzero(best == _NONE)  # no owner has these
        if len(hinted):  # the hints change only where this lookup's answers differ from them
            was_hinted = np.zeros(n, dtype=bool)
            was_hinted[hinted] = True
            found_hinted = hinted[best[hinted] != _NONE]
            asked = was_hinted[pending]  # asked ahead already
            fresh = pending[~asked]
        else:
            found_hinted, fresh, asked = hinted, pending, None
        if len(found_hinted) or len(fresh):
            self.hints.note(pairs, fresh, found_hinted)
        if late is not None:  # every request of round 1 answered (or failed): its hinted keys too
            best[pending[asked]] = late[pending[asked]]
            pending = pending[~asked]
        if len(pending):
            self.counters["lookup_second_rounds"] += 1
            groups = ranking.groups(pending, owners, hi)
            await self._collect(self._send(keys, groups, max(end - time.monotonic(), 1e-3)), best, pending)
        return _codes(best)

    def plan(self, keys: KeyBatch, lo: int, hi: int, view: list[Node]) -> dict[str, np.ndarray]:
        """Per node of ``view``, the (ascending) indices of ``keys`` whose ranks ``lo..hi-1``
        it holds (all keys for every node when every node is a candidate)."""
        if lo == 0 and hi >= len(view):
            every = np.arange(len(keys))
            return {x.id: every for x in view}
        return self.ranking(keys, view).groups(None, lo, hi)

    def _send(
        self,
        keys: KeyBatch,
        groups: dict[str, np.ndarray],
        deadline_s: float,
        ahead: dict[str, np.ndarray] | None = None,
    ) -> dict[asyncio.Future, tuple[np.ndarray, int]]:
        """Start the EXISTS of ``groups`` and ``ahead`` (per node, the indices of its keys and
        of its hinted lookahead keys; at most ``MAX_EXISTS_KEYS`` keys a request, all in parallel);
        each request's future with the indices it asked about, its owned ones first, and how
        many of them were owned (the rest were asked ahead). A node that left the membership
        since the lookup began is not asked (its keys stay unanswered)."""
        nodes, timed = self.route.nodes, self.route.timed
        ahead = ahead or {}
        tasks: dict[asyncio.Future, tuple[np.ndarray, int]] = {}
        for a in (*groups, *(x for x in ahead if x not in groups)):
            node = nodes.get(a)
            if node is None:
                continue
            own, more = groups.get(a, _EMPTY), ahead.get(a, _EMPTY)
            idx = np.concatenate((own, more)) if len(more) else own
            whole = not len(more) and len(own) == len(keys)  # own: ascending, so all keys in order
            for lo, hi in _split(len(idx), MAX_EXISTS_KEYS):
                part = idx[lo:hi]
                ks = keys if whole and len(part) == len(keys) else keys.take(part)
                fut = asyncio.ensure_future(timed(a, "exists", node.lookup(ks, deadline_s)))
                tasks[fut] = (part, min(max(len(own) - lo, 0), hi - lo))
            self.counters["lookup_keys_asked"] += len(idx)
        return tasks

    async def _collect(
        self,
        tasks: dict[asyncio.Future, tuple[np.ndarray, int]],
        best: np.ndarray,
        asked: np.ndarray | None,
        late: np.ndarray | None = None,
    ) -> bool:
        """Merge the answers of ``tasks`` into ``best`` (the least code wins; the keys a request
        asked ahead into ``late`` instead) as they come; ``asked``: the key indices ``best``
        must cover (None: all), all unanswered at the start. True, early, once every one was
        found (the rest are left to finish: :meth:`_leave`)."""
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                got = np.frombuffer(t.result().tiers, dtype=np.uint8)
                got = np.where(got == 0, _NONE, got)
                idx, owned = tasks[t]  # distinct indices within one request, owned ones first
                if owned < len(idx):  # the rest were asked ahead (hinted): into ``late``
                    more = idx[owned:]
                    late[more] = np.minimum(late[more], got[owned:])
                    idx, got = idx[:owned], got[:owned]
                best[idx] = np.minimum(best[idx], got)
            left = best if asked is None else best[asked]
            if not (left == _NONE).any():
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


def _codes(best: np.ndarray) -> bytes:
    return np.where(best == _NONE, 0, best).astype(np.uint8).tobytes()


def _split(n: int, most: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` bounds cutting ``n`` items into the fewest even parts of at most ``most``
    (sent in parallel, so the node answers the first while the client encodes the next)."""
    if not n:
        return []
    size = -(-n // -(-n // most))
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]
