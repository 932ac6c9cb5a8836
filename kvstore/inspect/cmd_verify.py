"""``kvstore verify [--repair]``: re-check the checksum of every copy of every block on each
node's tiers, page by page with a progress bar (on a terminal); ``--repair`` drops bad copies."""

from __future__ import annotations

from kvstore.inspect.admin_client import AdminClient, UsageError
from kvstore.inspect.context import Context, add_parser, runner

VERIFY_JSON = """{"repair": bool, "checked": int, "corrupt": int, "dropped": int,
  "nodes": [{"node", "checked", "dropped", "corrupt": [{"key", "tier"}]}]}
  (checked counts copies: a block in dram and on disk is two)"""


def register(sub) -> None:
    p = add_parser(
        sub,
        "verify",
        "re-check the checksums of every block copy on the nodes' tiers; --repair drops bad copies",
        "Read every copy of every block on each node (every tier) and check its checksum now.\n"
        "With --repair the corrupt copies are dropped (a copy being read is left alone).\n"
        "Exit status 1 when corrupt copies were found and remain (none dropped or not --repair).",
        VERIFY_JSON,
    )
    p.add_argument("--repair", action="store_true", help="drop the corrupt copies")
    p.add_argument("--batch", type=int, default=256, metavar="N", help="blocks per request (default 256)")
    p.set_defaults(func=runner("kvstore verify", verify))


async def _verify_node(node: AdminClient, repair: bool, batch: int, progress, task) -> dict:
    res = {"node": node.url, "checked": 0, "dropped": 0, "corrupt": []}
    after = None
    while True:
        r = await node.call("POST", "/v1/verify", body={"after": after, "limit": batch, "repair": repair})
        res["checked"] += r["checked"]
        res["dropped"] += r["dropped"]
        for c in r["corrupt"]:
            key, _, tier = c.rpartition("@")
            res["corrupt"].append({"key": key, "tier": tier})
        if progress is not None:
            progress.update(task, total=r["total"], advance=r["keys"])
        after = r.get("next")
        if not after:
            return res


async def verify(ctx: Context) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    a = ctx.args
    if not 1 <= a.batch <= 10000:
        raise UsageError(f"--batch {a.batch}: must be in [1, 10000]")
    show = ctx.out.err.is_terminal
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=ctx.out.err,
        disable=not show,
        transient=True,
    )
    results = []
    with progress:
        for node in ctx.nodes:  # one node at a time: the bar shows a steady rate
            task = progress.add_task(f"verify {node.url}", total=None)
            results.append(await _verify_node(node, a.repair, a.batch, progress, task))
    checked = sum(r["checked"] for r in results)
    corrupt = sum(len(r["corrupt"]) for r in results)
    dropped = sum(r["dropped"] for r in results)
    if ctx.out.as_json:
        ctx.out.json(
            {"repair": a.repair, "checked": checked, "corrupt": corrupt, "dropped": dropped, "nodes": results}
        )
    else:
        from kvstore.inspect.cmd_blocks import node_label

        rows = [
            [node_label(r["node"]), c["key"], c["tier"], "dropped" if a.repair else "[red]corrupt[/red]"]
            for r in results
            for c in r["corrupt"]
        ]
        if rows:
            ctx.out.table("corrupt copies", ["NODE", "KEY", "TIER", "ACTION"], rows)
        ctx.out.print(
            f"checked {checked} cop{'y' if checked == 1 else 'ies'} on {len(results)} node(s): "
            f"{corrupt} corrupt, {dropped} dropped"
        )
    return 1 if corrupt > dropped else 0
