"""Deepest first: the order in which a node indexes the blocks of one PUT, so that among a
request's new blocks, all of the same age, the deepest go first on every node.

A chain's blocks are spread over nodes (rendezvous placement), and each node evicts on its
own; a node's batch of a request is a few runs of consecutive blocks, each run's parent on
another node. Indexed in batch order, the run nearest the chain's head would be the oldest of
the request and the first to go, cutting the chain there on that node while the others keep
the blocks below the cut (orphans, and lost hits); deepest first, every node eats its part of
a chain from the tail, as one node does (bench/trace.py measures the difference).

- :func:`commit_order`: a PUT's blocks, the runs of consecutive blocks (a block whose parent
  is the one before it) last run first, each run in chain order: a parent is still indexed
  before its child on the same node (the eviction order judges a child by its parent's state
  when it is added, kvstore/node/tiers/order.py).

Reads follow the same rule: a lease marks the blocks it read from memory used deepest first
when it ends (kvstore/node/leasing.py ``_touch_deepest_first``).
"""

from __future__ import annotations

from collections.abc import Sequence


def commit_order(keys: Sequence[bytes], parents: Sequence[bytes]) -> list[int]:
    """Indices into ``keys`` (a batch in chain order, ``parents[i]`` the parent of
    ``keys[i]``): the last run of consecutive blocks first, each run in order."""
    runs: list[list[int]] = []
    for i, p in enumerate(parents):
        if runs and p == keys[i - 1]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return [i for run in reversed(runs) for i in run]
