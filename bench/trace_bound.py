"""Belady's offline optimum for a trace replay: an upper bound on any eviction policy's hit
ratio at a capacity (simulation only; never in the node).

One node, one tier of ``capacity`` blocks. Each request reads its chain's blocks in order;
a block present is a hit, a block absent is stored. When the tier is over capacity the block
whose next use is farthest goes (never used again: infinitely far), the deepest first among
equals; the block just stored may be the one (it is then not kept: "bypass", which only
helps the bound). A parent's next use is never after its child's (a request reads the
whole chain up to a block), and ties go to the deeper block, so the kept set is always
prefix-closed: a block is never kept without its parent, and every block hit is part of the
request's hit prefix (:func:`belady` asserts it). Belady's rule maximizes block hits over every policy that keeps at most
``capacity`` blocks, prefix-aware or not, and a policy's prefix hits are at most its block
hits: the result bounds every policy's hit tokens.

    python bench/trace_bound.py --trace conversation --capacities 3000,6000
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trace_sim import BLOCK_TOKENS, ChainKeys, Request, load_trace, trace_namespace  # noqa: E402

NEVER = 1 << 62


def accesses(requests: list[Request]) -> tuple[list[int], list[int], list[int], list[int]]:
    """The replay as one sequence of block accesses: per access its block id, its depth in
    the chain, the index of its request, and the time of that block's next access."""
    chain = ChainKeys(trace_namespace())
    ids: dict[bytes, int] = {}
    block, depth, req = [], [], []
    for r, q in enumerate(requests):
        for d, k in enumerate(chain.keys(q.hash_ids)):
            block.append(ids.setdefault(k, len(ids)))
            depth.append(d)
            req.append(r)
    nxt = [NEVER] * len(block)
    last: dict[int, int] = {}
    for t in range(len(block) - 1, -1, -1):
        nxt[t] = last.get(block[t], NEVER)
        last[block[t]] = t
    return block, depth, req, nxt


def belady(requests: list[Request], capacity: int, seq=None) -> float:
    """Hit tokens / input tokens of Belady's rule (module docstring) at ``capacity`` blocks."""
    block, depth, req, nxt = seq or accesses(requests)
    at: dict[int, int] = {}  # stored block -> its next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block); stale entries skipped
    hits = block_hits = 0
    miss_in: set[int] = set()  # requests that missed already: the rest of the chain is new
    for t, b in enumerate(block):
        block_hits += b in at
        if b in at and req[t] not in miss_in:
            hits += 1
        else:
            miss_in.add(req[t])
        at[b] = nxt[t]
        heapq.heappush(heap, (-nxt[t], -depth[t], b))
        while len(at) > capacity:
            n, _, v = heapq.heappop(heap)
            if at.get(v) == -n:
                del at[v]
    total = sum(q.input_tokens for q in requests)
    assert hits == block_hits, (hits, block_hits)  # the kept set stayed prefix-closed
    return hits * BLOCK_TOKENS / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="conversation")
    ap.add_argument("--capacities", default="1000,3000,6000,10000,30000")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    reqs = load_trace(a.trace)
    seq = accesses(reqs)
    rows = []
    for c in (int(x) for x in a.capacities.split(",")):
        rows.append(
            {
                "trace": a.trace,
                "capacity_blocks": c,
                "policy": "belady",
                "hit_token_ratio": belady(reqs, c, seq),
            }
        )
        print(f"{a.trace} {c:>6} belady {rows[-1]['hit_token_ratio']:.4f}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
