"""Weighted rendezvous (highest-random-weight) placement of block keys over nodes.

Contract: :func:`rank` orders all given nodes for one key, deterministically (xxh3 of the key
and the node id; no seeds, the same order in every process). The first ``replicas`` nodes of
the order lie on distinct nodes and, while enough zones exist, on distinct zones; the rest
follow in score order. A node's share of keys is proportional to its weight. Adding or
removing one node changes a key's top owner only when that node is (or was) the top owner, so
about ``weight/total`` of the keys move and no others.

Scores use the logarithmic method: ``score = weight / -ln(u)``, ``u`` uniform in (0, 1) from
the hash; the argmax is node ``i`` with probability ``w_i / sum(w)``.

:func:`rank_many` ranks many keys at once (the same orders); :class:`RankCache` keeps each
key's order over one view, bounded in entries, for clients that rank the same keys again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

_TWO64 = float(1 << 64)


@dataclass(frozen=True, slots=True)
class Node:
    """One storage node as placement sees it: ``id`` (its data address), weight (> 0), zone."""

    id: str
    weight: float = 1.0
    zone: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("placement node id must be non-empty")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"node {self.id!r}: weight must be a finite number > 0, got {self.weight!r}")


def score(key: bytes, node: Node) -> float:
    """The node's rendezvous score for ``key`` (higher wins)."""
    h = xxhash.xxh3_64_intdigest(node.id.encode() + b"\0" + key)
    u = (h + 0.5) / _TWO64  # in (0, 1)
    return node.weight / -math.log(u)


def rank(key: bytes, nodes: Sequence[Node], replicas: int = 1) -> list[Node]:
    """All ``nodes`` in preference order for ``key``; the first ``replicas`` prefer distinct
    zones (when zones are set), then fill from the best remaining nodes. Node ids must be
    unique (ValueError otherwise)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    ordered = sorted(nodes, key=lambda n: (score(key, n), n.id), reverse=True)
    if len({n.id for n in ordered}) != len(ordered):
        raise ValueError("placement: node ids must be unique")
    if replicas == 1 or not any(n.zone for n in ordered):
        return ordered
    return spread_zones(ordered, replicas)


def spread_zones(ordered: Sequence[Node], replicas: int) -> list[Node]:
    """Reorder ``ordered`` so its first ``replicas`` entries use as many distinct zones as
    there are, keeping score order otherwise."""
    picked: list[Node] = []
    zones: set[str] = set()
    for n in ordered:
        if len(picked) == replicas:
            break
        if n.zone not in zones:
            picked.append(n)
            zones.add(n.zone)
    if len(picked) < replicas:  # fewer zones than replicas: fill with the best others
        chosen = {n.id for n in picked}
        picked += [n for n in ordered if n.id not in chosen][: replicas - len(picked)]
    chosen = {n.id for n in picked}
    head = [n for n in ordered if n.id in chosen]  # keep score order among the owners
    return head + [n for n in ordered if n.id not in chosen]


def rank_many(keys: Sequence[bytes], nodes: Sequence[Node], replicas: int = 1) -> list[tuple[str, ...]]:
    """Per key, the ids of :func:`rank` ``(key, nodes, replicas)``: the same scores (the same
    floats), the same ties (broken by the larger id first) and the same zone spread, computed a
    node at a time over all keys so the Python per key is one small sort. Equal orders come
    back as one shared tuple (a cache of many keys holds few distinct orders)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    ns = sorted(nodes, key=lambda n: n.id)
    if len({n.id for n in ns}) != len(ns):
        raise ValueError("placement: node ids must be unique")
    if not ns:
        return [()] * len(keys)
    h64, log = xxhash.xxh3_64_intdigest, math.log
    cols = []
    for n in ns:
        pre, w = n.id.encode() + b"\0", n.weight
        cols.append([w / -log((h + 0.5) / _TWO64) for h in map(h64, [pre + k for k in keys])])
    # sorting positions by score, highest first, from the last id down: equal scores keep
    # that order, the larger id first, as rank's reverse sort of (score, id) does
    back = range(len(ns) - 1, -1, -1)
    zoned = replicas > 1 and any(n.zone for n in ns)
    ids = [n.id for n in ns]
    interned: dict[tuple[int, ...], tuple[str, ...]] = {}
    out = []
    for row in zip(*cols):
        pos = tuple(sorted(back, key=row.__getitem__, reverse=True))
        order = interned.get(pos)
        if order is None:
            if zoned:
                order = tuple(n.id for n in spread_zones([ns[j] for j in pos], replicas))
            else:
                order = tuple(ids[j] for j in pos)
            interned[pos] = order
        out.append(order)
    return out


def owners(key: bytes, nodes: Sequence[Node], replicas: int) -> list[Node]:
    """The ``replicas`` nodes (fewer when there are fewer nodes) that own ``key``."""
    return rank(key, nodes, replicas)[:replicas]


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
