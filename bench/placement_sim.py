"""Simulated weighted-rendezvous placement over 10, 100 and 1,000 nodes: load balance
(max/mean keys per node) and the share of keys moved when one node joins or leaves.

The algorithm is kvstore/client/placement.py's (score = weight / -ln(u), top score owns the
key), vectorized with numpy; u comes from a splitmix64 mix of the key and node ids instead of
xxh3 (which numpy cannot run per element), which has the same uniformity. ``--check`` first
runs the real ``placement.owners`` on a sample to show it behaves the same. Equal weights;
replicas=1 (the owner). Keys are processed in chunks, so memory stays small.

    python bench/placement_sim.py --keys 10000000 --json .bench/placement.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

M1, M2, G = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def mix(x: np.ndarray) -> np.ndarray:
    x = x + G
    x = (x ^ (x >> np.uint64(30))) * M1
    x = (x ^ (x >> np.uint64(27))) * M2
    return x ^ (x >> np.uint64(31))


def scores(keys: np.ndarray, node_ids: np.ndarray) -> np.ndarray:
    h = mix(keys[:, None] ^ mix(node_ids)[None, :])
    u = (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)) + 0.5 / (1 << 53)
    return 1.0 / -np.log(u)  # weight 1


def simulate(n_nodes: int, n_keys: int, chunk: int) -> dict:
    ids = np.arange(1, n_nodes + 1, dtype=np.uint64) * np.uint64(1_000_003)
    new_id = np.array([np.uint64(987_654_321_987)], dtype=np.uint64)
    load = np.zeros(n_nodes, dtype=np.int64)
    moved_join = 0
    t0 = time.perf_counter()
    with np.errstate(over="ignore"):
        for start in range(0, n_keys, chunk):
            k = mix(np.arange(start, min(start + chunk, n_keys), dtype=np.uint64))
            s = scores(k, ids)
            owner = s.argmax(axis=1)
            load += np.bincount(owner, minlength=n_nodes)
            moved_join += int((scores(k, new_id)[:, 0] > s.max(axis=1)).sum())
    mean = n_keys / n_nodes
    return {
        "nodes": n_nodes,
        "keys": n_keys,
        "max_over_mean": float(load.max() / mean),
        "min_over_mean": float(load.min() / mean),
        "moved_on_join": moved_join / n_keys,
        "ideal_join": 1 / (n_nodes + 1),
        "moved_on_leave": float(load[0] / n_keys),  # node 0 leaves: exactly its keys move
        "ideal_leave": 1 / n_nodes,
        "seconds": time.perf_counter() - t0,
    }


def check_real(n_nodes: int = 10, n_keys: int = 50_000) -> dict:
    """The real placement function on a sample: the same statistics."""
    import random

    from kvstore.client.placement import Node, owners

    rnd = random.Random(1)
    nodes = [Node(f"10.0.{i // 250}.{i % 250}:7000") for i in range(n_nodes)]
    joined = [*nodes, Node("10.9.9.9:7000")]
    load: dict[str, int] = {}
    moved = 0
    for _ in range(n_keys):
        k = rnd.randbytes(16)
        a = owners(k, nodes, 1)[0].id
        load[a] = load.get(a, 0) + 1
        moved += owners(k, joined, 1)[0].id != a
    return {
        "nodes": n_nodes,
        "keys": n_keys,
        "max_over_mean": max(load.values()) / (n_keys / n_nodes),
        "moved_on_join": moved / n_keys,
        "ideal_join": 1 / (n_nodes + 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=10_000_000)
    ap.add_argument("--nodes", default="10,100,1000")
    ap.add_argument("--chunk-cells", type=int, default=20_000_000, help="keys x nodes per numpy chunk")
    ap.add_argument("--check", action="store_true", help="also run the real placement on a sample")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    real = check_real() if args.check else None
    for n in (int(x) for x in args.nodes.split(",")):
        rows.append(simulate(n, args.keys, max(1, args.chunk_cells // n)))
    print(
        f"{'nodes':>6} {'keys':>10} {'max/mean':>9} {'min/mean':>9} {'join moved':>11} {'1/(N+1)':>8} {'leave moved':>12} {'1/N':>7} {'s':>6}"
    )
    for r in rows:
        print(
            f"{r['nodes']:>6} {r['keys']:>10} {r['max_over_mean']:>9.4f} {r['min_over_mean']:>9.4f} "
            f"{r['moved_on_join']:>11.5f} {r['ideal_join']:>8.5f} {r['moved_on_leave']:>12.5f} {r['ideal_leave']:>7.5f} {r['seconds']:>6.1f}"
        )
    if real:
        print(
            f"real placement.owners, {real['nodes']} nodes x {real['keys']} keys: max/mean {real['max_over_mean']:.4f}, "
            f"join moved {real['moved_on_join']:.4f} (ideal {real['ideal_join']:.4f})"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"bench": "placement_sim", "rows": rows, "real_check": real}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
