"""Weighted rendezvous (highest-random-weight) placement of block keys over nodes.

One file (~350 lines) on purpose: the scalar order, its numpy twin and the cache of orders
must agree key for key, and are read and changed together.

Contract: :func:`rank` orders all given nodes for one key, deterministically (xxh3 of the key
and the node id; no seeds, the same order in every process). The first ``replicas`` nodes of
the order lie on distinct nodes and, while enough zones exist, on distinct zones; the rest
follow in score order. A node's share of keys is proportional to its weight. Adding or
removing one node changes a key's top owner only when that node is (or was) the top owner, so
about ``weight/total`` of the keys move and no others.

Scores use the logarithmic method: ``score = weight / -ln(u)``, ``u`` uniform in (0, 1) from
the hash; the argmax is node ``i`` with probability ``w_i / sum(w)``.

:func:`rank_positions` ranks a :class:`~kvstore.keys.KeyBatch` at once (the same orders, in
numpy; :func:`rank_many` gives them as id tuples); :class:`RankCache` keeps each key's order
over one view, bounded in entries (numpy tables over packed keys), for clients that rank the same keys again, and hands a
lookup a :class:`Ranking` of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.keys import KeyBatch
from kvstore.keytable import KeyTable, key_pairs

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
    """Per key, the ids of :func:`rank` ``(key, nodes, replicas)`` (:func:`rank_positions` in
    bulk). Equal orders come back as one shared tuple."""
    ids, rows = rank_positions(KeyBatch(b"".join(keys)), nodes, replicas)
    if not ids:
        return [()] * len(keys)
    uniq, inverse = unique_rows(rows)
    orders = [tuple(ids[j] for j in row) for row in uniq.tolist()]
    return list(map(orders.__getitem__, inverse.tolist()))


def _exact_scores(pre: bytes, w: float, raws: Sequence[bytes]) -> list[float]:
    h64, log = xxhash.xxh3_64_intdigest, math.log
    return [w / -log((h + 0.5) / _TWO64) for h in map(h64, [pre + k for k in raws])]


def _near_ties(scores: np.ndarray) -> np.ndarray:
    """Per row, whether two of its scores lie within 1e-9 (relative) of each other."""
    m = scores.shape[1]
    if m > 16:
        srt = np.sort(scores, axis=1)
        return (np.diff(srt, axis=1) <= srt[:, 1:] * 1e-9).any(axis=1)
    a, b = scores[:, :, None], scores[:, None, :]
    near = np.abs(a - b) <= np.maximum(a, b) * 1e-9
    near[:, np.arange(m), np.arange(m)] = False  # a score and itself
    return near.any(axis=(1, 2))


def _order(scores: np.ndarray) -> np.ndarray:
    """Per row, the column positions by score, highest first; equal scores: the larger
    position (id) first, as rank's reverse sort of (score, id). A view has a few nodes: each
    node's place is the count of nodes that beat it (one broadcast compare), not a sort per
    row; a large view sorts."""
    n, m = scores.shape
    if m > 16:
        return (m - 1 - np.argsort(-scores[:, ::-1], axis=1, kind="stable")).astype(np.int16)
    a, b = scores[:, :, None], scores[:, None, :]  # a: node j, b: node k
    later = np.arange(m)[None, :] > np.arange(m)[:, None]  # [j, k]: k > j
    place = ((b > a) | ((b == a) & later[None])).sum(axis=2)  # nodes ahead of j
    rows = np.empty((n, m), dtype=np.int16)
    np.put_along_axis(rows, place, np.arange(m, dtype=np.int16)[None, :].repeat(n, axis=0), axis=1)
    return rows


def unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of a ``(n, m)`` order matrix and each row's index among them (a
    view's few orders: each row packed into one int and those sorted, not rows compared)."""
    n, m = rows.shape
    if m == 0 or m > 12 or n == 0:  # m**m no longer fits an int64
        uniq, inverse = np.unique(rows, axis=0, return_inverse=True)
        return uniq, inverse.reshape(-1)
    packed = rows.astype(np.int64) @ (m ** np.arange(m, dtype=np.int64))
    _, first, inverse = np.unique(packed, return_index=True, return_inverse=True)
    return rows[first], inverse.reshape(-1)


def rank_positions(
    keys: KeyBatch, nodes: Sequence[Node], replicas: int = 1
) -> tuple[tuple[str, ...], np.ndarray]:
    """Every key's :func:`rank` order at once: ``(ids, rows)``, ``ids`` the nodes' ids sorted
    and ``rows[i]`` (int16, one row per key) the positions into ``ids`` of key ``i``'s
    order, owners first. The same orders as :func:`rank`: scores are computed per node over
    all keys (one hash call per key and node, in C; numpy for the rest), ties broken by the
    larger id first, zones spread per distinct order. A key whose two scores are so close
    that numpy's ``log`` and the math module's might order them differently (within 1e-9,
    relative) is scored again exactly as :func:`score` does, so no order ever differs."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    ns = sorted(nodes, key=lambda n: n.id)
    if len({n.id for n in ns}) != len(ns):
        raise ValueError("placement: node ids must be unique")
    n, m = len(keys), len(ns)
    ids = tuple(x.id for x in ns)
    if not m or not n:
        return ids, np.zeros((n, m), dtype=np.int16)
    raws = keys.raws()
    h64 = xxhash.xxh3_64_intdigest
    scores = np.empty((n, m), dtype=np.float64)
    for j, node in enumerate(ns):
        pre = node.id.encode() + b"\0"
        h = np.fromiter(map(h64, map(pre.__add__, raws)), dtype=np.uint64, count=n)
        scores[:, j] = node.weight / -np.log((h.astype(np.float64) + 0.5) / _TWO64)
    if m > 1:
        close = np.flatnonzero(_near_ties(scores))
        if len(close):  # near ties: the exact scores of those keys decide
            few = [raws[i] for i in close.tolist()]
            for j, node in enumerate(ns):
                scores[close, j] = _exact_scores(node.id.encode() + b"\0", node.weight, few)
    rows = _order(scores)
    if replicas > 1 and any(x.zone for x in ns):
        uniq, inverse = unique_rows(rows)
        spread = np.array(
            [
                [ids.index(x.id) for x in spread_zones([ns[j] for j in row], replicas)]
                for row in uniq.tolist()
            ],
            dtype=np.int16,
        )
        rows = spread[inverse.reshape(-1)]
    return ids, rows


def owners(key: bytes, nodes: Sequence[Node], replicas: int) -> list[Node]:
    """The ``replicas`` nodes (fewer when there are fewer nodes) that own ``key``."""
    return rank(key, nodes, replicas)[:replicas]


@dataclass(frozen=True, eq=False)
class Ranking:
    """The rendezvous orders of one batch of keys over one view, fixed when made: a lookup
    keeps it through all its rounds, whatever the cache it came from does meanwhile.
    ``ids``: the view's node ids, sorted; ``codes[i]``: key ``i``'s row of ``orders``, the
    positions into ``ids`` of its order (owners first)."""

    ids: tuple[str, ...]
    codes: np.ndarray
    orders: np.ndarray

    def groups(self, idx: np.ndarray | None, lo: int, hi: int) -> dict[str, np.ndarray]:
        """Per node, the key indices (``idx``, ascending; None: all keys) whose order ranks
        ``lo..hi-1`` hold it, ascending. One gather over the keys, then one mask pass per node."""
        m = len(self.ids)
        if not m:
            return {}
        band = self.orders[:, lo : min(hi, m)]
        if m > 63:  # too many nodes for one bit each: a pass per node
            base = np.arange(len(self.codes)) if idx is None else np.asarray(idx, dtype=np.int64)
            codes = self.codes if idx is None else self.codes[base]
            out: dict[str, np.ndarray] = {}
            for j, addr in enumerate(self.ids):
                mine = base[(band == j).any(axis=1)[codes]]
                if len(mine):
                    out[addr] = mine
            return out
        # per distinct order (a few), one bit per node it puts in the band; then one gather
        # per key and one mask test per node, not a gather per node
        per_order = np.zeros(len(band), dtype=np.uint64)
        for col in band.T.astype(np.uint64):
            per_order |= np.left_shift(np.uint64(1), col)
        if idx is None:
            base, mask = None, per_order.take(self.codes)
        else:
            base = np.asarray(idx, dtype=np.int64)
            mask = per_order.take(self.codes.take(base))
        named = int(np.bitwise_or.reduce(per_order)) if len(per_order) else 0
        out = {}
        for j, addr in enumerate(self.ids):
            if not named >> j & 1:
                continue
            at = np.flatnonzero(mask & np.uint64(1 << j))
            mine = at if base is None else base.take(at)
            if len(mine):
                out[addr] = mine
        return out

    def order(self, i: int) -> tuple[str, ...]:
        """Key ``i``'s node ids, owners first."""
        return tuple(self.ids[j] for j in self.orders[self.codes[i]].tolist())


class RankCache:
    """Each key's rendezvous order over one healthy view, as a code: an index into
    ``orders`` (a view of n nodes has at most n! orders, and equal orders share one code).

    Bounded in entries: two generations of at most ``max_entries // 2`` keys each; a key
    found in the old generation moves to the new one, and when the new one is full the old
    one is dropped. That is an LRU at generation granularity with no per-hit bookkeeping.
    :meth:`reset` with a different view or ``replicas`` empties it (placement changed): it
    makes new tables, so a :class:`Ranking` made before keeps its own. Each generation is a
    :class:`~kvstore.keytable.KeyTable`: a batch's probes and inserts are numpy passes
    over its packed keys (no Python per key); misses are ranked in one
    :func:`rank_positions` call."""

    def __init__(self, max_entries: int = 1 << 17) -> None:
        if max_entries < 2:
            raise ValueError(f"rank cache max_entries must be >= 2, got {max_entries}")
        self._gen = max_entries // 2
        self._new = KeyTable(self._gen)
        self._old = KeyTable(self._gen)
        self._rows: list[tuple[int, ...]] = []  # per code: positions into _ids
        self._code_of: dict[tuple[int, ...], int] = {}
        self._ids: tuple[str, ...] = ()
        self.orders: list[tuple[str, ...]] = []  # per code: node ids
        self._view: tuple[Node, ...] = ()
        self._replicas = 1

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    @property
    def view(self) -> tuple[Node, ...]:
        return self._view

    def reset(self, view: Sequence[Node], replicas: int) -> None:
        """Rank over ``view`` (the healthy members) with ``replicas`` owners from now on."""
        view = tuple(view)
        if view == self._view and replicas == self._replicas:
            return
        self._view, self._replicas = view, replicas
        self._ids = tuple(sorted(n.id for n in view))
        self._new, self._old = KeyTable(self._gen), KeyTable(self._gen)
        self._rows, self._code_of, self.orders = [], {}, []

    def ranking(self, keys: KeyBatch) -> Ranking:
        """The orders of ``keys`` over the current view, as a :class:`Ranking` of its own."""
        codes = self._codes(key_pairs(keys))
        m = len(self._ids)
        orders = np.array(self._rows, dtype=np.int16).reshape(len(self._rows), m)
        return Ranking(self._ids, codes, orders)

    def codes(self, raws: Sequence[bytes]) -> list[int]:
        """Per raw key, the code of its order (``orders[code]``: node ids, owners first)."""
        return self._codes(key_pairs(KeyBatch(b"".join(raws)))).tolist()

    def orders_of(self, keys: KeyBatch) -> list[tuple[str, ...]]:
        """Per key of ``keys``, the view's node ids in its order (owners first), in bulk."""
        return list(map(self.orders.__getitem__, self._codes(key_pairs(keys)).tolist()))

    def _codes(self, pairs: np.ndarray) -> np.ndarray:
        codes = self._new.find(pairs)
        missed = np.flatnonzero(codes < 0)
        if not len(missed):
            return codes
        few = pairs if len(missed) == len(pairs) else pairs[missed]
        if len(self._old):
            back = self._old.find(few)
            hit = back >= 0
            if hit.any():
                codes[missed[hit]] = back[hit]
                self._insert(few[hit], back[hit])
                missed, few = missed[~hit], few[~hit]
        if len(missed):
            if len(missed) == 1:  # one key (reads and writes rank per key): rank() itself
                order = rank(few.tobytes(), self._view, self._replicas)
                got = np.array([self._code(tuple(map(self._ids.index, (x.id for x in order))))])
            else:
                _, rows = rank_positions(KeyBatch(few.tobytes()), self._view, self._replicas)
                uniq, inverse = unique_rows(rows)
                fresh = np.array([self._code(tuple(r)) for r in uniq.tolist()], dtype=np.int64)
                got = fresh[inverse]
            codes[missed] = got
            self._insert(few, got)
        return codes

    def _code(self, row: tuple[int, ...]) -> int:
        c = self._code_of.get(row)
        if c is None:
            c = self._code_of[row] = len(self._rows)
            self._rows.append(row)
            self.orders.append(tuple(self._ids[j] for j in row))
        return c

    def _insert(self, pairs: np.ndarray, codes: np.ndarray) -> None:
        if len(pairs) > self._gen:
            pairs, codes = pairs[-self._gen :], codes[-self._gen :]
        if len(self._new) + len(pairs) > self._gen:
            self._old, self._new = self._new, self._old
            self._new.clear()
        self._new.insert(pairs, codes)

    def order(self, raw: bytes) -> tuple[str, ...]:
        """The view's node ids in ``raw``'s rendezvous order (owners first)."""
        return self.orders[int(self._codes(key_pairs(KeyBatch(raw)))[0])]
