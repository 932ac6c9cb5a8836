"""``kvstore stats``: per node and tier: capacity, used, blocks, hit ratio, evictions,
checksum failures, bytes in/out (from each node's ``GET /v1/stats``)."""

from __future__ import annotations

from kvstore.inspect.context import Context, add_parser, gather_nodes, runner
from kvstore.inspect.output import human_size

STATS_JSON = """{"nodes": [{"node", "name", "hits", "misses", "hit_ratio", "evictions",
  "checksum_failures", "bytes_in", "bytes_out", "pinned", "leases_active",
  "repair": null | {"passes", "blocks_checked", "copies_missing", "copies_pushed", "bytes_pushed",
  "push_failures", "owners_unreachable", "copies_dropped_deleted_elsewhere", ...},
  "orphans": null | {"passes", "blocks_checked", "orphans_found", "orphans_dropped", "orphans_held",
  "owners_unreachable", ..., "bytes": {"<tier>": {"<namespace id hex>": bytes}}},
  "tiers": {"<tier>": {"capacity_bytes", "used_bytes", "blocks", "hits", "hit_ratio", "evictions",
  "checksum_failures", "policy", "hit_tokens", "share_refusals", "orphan_bytes",
  "namespaces": {"<namespace id hex>": bytes}, "tenants": {"<tenant>": bytes}, "ram_bytes",
  "ram_budget_bytes"}},
  "raw": <the node's /v1/stats document>}]}
  (namespaces: a tier's 16 largest, the rest summed in raw's namespaces_other; tenants: bytes
  summed over each tenant's namespaces, the tenant shares' unit; ram_bytes: what the tier's
  index and in-memory headers are charged of the node's node.index_memory, ram_budget_bytes)
  (hits/misses: block reads on the data port; a tier's hit_ratio is its share of all reads;
  hit_ratio is null before the first read)
  (repair, orphans: every tierkv_repair_<name>_total / tierkv_orphans_<name>_total counter of
  the member's pass, by name (docs/cluster.md); repair.copies_missing: copies a pass found
  missing, e.g. of a write acknowledged with fewer than replicas copies; copies_pushed: those
  it restored; orphans: blocks the orphan pass found with no parent in the cluster, and their
  payload bytes per tier and namespace)"""


def register(sub) -> None:
    p = add_parser(
        sub,
        "stats",
        "per node and tier: capacity, used, blocks, hit ratio, evictions, checksum failures, bytes in/out",
        "Usage and counters of every node, one row per tier plus one per node.",
        STATS_JSON,
    )
    p.set_defaults(func=runner("kvstore stats", stats))


def _pass_totals(daemon: dict, kind: str) -> dict | None:
    """A cluster member's totals of its ``kind`` pass (kvstore/member/: every
    ``tierkv_<kind>_<name>_total`` counter without labels, by name), None elsewhere."""
    pre, end = f"tierkv_{kind}_", "_total"
    out = {
        n[len(pre) : -len(end)]: int(v) for n, v in daemon.items() if n.startswith(pre) and n.endswith(end)
    }
    return out or None


_ORPHAN_BYTES = "tierkv_orphans_found_bytes_total{"


def _orphans(daemon: dict) -> dict | None:
    """The orphan pass's totals and ``bytes``: orphans' payload bytes found, per tier and
    namespace hex."""
    out = _pass_totals(daemon, "orphans")
    if out is None:
        return None
    per: dict[str, dict[str, int]] = {}
    for name, v in daemon.items():
        if name.startswith(_ORPHAN_BYTES):
            labels = dict(x.split("=", 1) for x in name[len(_ORPHAN_BYTES) : -1].split(","))
            per.setdefault(labels.get("tier", ""), {})[labels.get("namespace", "")] = int(v)
    out["bytes"] = per
    return out


def _ratio(n: float, total: float) -> float | None:
    return round(n / total, 4) if total else None


def summarize(url: str, raw: dict) -> dict:
    """The stable per-node summary of one ``/v1/stats`` document."""
    node, daemon = raw.get("node", {}), raw.get("daemon", {})
    hits = int(daemon.get("tierkv_hits_total", 0))
    misses = int(daemon.get("tierkv_misses_total", 0))
    tiers = {}
    for name, t in raw.get("tiers", {}).items():
        th = int(node.get(f"hits_{name}", 0))
        tiers[name] = {
            "capacity_bytes": t.get("capacity_bytes"),
            "used_bytes": t.get("used_bytes"),
            "waste_bytes": t.get("waste_bytes"),
            "blocks": t.get("blocks"),
            "hits": th,
            "hit_ratio": _ratio(th, hits + misses),
            "evictions": t.get("evictions", 0),
            "checksum_failures": t.get("checksum_failures", 0),
            # eviction and tenant shares (docs/storage.md "Eviction")
            "policy": t.get("policy"),
            "hit_tokens": int(node.get(f"hit_tokens_{name}", 0)),
            "share_refusals": t.get("share_refusals", 0),
            "orphan_bytes": t.get("orphan_bytes", 0),
            "namespaces": t.get("namespaces", {}),  # the largest ones (the rest summed)
            "tenants": t.get("tenants", {}),
            # the RAM its blocks' index and headers are charged (node.index_memory, every tier)
            "ram_bytes": t.get("ram_bytes", 0),
            "ram_budget_bytes": t.get("ram_budget_bytes", 0),
        }
    return {
        "node": url,
        "name": node.get("name"),
        "hits": hits,
        "misses": misses,
        "hit_ratio": _ratio(hits, hits + misses),
        "evictions": sum(t["evictions"] for t in tiers.values()),
        "checksum_failures": int(node.get("checksum_failures", 0))
        + int(daemon.get("tierkv_checksum_failures_total", 0)),
        "bytes_in": int(daemon.get("tierkv_bytes_in_total", 0)),
        "bytes_out": int(daemon.get("tierkv_bytes_out_total", 0)),
        "pinned": node.get("pinned", 0),
        "leases_active": node.get("leases_active", 0),
        "repair": _pass_totals(daemon, "repair"),
        "orphans": _orphans(daemon),
        "tiers": tiers,
        "raw": raw,
    }


def _eviction_table(ctx: Context, nodes: list[dict]) -> None:
    """Per node and tier: the eviction policy, hit tokens, share refusals, orphaned bytes and
    the bytes of each tenant (summed over its namespaces: the shares' unit)."""
    from kvstore.inspect.cmd_blocks import node_label

    cols = ["NODE", "TIER", "POLICY", "HIT TOKENS", "SHARE REFUSED", "ORPHANED", "INDEX RAM", "TENANTS"]
    rows = [
        [
            node_label(s["node"]),
            name,
            str(t["policy"] or "-"),
            str(t["hit_tokens"]),
            str(t["share_refusals"]),
            human_size(t["orphan_bytes"]),
            f"{human_size(t['ram_bytes'])}/{human_size(t['ram_budget_bytes'])}",
            " ".join(f"{ten or '-'}:{human_size(b)}" for ten, b in sorted(t["tenants"].items())) or "-",
        ]
        for s in nodes
        for name, t in s["tiers"].items()
    ]
    ctx.out.table("eviction", cols, rows, right={"HIT TOKENS", "SHARE REFUSED", "ORPHANED", "INDEX RAM"})


def _pct(r: float | None) -> str:
    return "-" if r is None else f"{100 * r:.1f}%"


async def stats(ctx: Context) -> int:
    from kvstore.inspect.cmd_blocks import node_label

    raws = await gather_nodes(ctx, lambda n: n.call("GET", "/v1/stats"))
    nodes = [summarize(n.url, r) for n, r in zip(ctx.nodes, raws)]
    if ctx.out.as_json:
        ctx.out.json({"nodes": nodes})
        return 0
    rows = []
    for s in nodes:
        label = f"{node_label(s['node'])} ({s['name']})"
        for name, t in s["tiers"].items():
            cap, used = t["capacity_bytes"] or 0, t["used_bytes"] or 0
            rows.append(
                [
                    label,
                    name,
                    human_size(cap),
                    human_size(used),
                    f"{100 * used / cap:.1f}%" if cap else "-",
                    human_size(t["waste_bytes"]) if t["waste_bytes"] is not None else "-",
                    str(t["blocks"]),
                    _pct(t["hit_ratio"]),
                    str(t["evictions"]),
                    str(t["checksum_failures"]),
                    "",
                    "",
                ]
            )
        rows.append(
            [
                label,
                "[bold]all[/bold]",
                "",
                "",
                "",
                "",
                "",
                _pct(s["hit_ratio"])
                + (f" of {s['hits'] + s['misses']}" if s["hit_ratio"] is not None else ""),
                str(s["evictions"]),
                str(s["checksum_failures"]),
                human_size(s["bytes_in"]),
                human_size(s["bytes_out"]),
            ]
        )
    cols = [
        "NODE",
        "TIER",
        "CAPACITY",
        "USED",
        "USE%",
        "WASTE",
        "BLOCKS",
        "HIT RATIO",
        "EVICTIONS",
        "CSUM FAIL",
        "IN",
        "OUT",
    ]
    ctx.out.table(None, cols, rows, right=set(cols[2:]))
    _eviction_table(ctx, nodes)
    repairs = [(s, s["repair"]) for s in nodes if s["repair"] is not None]
    if repairs:  # cluster members: how far anti-entropy got (copies missing vs pushed)
        rcols = [
            "NODE",
            "PASSES",
            "CHECKED",
            "MISSING",
            "PUSHED",
            "BYTES",
            "FAILED",
            "UNREACHABLE",
            "DROPPED (DELETED ELSEWHERE)",
        ]
        rrows = [
            [
                node_label(s["node"]),
                str(r["passes"]),
                str(r["blocks_checked"]),
                str(r["copies_missing"]),
                str(r["copies_pushed"]),
                human_size(r["bytes_pushed"]),
                str(r["push_failures"]),
                str(r["owners_unreachable"]),
                str(r["copies_dropped_deleted_elsewhere"]),
            ]
            for s, r in repairs
        ]
        ctx.out.table("repair", rcols, rrows, right=set(rcols[1:]))
    return 0
