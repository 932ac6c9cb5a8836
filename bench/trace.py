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
import asyncio
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import common
from common import REPO
from trace_sim import (
    BLOCK_TOKENS,
    GET_BATCH,
    ChainKeys,
    load_trace,
    node_ids,
    simulate,
    trace_namespace,
)

from kvstore.block import make_header
from kvstore.client.read import get_into
from kvstore.config import EvictionSection
from kvstore.keys import BlockKey
from kvstore.node.tiers.order import POLICIES as ORDER_POLICIES

CAPACITIES: list[int | None] = [1000, 3000, 6000, 10000, 30000, None]
POLICIES = list(ORDER_POLICIES)
DEFAULT_POLICY = EvictionSection().policy


def _cell(trace: str, nodes: int, tiers: str, cap: int | None, policy: str) -> dict:
    """The keys that name a row's cell (simulated or on daemons)."""
    return {
        "trace": trace,
        "nodes": nodes,
        "tiers": tiers,
        "capacity_blocks": cap,
        "policy": policy,
        "default": policy == DEFAULT_POLICY,
    }


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
        **_cell(trace, nodes, tiers, cap, policy),
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


# ---------------------------------------------------------------- real daemons


def _launch(
    wd: Path,
    per_node: int | None,
    tiers: str,
    policy: str,
    payload: int,
    hlen: int,
    port: int,
    peers: list[str],
):
    """One daemon; with ``peers`` (more than one node) a static cluster member whose orphan
    pass runs only when asked (no repair: one copy, every block on its owner)."""
    blocks = per_node if tiers == "dram" else max(per_node // 4, 1)
    dram = {"capacity": max(blocks, 2) * payload, "slab_size": payload}
    sections: dict = {"dram": dram, "eviction": {"policy": policy}, "node": {"lease_ttl_s": 30.0}}
    sections["server"] = {"data_port": port}
    if len(peers) > 1:
        sections["cluster"] = {"peers": peers}
        sections["repair"] = {"enabled": False, "replicas": 1}
        sections["orphans"] = {"interval_s": 1e6, "deadline_s": 120.0}
    if tiers == "dram":
        return common.start_daemon(wd, **sections)
    disk = {"capacity": per_node * (payload + hlen), "sync": False}
    return common.start_daemon(wd, use_disk=True, disk=disk, **sections)


async def _orphan_passes(admins: list[str]) -> int:
    """One orphan pass on each node in turn (node order); the blocks they evicted."""
    import aiohttp

    n = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for admin in admins:
            async with http.post(admin + "/v1/orphans/pass", json={}) as r:
                r.raise_for_status()
                n += (await r.json())["orphans_dropped"]
    return n


async def _replay_daemons(
    reqs, addrs: list[str], admins: list[str], payload: int, speedup: float, every: int
) -> dict:
    from kvstore.client import open as open_store

    ns = trace_namespace()
    chain = ChainKeys(ns)
    # long deadlines, no outlier ejection: on a loaded host a node past the default ones is
    # marked down or ejected, and the replay would measure that rather than eviction
    store = open_store(
        "kvstore://" + ",".join(addrs),
        replicas=1,
        lookahead=0,
        namespaces=(ns,),
        op_timeout_s=120.0,
        write_floor_s=120.0,
        probe_deadline_s=30.0,
        outlier_factor=1e9,
    )
    body = bytes(payload)
    parent_of: dict[bytes, bytes] = {}
    out = {"input_tokens": 0, "hit_tokens": 0, "hits": {"dram": 0, "disk": 0}, "get_miss": 0, "evicted": 0}
    bufs = [bytearray(payload) for _ in range(GET_BATCH)]  # one GET per part, as simulated
    t_start, ts0 = time.monotonic(), reqs[0].timestamp_ms if reqs else 0
    try:
        for n, req in enumerate(reqs):
            if speedup:
                wait = (req.timestamp_ms - ts0) / 1000 / speedup - (time.monotonic() - t_start)
                if wait > 0:
                    await asyncio.sleep(wait)
            raws = chain.keys(req.hash_ids)
            keys = [BlockKey(k) for k in raws]
            out["input_tokens"] += req.input_tokens
            tiers = (await store.lookup(keys)).names() if keys else []
            hit = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
            got = 0
            for start in range(0, hit, len(bufs)):
                part = keys[start : min(hit, start + len(bufs))]
                res = await get_into(store, part, bufs[: len(part)])
                ok = next((i for i, r in enumerate(res) if not r.status.ok), len(res))
                got += ok
                if ok < len(res):
                    out["get_miss"] += 1
                    break
            for t in tiers[:got]:
                out["hits"][t if t == "disk" else "dram"] += 1
            out["hit_tokens"] += got * BLOCK_TOKENS
            parents = [ns.id.raw, *raws[:-1]]
            blocks = []
            for i in range(got, len(keys)):
                parent_of[raws[i]] = parents[i]
                h = make_header(
                    key=keys[i],
                    parent=BlockKey(parents[i]),
                    namespace=ns.id,
                    tokens=[req.hash_ids[i]],
                    dtype="uint8",
                    shape=[payload],
                    payload=body,
                    created=0.0,
                )
                blocks.append((h, body))
            if blocks:
                await store.put(blocks)
            if every and len(addrs) > 1 and (n + 1) % every == 0:
                out["evicted"] += await _orphan_passes(admins)
        stored: set[bytes] = set()
        known = list(parent_of)
        for start in range(0, len(known), 2048):
            part = known[start : start + 2048]
            for k, t in zip(part, (await store.lookup([BlockKey(k) for k in part])).names()):
                if t is not None:
                    stored.add(k)
        out["orphans"] = sum(1 for k in stored if parent_of[k] != ns.id.raw and parent_of[k] not in stored)
        out["stored"] = len(stored)
        out["stats"] = await store.stats()
    finally:
        await store.close()
    return out


def daemon_cell(
    trace: str,
    n_req: int,
    nodes: int,
    tiers: str,
    cap: int,
    policy: str,
    payload: int,
    speedup: float,
    every: int,
):
    """Replay on ``nodes`` real daemons; the simulation of the same requests over the same
    node addresses beside it."""
    reqs = load_trace(trace, n_req)
    ns = trace_namespace()
    sample = make_header(
        key=ns.id, parent=ns.id, namespace=ns.id, tokens=[0], dtype="uint8",
        shape=[payload], payload=bytes(payload), created=0.0,
    )  # fmt: skip
    # every header of the replay has this length (one token of fixed width, the same payload
    # and so the same checksum): the disk holds exactly its share of blocks, as simulated. A
    # slack of 8 bytes a block once gave a disk of 3,005 blocks for 3,000, and this cell's
    # probation share tips over with the capacity (docs/benchmarks.md, "What ran where")
    hlen = len(sample.encode())
    wd = Path(tempfile.mkdtemp(prefix="tierkv-trace-"))
    daemons = []
    try:
        ports = [common.free_port() for _ in range(nodes)]
        peers = [f"127.0.0.1:{p}" for p in ports]
        for i in range(nodes):
            daemons.append(_launch(wd / f"n{i}", cap // nodes, tiers, policy, payload, hlen, ports[i], peers))
        addrs = [d.addr for d in daemons]
        t0 = time.perf_counter()
        got = asyncio.run(_replay_daemons(reqs, addrs, [d.admin for d in daemons], payload, speedup, every))
        secs = time.perf_counter() - t0
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(wd, ignore_errors=True)
    sim = simulate(reqs, nodes, cap, tiers, policy, ids=addrs, sample_every=0, orphan_every=every)
    hits = got["hits"]["dram"] + got["hits"]["disk"]
    ratio = got["hit_tokens"] / got["input_tokens"]
    return {
        **_cell(trace, nodes, tiers, cap, policy),
        "hit_token_ratio": round(ratio, 5),
        "orphan_bytes_ratio": round(got["orphans"] / cap, 5),
        "disk_hit_share": round(got["hits"]["disk"] / hits, 4) if hits else 0.0,
        "orphan_pass_every": every if nodes > 1 else 0,
        "orphans_evicted": got["evicted"],
        "requests": len(reqs),
        "source": "daemons",
        "simulated_hit_token_ratio": round(sim.hit_token_ratio, 5),
        "simulated_orphans_evicted": sim.orphans_evicted,
        "delta_pp": round(100 * (ratio - sim.hit_token_ratio), 3),
        "get_misses": got["get_miss"],
        "seconds": round(secs, 1),
    }


DAEMON_CELLS = [  # (nodes, tiers, capacity, policy): the default against LRU where it matters
    (1, "dram", 3000, "lru"),
    (1, "dram", 3000, DEFAULT_POLICY),
    (3, "dram", 3000, "lru"),
    (3, "dram", 3000, DEFAULT_POLICY),
    (1, "dram+disk", 3000, DEFAULT_POLICY),
    (3, "dram+disk", 3000, DEFAULT_POLICY),
]


# ---------------------------------------------------------------- report


def table(rows: list[dict]) -> str:
    lines = [
        f"{'trace':<13}{'nodes':>6} {'tiers':<10}{'capacity':>9} {'policy':<11}{'pass':>5}{'hit':>8}{'orphan':>8}{'disk':>7}  src"
    ]
    for r in rows:
        cap = "unlim" if r["capacity_blocks"] is None else str(r["capacity_blocks"])
        lines.append(
            f"{r['trace']:<13}{r['nodes']:>6} {r['tiers']:<10}{cap:>9} {r['policy']:<11}{r.get('orphan_pass_every', 0):>5}"
            f"{r['hit_token_ratio']:>8.4f}{r['orphan_bytes_ratio']:>8.4f}{r['disk_hit_share']:>7.3f}  "
            + (
                r["source"]
                if r["source"] == "simulation"
                else f"daemons (sim {r['simulated_hit_token_ratio']:.4f}, {r['delta_pp']:+.2f} pp)"
            )
        )
    return "\n".join(lines)


def _cap(c: int | None) -> str:
    return "unlimited" if c is None else f"{c:,}"


def markdown(rows: list[dict]) -> str:
    """The tables of docs/benchmarks.md's trace section, from the JSON rows."""
    sim = [r for r in rows if r["source"] == "simulation"]
    out: list[str] = []
    for trace in sorted({r["trace"] for r in sim}):
        sel = [r for r in sim if r["trace"] == trace]
        caps = sorted({r["capacity_blocks"] for r in sel if r["capacity_blocks"] is not None}) + [None]
        cell = {
            (r["nodes"], r["tiers"], r["policy"], r.get("orphan_pass_every", 0), r["capacity_blocks"]): r
            for r in sel
        }
        every = max((r.get("orphan_pass_every", 0) for r in sel), default=0)
        out += [f"{trace} trace, hit tokens / input tokens (x LRU at the same capacity):", ""]
        out.append("| config | policy | " + " | ".join(_cap(c) for c in caps) + " |")
        out.append("| --- | --- |" + " --- |" * len(caps))
        for nodes, tiers in [(1, "dram"), (3, "dram"), (1, "dram+disk"), (3, "dram+disk")]:
            ev = every if nodes > 1 else 0
            pols = sorted({r["policy"] for r in sel if (r["nodes"], r["tiers"]) == (nodes, tiers)})
            pols.sort(key=lambda p: (p != "lru", p == DEFAULT_POLICY, p))
            for pol in pols:
                vals = []
                for c in caps:
                    r = cell.get((nodes, tiers, pol, ev if c is not None else 0, c)) or cell.get(
                        (nodes, tiers, pol, ev, c)
                    )
                    lru = cell.get((nodes, tiers, "lru", ev if c is not None else 0, c)) or cell.get(
                        (nodes, tiers, "lru", ev, c)
                    )
                    if r is None:
                        vals.append("")
                        continue
                    v = f"{r['hit_token_ratio']:.4f}"
                    if pol != "lru" and lru and lru["hit_token_ratio"]:
                        v += f" ({r['hit_token_ratio'] / lru['hit_token_ratio']:.2f}x)"
                    if tiers != "dram":
                        v += f" d{r['disk_hit_share']:.2f}"
                    vals.append(v)
                name = f"{pol} (default)" if pol == DEFAULT_POLICY else pol
                where = f"{nodes} node{'s' if nodes > 1 else ''}, {tiers}"
                out.append(f"| {where} | {name} | " + " | ".join(vals) + " |")
        out += [
            "",
            f"{trace}: 3 nodes / 1 node (the mean over the placements; the worst placement in "
            "brackets), orphaned bytes (share of capacity, time average):",
            "",
        ]
        fin = [c for c in caps if c is not None]
        out.append("| tiers | policy | orphan pass | " + " | ".join(_cap(c) for c in fin) + " |")
        out.append("| --- | --- | --- |" + " --- |" * len(fin))
        for tiers in ("dram", "dram+disk"):
            for pol in sorted({r["policy"] for r in sel if r["nodes"] == 3 and r["tiers"] == tiers}):
                for ev in sorted(
                    {r.get("orphan_pass_every", 0) for r in sel if r["nodes"] == 3}, reverse=True
                ):
                    vals = []
                    for c in fin:
                        three, one = cell.get((3, tiers, pol, ev, c)), cell.get((1, tiers, pol, 0, c))
                        if three is None or one is None or not one["hit_token_ratio"]:
                            vals.append("")
                            continue
                        ratio = three["hit_token_ratio"] / one["hit_token_ratio"]
                        draws = three.get("placement_hit_token_ratios", [])
                        worst = f" (min {min(draws) / one['hit_token_ratio']:.3f}x)" if len(draws) > 1 else ""
                        vals.append(f"{ratio:.3f}x{worst}, {100 * three['orphan_bytes_ratio']:.1f} %")
                    if any(vals):
                        label = f"every {ev} requests" if ev else "none"
                        out.append(f"| {tiers} | {pol} | {label} | " + " | ".join(vals) + " |")
        out.append("")
    dae = [r for r in rows if r["source"] == "daemons"]
    if dae:
        out += ["daemons vs simulation (same requests, same node addresses):", ""]
        out.append(
            "| nodes | tiers | capacity | policy | requests | daemons | simulation | delta | orphans evicted "
            "(daemons / sim) | orphaned (end) | disk share | s |"
        )
        out.append("|" + " --- |" * 12)
        for r in dae:
            out.append(
                f"| {r['nodes']} | {r['tiers']} | {_cap(r['capacity_blocks'])} | {r['policy']} | {r['requests']} "
                f"| {r['hit_token_ratio']:.4f} | {r['simulated_hit_token_ratio']:.4f} | {r['delta_pp']:+.2f} pp "
                f"| {r.get('orphans_evicted', 0)} / {r.get('simulated_orphans_evicted', 0)} "
                f"| {100 * r['orphan_bytes_ratio']:.1f} % | {r['disk_hit_share']:.2f} | {r['seconds']} |"
            )
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    traces = sorted({r["trace"] for r in rows})
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.2), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        sel = [r for r in rows if r["trace"] == trace and r["source"] == "simulation"]
        if any(r.get("orphan_pass_every") for r in sel):  # 3 nodes as the daemons run them
            sel = [r for r in sel if r["nodes"] == 1 or r.get("orphan_pass_every")]
        caps = sorted({r["capacity_blocks"] for r in sel if r["capacity_blocks"] is not None})
        series = sorted({(r["nodes"], r["tiers"], r["policy"]) for r in sel})
        for nodes, tiers, pol in series:
            pts = {
                r["capacity_blocks"]: r["hit_token_ratio"]
                for r in sel
                if (r["nodes"], r["tiers"], r["policy"]) == (nodes, tiers, pol)
            }
            ys = [pts.get(c) for c in caps]
            if None in ys or (tiers != "dram"):
                continue
            style = "-" if nodes == 1 else "--"
            ax.plot(caps, ys, style, marker="o", label=f"{pol}, {nodes} node{'s' if nodes > 1 else ''}")
        unl = [r["hit_token_ratio"] for r in sel if r["capacity_blocks"] is None]
        if unl:
            ax.axhline(max(unl), color="grey", lw=0.8, ls=":", label="unlimited")
        ax.set_xscale("log")
        ax.set_xlabel("capacity (blocks of 512 tokens, cluster total)")
        ax.set_ylabel("hit tokens / input tokens")
        ax.set_title(f"{trace} trace, DRAM only")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


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
    load = os.getloadavg()[0]
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
        f"requests: {n_req or 'all'} simulated, {d_req} per daemon cell; load average {load:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    if plot(rows, Path(a.plot)):
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
