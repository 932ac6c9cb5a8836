"""Weighted rendezvous (highest-random-weight) placement of block keys over nodes.

Contract: :func:`rank` orders all given nodes for one key, deterministically (xxh3 of the key
and the node id; no seeds, the same order in every process). The first ``replicas`` nodes of
the order lie on distinct nodes and, while enough zones exist, on distinct zones; the rest
follow in score order. A node's share of keys is proportional to its weight. Adding or
removing one node changes a key's top owner only when that node is (or was) the top owner, so
about ``weight/total`` of the keys move and no others.

Scores use the logarithmic method: ``score = weight / -ln(u)``, ``u`` uniform in (0, 1) from
the hash; the argmax is node ``i`` with probability ``w_i / sum(w)``.
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
