"""bench/trace.py's report: the console table, the Markdown tables docs/benchmarks.md quotes
(``python bench/trace.py --markdown``) and the plot, from the rows of its JSON."""

from __future__ import annotations

from pathlib import Path

from kvstore.config import EvictionSection

DEFAULT_POLICY = EvictionSection().policy


def cell_keys(trace: str, nodes: int, tiers: str, cap: int | None, policy: str) -> dict:
    """The keys that name a row's cell (simulated or on daemons)."""
    return {
        "trace": trace,
        "nodes": nodes,
        "tiers": tiers,
        "capacity_blocks": cap,
        "policy": policy,
        "default": policy == DEFAULT_POLICY,
    }


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
