"""``kvstore lookup``: why does a prompt hit or miss? Tokenize like the engine, compute the
block keys in the engine's namespace, ask every node which blocks it holds, and estimate
load time against prefill time for the cached prefix."""

from __future__ import annotations

from kvstore.inspect.admin_client import AdminClient, UsageError
from kvstore.inspect.context import Context, add_parser, gather_nodes, runner

_TIER_ORDER = {"hbm": 0, "dram": 1, "disk": 2}
_CHUNK = 10000

LOOKUP_JSON = """{"model", "namespace", "num_tokens", "block_tokens",
  "blocks": [{"index", "start", "end", "key", "hit", "tier", "nodes": [{"node", "tier", "tiers"}]}],
  "summary": {"total_tokens", "hit_tokens", "hit_blocks", "prefix_hit_blocks", "first_miss",
  "tail_tokens", "est_load_s", "est_prefill_s", "est_prefill_full_s", "est_with_cache_s", "reason"}}
  (hit_tokens counts the cached prefix only: blocks after the first miss cannot be used)"""


def register(sub) -> None:
    p = add_parser(
        sub,
        "lookup",
        "which blocks of a prompt are cached, where, and the estimated load vs prefill time",
        "Tokenize a prompt the way the engine does (tokenizer.json of --model DIR), compute its\n"
        "block keys in the engine's namespace, and ask every node which blocks it holds. Prints\n"
        "one row per full block, then the cached prefix, estimated load time against estimated\n"
        "prefill time, and why the first miss missed. Exit status 0 whether or not it hits.",
        LOOKUP_JSON,
    )
    p.add_argument("--model", required=True, metavar="DIR", help="the model folder the engine serves")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("text", nargs="?", metavar="TEXT", help="the prompt text")
    src.add_argument("--file", metavar="F", help="read the prompt text from file F")
    src.add_argument("--tokens-json", metavar="F", help='token ids from F: a JSON list or {"tokens": [...]}')
    p.add_argument("--chat", action="store_true", help="the text is one user message of a chat request")
    p.add_argument("--dtype", default="float32", help="KV dtype of the engine (default float32, as on CPU)")
    p.add_argument("--block-tokens", type=int, default=16, metavar="N", help="tokens per block (default 16)")
    p.add_argument("--tp-size", type=int, default=1, metavar="N", help="tensor-parallel size (default 1)")
    p.add_argument("--tp-rank", type=int, default=0, metavar="R", help="tensor-parallel rank (default 0)")
    p.add_argument("--tenant", default="", help="tenant whose salted namespace the engine uses")
    p.add_argument(
        "--salt-secret-file",
        default="",
        metavar="F",
        help="the daemons' auth.salt_secret_file: derive --tenant's salt as they do",
    )
    p.add_argument(
        "--layout",
        default="LKTHD",
        help="the engine's KV payload layout, as it logs it at start (event=kv_cache layout=...); "
        "LKTHD unless it runs with --kv-cache-dtype",
    )
    p.add_argument(
        "--prefill-tps", type=float, default=2000.0, metavar="TPS", help="prefill tokens/s (default 2000)"
    )
    p.add_argument("--load-gbps", type=float, default=1.0, metavar="GBPS", help="load GB/s (default 1)")
    p.add_argument(
        "--load-latency-ms",
        type=float,
        default=0.5,
        metavar="MS",
        help="per-block load latency (default 0.5)",
    )
    p.set_defaults(func=runner("kvstore lookup", lookup))


def _tokens(a) -> list[int]:
    from kvstore.inspect.prompt import prompt_tokens, tokens_from_json

    if a.tokens_json:
        return tokens_from_json(a.tokens_json)
    text = a.text
    if a.file:
        try:
            with open(a.file, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise UsageError(f"--file {a.file}: cannot read it: {exc.strerror}") from exc
    return prompt_tokens(a.model, text, a.chat)


async def _ask(node: AdminClient, keys: list[str]) -> list[dict]:
    rows: list[dict] = []
    for off in range(0, len(keys), _CHUNK):
        page = await node.call("POST", "/v1/lookup", body={"keys": keys[off : off + _CHUNK]})
        rows.extend(page["blocks"])
    return rows


async def _node_holds_namespace(node: AdminClient, ns: str) -> bool:
    """Whether ``node`` stores a block of ``ns``: its listing followed until one block or its
    end (a filtered page may be empty and not be the last)."""
    params = {"namespace": ns, "limit": "1"}
    while True:
        page = await node.call("GET", "/v1/blocks", params=params)
        if page["blocks"]:
            return True
        if page.get("next") is None:
            return False
        params = {**params, "after": page["next"]}


async def _namespace_seen(ctx: Context, ns: str) -> bool:
    return any(await gather_nodes(ctx, lambda n: _node_holds_namespace(n, ns)))


async def lookup(ctx: Context) -> int:
    from kvstore.inspect.prompt import block_bytes, engine_namespace
    from kvstore.keys import block_spans

    a = ctx.args
    for name in ("prefill_tps", "load_gbps", "block_tokens"):
        if not getattr(a, name) > 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(a, name)}: must be > 0")
    tokens = _tokens(a)
    ns = engine_namespace(
        a.model, a.dtype, a.block_tokens, a.tp_size, a.tp_rank, a.tenant, a.layout, a.salt_secret_file
    )
    keys = [k.hex for k in ns.block_keys(tokens)]
    spans = block_spans(len(tokens), a.block_tokens)
    per_node = await gather_nodes(ctx, lambda n: _ask(n, keys))
    est_bytes = block_bytes(a.model, a.dtype, a.block_tokens, a.tp_size, a.layout)
    blocks = []
    for i, (key, (s, e)) in enumerate(zip(keys, spans)):
        holders = [
            {
                "node": n.url,
                "tier": rows[i]["tier"],
                "tiers": rows[i]["tiers"],
                "bytes": rows[i]["payload_len"],
            }
            for n, rows in zip(ctx.nodes, per_node)
            if rows[i]["tier"] is not None
        ]
        best = min((h["tier"] for h in holders), key=lambda t: _TIER_ORDER.get(t, 9), default=None)
        blocks.append(
            {
                "index": i,
                "start": s,
                "end": e,
                "key": key,
                "hit": bool(holders),
                "tier": best,
                "nodes": holders,
            }
        )
    summary = _summary(a, tokens, blocks, est_bytes)
    if summary["hit_blocks"] == 0 and blocks and not await _namespace_seen(ctx, ns.id.hex):
        summary["reason"] = (
            f"no node holds any block of namespace {ns.id.hex}: nothing was saved for this model yet, or the "
            "engine used another model folder, --dtype, --layout, --block-tokens, --tp-size, --tenant or "
            "--salt-secret-file"
        )
    for b in blocks:
        for h in b["nodes"]:
            h.pop("bytes")
    doc = {
        "model": a.model,
        "namespace": ns.id.hex,
        "num_tokens": len(tokens),
        "block_tokens": a.block_tokens,
        "blocks": blocks,
        "summary": summary,
    }
    if ctx.out.as_json:
        ctx.out.json(doc)
    else:
        _print(ctx, doc)
    return 0


def _summary(a, tokens: list[int], blocks: list[dict], est_bytes: int | None) -> dict:
    bt = a.block_tokens
    first_miss = next((b["index"] for b in blocks if not b["hit"]), None)
    prefix = len(blocks) if first_miss is None else first_miss
    lat, bw = a.load_latency_ms / 1000.0, a.load_gbps * 1e9
    load_s = 0.0
    for b in blocks[:prefix]:
        nbytes = max((h["bytes"] or 0) for h in b["nodes"]) or est_bytes or 0
        load_s += lat + nbytes / bw
    hit_tokens = prefix * bt
    tail = len(tokens) - len(blocks) * bt
    if not blocks:
        reason = f"the prompt has {len(tokens)} tokens, fewer than one block ({bt}): nothing is cached"
    elif first_miss is None:
        reason = "every full block is cached"
    else:
        b = blocks[first_miss]
        reason = (
            f"block {first_miss} (tokens {b['start']}-{b['end'] - 1}) is on no node; the prefix ends there"
        )
    if tail and blocks:
        reason += f"; the last {tail} tokens do not fill a block and are always computed"
    return {
        "total_tokens": len(tokens),
        "hit_tokens": hit_tokens,
        "hit_blocks": sum(b["hit"] for b in blocks),
        "prefix_hit_blocks": prefix,
        "first_miss": first_miss,
        "tail_tokens": tail,
        "est_load_s": load_s,
        "est_prefill_s": hit_tokens / a.prefill_tps,
        "est_prefill_full_s": len(tokens) / a.prefill_tps,
        "est_with_cache_s": load_s + (len(tokens) - hit_tokens) / a.prefill_tps,
        "reason": reason,
    }


def _print(ctx: Context, doc: dict) -> None:
    from kvstore.inspect.cmd_blocks import node_label

    rows = [
        [
            str(b["index"]),
            f"{b['start']}-{b['end'] - 1}",
            b["key"],
            "[green]hit[/green]" if b["hit"] else "[red]miss[/red]",
            ",".join(node_label(h["node"]) for h in b["nodes"]) or "-",
            b["tier"] or "-",
        ]
        for b in doc["blocks"]
    ]
    ctx.out.print(
        f"namespace {doc['namespace']}  ({doc['num_tokens']} tokens, {doc['block_tokens']} per block)"
    )
    ctx.out.table(None, ["#", "TOKENS", "KEY", "HIT", "NODES", "TIER"], rows, right={"#"})
    s = doc["summary"]
    pct = 100.0 * s["hit_tokens"] / s["total_tokens"] if s["total_tokens"] else 0.0
    ctx.out.print(
        f"hit {s['hit_tokens']}/{s['total_tokens']} tokens ({pct:.0f}%): "
        f"{s['prefix_hit_blocks']} cached prefix block(s), {s['hit_blocks']} block(s) cached in all"
    )
    ctx.out.print(
        f"estimated load {s['est_load_s'] * 1000:.2f} ms vs prefill of the same tokens "
        f"{s['est_prefill_s'] * 1000:.2f} ms; whole prompt {s['est_with_cache_s'] * 1000:.2f} ms "
        f"with the cache, {s['est_prefill_full_s'] * 1000:.2f} ms without"
    )
    ctx.out.print(f"why: {s['reason']}", markup=False)
