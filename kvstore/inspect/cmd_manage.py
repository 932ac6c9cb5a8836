"""``kvstore evict KEY | --namespace N``, ``kvstore pin KEY`` and ``kvstore unpin KEY``: act
on every node that holds the block (exit 1 when none does). ``evict`` reports per node what it
deleted and which nodes it could not reach (exit 2 then, after that report)."""

from __future__ import annotations

import asyncio

from kvstore.inspect.admin_client import AdminClient, NodeError, UsageError
from kvstore.inspect.cmd_blocks import parse_key
from kvstore.inspect.context import Context, add_parser, gather_nodes, runner

EVICT_JSON = """{"key": hex|null, "namespace": hex|null, "deleted": int,
  "nodes": [{"node", "deleted": int|null, "error": str|null}], "unreachable": [url]}
  (exit 2 after the report when a node was not reached)"""
PIN_JSON = """{"key", "pinned": bool, "nodes": [{"node", "done": bool}]}
  (done: the node held the block and changed its pin; for unpin, the block was pinned there)"""


def register(sub) -> None:
    p = add_parser(
        sub,
        "evict",
        "delete one block, or every block of a namespace, from every node and tier",
        "Delete a block (KEY) or all blocks of a namespace (--namespace N) from every tier of\n"
        "every node. A block being read is freed when its last lease ends.",
        EVICT_JSON,
    )
    p.add_argument("key", nargs="?", metavar="KEY", help="the block key (32 hex digits)")
    p.add_argument("--namespace", metavar="HEX", help="evict every block of this namespace id instead")
    p.set_defaults(func=runner("kvstore evict", evict))
    for name, doc in (
        ("pin", "exempt a block from eviction on every node that holds it"),
        ("unpin", "make a pinned block evictable again"),
    ):
        p = add_parser(sub, name, doc, doc[0].upper() + doc[1:] + ".", PIN_JSON)
        p.add_argument("key", metavar="KEY", help="the block key (32 hex digits)")
        p.set_defaults(func=runner(f"kvstore {name}", pin if name == "pin" else unpin))


async def _evict_key(node: AdminClient, key: str) -> int:
    r = await node.call("DELETE", f"/v1/blocks/{key}", absent_ok=True)
    return 0 if r is None else 1


async def _evict_ns(node: AdminClient, ns: str) -> int:
    return int((await node.call("POST", "/v1/evict", body={"namespace": ns}))["deleted"])


async def evict(ctx: Context) -> int:
    """Every node is asked; one that cannot be reached does not stop the others. The report
    names, per node, what it deleted or why it was not reached; the exit status is 2 when a
    node was not reached (after the whole report), 1 when a KEY is stored nowhere, else 0."""
    a = ctx.args
    if (a.key is None) == (a.namespace is None):
        raise UsageError("give exactly one of KEY or --namespace N")
    key = parse_key(a.key) if a.key else None
    ns = parse_key(a.namespace, "--namespace") if a.namespace else None

    async def one(n: AdminClient) -> int | NodeError:
        try:
            return await (_evict_key(n, key) if key else _evict_ns(n, ns))
        except NodeError as exc:  # reported with the others, below
            return exc

    got = await asyncio.gather(*(one(n) for n in ctx.nodes))
    counts = [c if isinstance(c, int) else None for c in got]
    failed = [(n, c) for n, c in zip(ctx.nodes, got) if isinstance(c, NodeError)]
    total = sum(c for c in counts if c)
    if ctx.out.as_json:
        ctx.out.json(
            {
                "key": key,
                "namespace": ns,
                "deleted": total,
                "nodes": [
                    {"node": n.url, "deleted": k, "error": None if isinstance(c, int) else c.what}
                    for n, c, k in zip(ctx.nodes, got, counts)
                ],
                "unreachable": [n.url for n, _ in failed],
            }
        )
    what = f"block {key}" if key else f"namespace {ns}"
    if not ctx.out.as_json:
        for n, c in zip(ctx.nodes, got):
            line = f"deleted {c} block(s)" if isinstance(c, int) else f"NOT REACHED: {c.what}"
            ctx.out.print(f"  {n.url}: {line}", markup=False)
        reached = len(ctx.nodes) - len(failed)
        n_nodes = sum(1 for c in counts if c)
        ctx.out.print(
            f"evicted {what}: {total} block(s) deleted on {n_nodes} of {reached} reached node(s)",
            markup=False,
        )
    if failed:
        ctx.out.err.print(
            f"kvstore evict: {len(failed)} node(s) not reached: {', '.join(n.url for n, _ in failed)}; "
            "a cluster member that comes back drops its copies when its repair meets the deleting "
            "nodes' tombstones (docs/cluster.md); run evict again on it to be sure",
            markup=False,
        )
        return 2
    if key and not total:
        ctx.out.err.print(f"kvstore evict: {what} is not stored on any node (or is leased)", markup=False)
        return 1
    return 0


async def _pin_one(node: AdminClient, key: str, method: str) -> bool:
    return await node.call(method, f"/v1/blocks/{key}/pin", absent_ok=True) is not None


async def _pin(ctx: Context, method: str) -> int:
    key = parse_key(ctx.args.key)
    done = await gather_nodes(ctx, lambda n: _pin_one(n, key, method))
    pinned = method == "POST"
    verb = "pinned" if pinned else "unpinned"
    if ctx.out.as_json:
        ctx.out.json(
            {
                "key": key,
                "pinned": pinned,
                "nodes": [{"node": n.url, "done": d} for n, d in zip(ctx.nodes, done)],
            }
        )
    if not any(done):
        what = "is not stored on any node" if pinned else "is not pinned on any node"
        ctx.out.err.print(f"kvstore {'pin' if pinned else 'unpin'}: block {key} {what}", markup=False)
        return 1
    if not ctx.out.as_json:
        ctx.out.print(f"{verb} {key} on {sum(done)} node(s)")
    return 0


async def pin(ctx: Context) -> int:
    return await _pin(ctx, "POST")


async def unpin(ctx: Context) -> int:
    return await _pin(ctx, "DELETE")
