"""Hit rate on real traffic: Mooncake's production traces (bench/traces/) replayed against
tierkv's eviction policies, by simulation (every cell) and on real daemons (a subset that
checks the simulation).

A request does what the connector does through ``kvstore.client``: EXISTS of its full blocks'
keys, GET of the hit prefix (the leading run of stored keys), PUT of its new full blocks.
Each 512-token block of the trace is one block of ``--payload`` bytes; keys are chained by
kvstore.keys over the hash ids (bench/trace_sim.py: ``trace_namespace``). Capacity is in
blocks, the cluster's total: one node, or three nodes of a third each (rendezvous placement,
one copy). Tiers: ``dram`` (DRAM only) or ``dram+disk`` (DRAM a quarter of the capacity,
disk all of it, write-through). Hit token ratio = hit tokens / input tokens; orphan ratio =
blocks stored whose parent is stored nowhere, over capacity (time average in the
simulation, at the end of the replay on daemons). Which keys share a node depends on the
nodes' addresses (rendezvous hashes a key with each address), so a simulated three-node cell
is the mean over ``--placements`` draws of the addresses (each draw's hit ratio is in its
row); the daemons run one draw, their ports, beside the simulation of the same addresses.
Three nodes are a static cluster
(``cluster.peers``) running the orphan pass (kvstore/member/orphans.py) every
``--orphan-every`` requests, node after node (the daemons asked through
``POST /v1/orphans/pass``, the simulation at the same points); ``--orphan-every 0``: none.

    python bench/trace.py                      # simulation sweep + daemon check, JSON + plot
    python bench/trace.py --quick              # fewer requests, fewer cells
    python bench/trace.py --daemon-requests 0  # simulation only
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import common
from common import REPO
from trace_daemons import DAEMON_CELLS, daemon_cell
from trace_report import DEFAULT_POLICY, cell_keys, markdown, plot, table
from trace_sim import (
    load_trace,
    node_ids,
    simulate,
)

from kvstore.node.tiers.order import POLICIES as ORDER_POLICIES

CAPACITIES: list[int | None] = [1000, 3000, 6000, 10000, 30000, None]
POLICIES = list(ORDER_POLICIES)


def _sim_cell(args: tuple) -> dict:
    """One simulated cell. More than one node with a capacity: the mean over ``placements``
    draws of the node addresses (trace_sim.node_ids), each draw's hit ratio kept in the row;
    one node, or no capacity (nothing is evicted), does not depend on them: one run."""
    trace, n_req, nodes, tiers, cap, policy, every, placements = args
    reqs = load_trace(trace, n_req)
    t0 = time.perf_counter()
    draws = placements if nodes > 1 and cap is not None else 1
    runs = [
        simulate(reqs, nodes, cap, tiers, policy, ids=node_ids(nodes, p), orphan_every=every)
        for p in range(draws)
    ]
    ratios = [r.hit_token_ratio for r in runs]
    dram, disk = sum(r.hits["dram"] for r in runs), sum(r.hits["disk"] for r in runs)
    row = {
        **cell_keys(trace, nodes, tiers, cap, policy),
        "hit_token_ratio": round(sum(ratios) / draws, 5),
        "orphan_bytes_ratio": round(sum(r.orphan_ratio for r in runs) / draws, 5),
        "disk_hit_share": round(disk / (dram + disk), 4) if dram + disk else 0.0,
        "orphan_pass_every": every if nodes > 1 else 0,
        "orphans_evicted": round(sum(r.orphans_evicted for r in runs) / draws),
        "requests": len(reqs),
        "source": "simulation",
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if draws > 1:
        row["placement_hit_token_ratios"] = [round(x, 5) for x in ratios]
    return row


def sweep_cells(
    traces: list[str], n_req: int | None, quick: bool, every: int, policies: list[str], placements: int
) -> list[tuple]:
    """Every policy at one node, DRAM only; LRU and the default for 3 nodes and two tiers
    (with the orphan pass every ``every`` requests, and in DRAM once without it: its effect),
    each three-node cell over ``placements`` draws of the node addresses."""
    cells = []
    caps = [1000, 3000, 6000, None] if quick else CAPACITIES
    two = sorted({"lru", DEFAULT_POLICY})
    for trace in traces:
        for nodes, tiers in [(1, "dram"), (3, "dram"), (1, "dram+disk"), (3, "dram+disk")]:
            pols = policies if (nodes, tiers) == (1, "dram") else two
            for cap in caps:
                for pol in pols if cap is not None else two:
                    cells.append(
                        (trace, n_req, nodes, tiers, cap, pol, every if nodes > 1 else 0, placements)
                    )
                    if nodes > 1 and every and cap is not None and tiers == "dram":
                        cells.append((trace, n_req, nodes, tiers, cap, pol, 0, placements))
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="conversation,synthetic")
    ap.add_argument("--requests", type=int, default=0, help="simulate the first N requests (0: all)")
    ap.add_argument(
        "--daemon-requests",
        type=int,
        default=None,
        help="requests per daemon cell (0: none; default 1,500, with --quick 300)",
    )
    ap.add_argument("--payload", type=int, default=4096, help="bytes per 512-token block on the daemons")
    ap.add_argument("--speedup", type=float, default=0.0, help="replay timestamps / SPEEDUP (0: no waits)")
    ap.add_argument("--quick", action="store_true", help="2,000 requests, 4 capacities, 300 per daemon cell")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--orphan-every", type=int, default=10, help="requests between orphan passes on 3 nodes (0: none)"
    )
    ap.add_argument(
        "--placements",
        type=int,
        default=5,
        help="draws of the node addresses each three-node cell is averaged over (rendezvous "
        "placement depends on them)",
    )
    ap.add_argument("--policies", default="", help="one-node DRAM policies to sweep (default: all)")
    ap.add_argument("--no-sweep", action="store_true", help="only the daemon cells")
    ap.add_argument("--markdown", action="store_true", help="print the doc's tables of --json and exit")
    ap.add_argument("--json", default=str(REPO / "docs/results/trace.json"))
    ap.add_argument("--plot", default=str(REPO / "docs/trace.png"))
    ap.add_argument(
        "--only-tiers", default="", help="simulate only these tiers (dram or dram+disk); merge into --json"
    )
    ap.add_argument(
        "--only-policies", default="", help="simulate only the cells of these policies; merge into --json"
    )
    ap.add_argument(
        "--only-capacities",
        default="",
        help="simulate only these capacities (blocks, or unlimited); merge into --json",
    )
    ap.add_argument(
        "--only-nodes", type=int, default=0, help="simulate only cells of this many nodes (0: all)"
    )
    a = ap.parse_args()
    if a.markdown:
        print(markdown(json.loads(Path(a.json).read_text())))
        return
    traces = a.traces.split(",")
    n_req = 2000 if a.quick else (a.requests or None)
    d_req = a.daemon_requests if a.daemon_requests is not None else (300 if a.quick else 1500)
    load = common.loadavg()[0]
    pols = a.policies.split(",") if a.policies else POLICIES
    if a.placements < 1:
        ap.error(f"--placements: must be >= 1, got {a.placements}")
    cells = sweep_cells(traces, n_req, a.quick, a.orphan_every, pols, a.placements)
    cells = [c for c in cells if not a.only_tiers or c[3] == a.only_tiers]
    only_caps = (
        {None if c == "unlimited" else int(c) for c in a.only_capacities.split(",")}
        if a.only_capacities
        else set()
    )
    cells = [c for c in cells if not only_caps or c[4] in only_caps]
    cells = [c for c in cells if not a.only_nodes or c[2] == a.only_nodes]
    only_pols = set(a.only_policies.split(",")) if a.only_policies else set()
    cells = [c for c in cells if not only_pols or c[5] in only_pols]
    # the slowest first (three nodes over several placements, the largest capacities): the
    # pool's workers end together
    cells.sort(key=lambda c: -(c[4] or 10**6) * (c[7] if c[2] > 1 and c[4] else 1))
    rows = []
    if not a.no_sweep:
        with ProcessPoolExecutor(a.jobs) as pool:
            rows = list(pool.map(_sim_cell, cells))
    if d_req:
        for nodes, tiers, cap, pol in DAEMON_CELLS:
            rows.append(
                daemon_cell(
                    "conversation", d_req, nodes, tiers, cap, pol, a.payload, a.speedup, a.orphan_every
                )
            )
    partial = a.only_tiers or a.only_policies or a.only_capacities or a.only_nodes or a.no_sweep
    if partial and Path(a.json).exists():  # keep the other rows of the last run, marked not re-run
        ident = ("trace", "nodes", "tiers", "capacity_blocks", "policy", "source", "orphan_pass_every")
        fresh = {tuple(r.get(k) for k in ident) for r in rows}
        old = [r for r in json.loads(Path(a.json).read_text()) if tuple(r.get(k) for k in ident) not in fresh]
        for r in rows:
            r["rerun"] = True
        for r in old:
            r["rerun"] = False  # a row re-run by an earlier partial run is not this run's
        order = {tuple(r.get(k) for k in ident): i for i, r in enumerate(old + rows)}
        rows = sorted(
            old + rows, key=lambda r: (r["source"] != "simulation", order[tuple(r.get(k) for k in ident)])
        )
    print(table(rows))
    print(
        f"requests: {n_req or 'all'} simulated, {d_req} per daemon cell; load average {load:.2f} -> {common.loadavg()[0]:.2f}"
    )
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    if plot(rows, Path(a.plot)):
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
