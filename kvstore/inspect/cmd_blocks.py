"""``kvstore ls`` (what is cached, where) and ``kvstore show KEY`` (one block in full)."""

from __future__ import annotations

import time

from kvstore.errors import KeyFormatError
from kvstore.inspect.admin_client import AdminClient, UsageError
from kvstore.inspect.context import Context, add_parser, gather_nodes, runner
from kvstore.inspect.output import ago, human_size, short

_PAGE = 10000
LS_FIELDS = (
    "key",
    "namespace",
    "num_tokens",
    "payload_len",
    "tiers",
    "created",
    "last_access",
    "leases",
    "pinned",
)

LS_JSON = """{"blocks": [{"key", "namespace", "num_tokens", "payload_len", "tiers": [..],
  "node", "created", "last_access", "leases", "pinned"}], "count": N, "truncated": bool}
  (blocks in key order, then node order; times are epoch seconds)"""
SHOW_JSON = """{"key", "found": bool, "namespace", "num_tokens", "payload_len",
  "header": {"parent", "dtype", "shape", "checksum", "version"},
  "kv": {"layout", "dtype", "layers", "kv_heads", "head_dim"|null, "scales": {"dtype", "per",
  "count", "bytes"}|null, "bf16_bytes", "ratio_to_bf16"}|null, "tokens": [ids], "text": str|null,
  "replicas": [{"node", "tiers", "checksum_ok", "corrupt_tiers", "pinned", "leases", "created",
  "last_access"}]}"""


_ITEM = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def kv_layout(dtype: str, shape: list[int], num_tokens: int) -> dict | None:
    """What an engine's KV block payload holds, read from its header (None for a payload that
    is not one): ``[layers, 2, tokens, kv_heads, head_dim]`` (``LKTHD``, no scales), or fp8's
    ``[layers, 2, kv_heads, tokens * head_dim + 4]`` (``LKH(TD+f32scale)``: each head's bytes,
    then its fp32 scale), with the bytes a bf16 block of the same shape would take."""
    item = _ITEM.get(dtype)
    if item is None or num_tokens < 1:
        return None
    if len(shape) == 5 and shape[1] == 2 and shape[2] == num_tokens:
        layers, _, _, heads, hd = shape
        scales = None
    elif item == 1 and len(shape) == 4 and shape[1] == 2 and (shape[3] - 4) % num_tokens == 0:
        layers, _, heads, row = shape
        hd = (row - 4) // num_tokens
        n = layers * 2 * heads
        scales = {"dtype": "float32", "per": "layer, k/v, kv head", "count": n, "bytes": 4 * n}
    else:
        return None
    bf16 = layers * 2 * num_tokens * heads * hd * 2
    own = layers * 2 * num_tokens * heads * hd * item + (scales["bytes"] if scales else 0)
    return {
        "layout": "LKH(TD+f32scale)" if scales else "LKTHD",
        "dtype": dtype,
        "layers": layers,
        "kv_heads": heads,
        "head_dim": hd,
        "scales": scales,
        "bf16_bytes": bf16,
        "ratio_to_bf16": round(own / bf16, 4) if bf16 else None,
    }


def node_label(url: str) -> str:
    return url.split("://", 1)[-1]


def parse_key(text: str, what: str = "KEY") -> str:
    from kvstore.keys import BlockKey

    try:
        return BlockKey.from_hex(text.strip()).hex
    except KeyFormatError as exc:
        raise UsageError(f"{what} {text!r}: expected a 32-hex-digit block key ({exc})") from exc


def register(sub) -> None:
    p = add_parser(
        sub,
        "ls",
        "list cached blocks: key, namespace, tokens, size, tier, node, age, last access, pin/lease",
        "List the blocks stored on the nodes, in key order, merged over every --node.",
        LS_JSON,
    )
    p.add_argument("--tier", choices=["hbm", "dram", "disk"], help="only blocks held by this tier")
    p.add_argument(
        "--namespace", metavar="HEX", help="only blocks of this namespace id (see `show`, `lookup`)"
    )
    p.add_argument("--limit", type=int, default=100, metavar="K", help="at most K blocks (default 100)")
    p.set_defaults(func=runner("kvstore ls", ls))

    p = add_parser(
        sub,
        "show",
        "one block in full: header, replicas and tiers, checksum verified now, token ids (and text)",
        "Show a block: its header, every replica (node and tiers), whether each copy's checksum\n"
        "verifies now, and its token ids; with --tokenizer DIR also their text.",
        SHOW_JSON,
    )
    p.add_argument("key", metavar="KEY", help="the block key (32 hex digits)")
    p.add_argument("--tokenizer", metavar="DIR", help="model folder whose tokenizer.json decodes the tokens")
    p.set_defaults(func=runner("kvstore show", show))


async def _list_node(node: AdminClient, params: dict[str, str], limit: int) -> tuple[list[dict], bool]:
    out: list[dict] = []
    after = None
    while len(out) < limit:
        q = dict(params, limit=str(min(_PAGE, limit - len(out))))
        if after:
            q["after"] = after
        page = await node.call("GET", "/v1/blocks", params=q)
        for b in page["blocks"]:
            out.append({**{k: b.get(k) for k in LS_FIELDS}, "node": node.url})
        after = page.get("next")
        if not after:
            return out, False
    return out, True


async def ls(ctx: Context) -> int:
    a = ctx.args
    if a.limit < 1:
        raise UsageError(f"--limit {a.limit}: must be >= 1")
    params: dict[str, str] = {}
    if a.tier:
        params["tier"] = a.tier
    if a.namespace:
        params["namespace"] = parse_key(a.namespace, "--namespace")
    got = await gather_nodes(ctx, lambda n: _list_node(n, params, a.limit + 1))
    blocks = sorted((b for bs, _ in got for b in bs), key=lambda b: (b["key"], b["node"]))
    truncated = len(blocks) > a.limit or any(more for _, more in got)
    blocks = blocks[: a.limit]
    if ctx.out.as_json:
        ctx.out.json({"blocks": blocks, "count": len(blocks), "truncated": truncated})
        return 0
    now = time.time()
    rows = [
        [
            b["key"],
            short(b["namespace"]),
            b["num_tokens"],
            human_size(b["payload_len"]),
            ",".join(b["tiers"]),
            node_label(b["node"]),
            ago(b["created"], now),
            ago(max(b["last_access"], b["created"]), now),
            _state(b),
        ]
        for b in blocks
    ]
    cols = ["KEY", "NAMESPACE", "TOKENS", "SIZE", "TIER", "NODE", "AGE", "ACCESSED", "STATE"]
    ctx.out.table(None, cols, rows, right={"TOKENS", "SIZE", "AGE", "ACCESSED"})
    more = " (more: raise --limit)" if truncated else ""
    ctx.out.print(f"{len(blocks)} block(s) on {len(ctx.nodes)} node(s){more}")
    return 0


def _state(b: dict) -> str:
    parts = (["pinned"] if b["pinned"] else []) + ([f"leased×{b['leases']}"] if b["leases"] else [])
    return ",".join(parts) or "-"


async def _show_node(node: AdminClient, key: str) -> dict | None:
    d = await node.call("GET", f"/v1/blocks/{key}", absent_ok=True)
    if d is None:
        return None
    v = await node.call("POST", "/v1/verify", body={"keys": [key], "repair": False})
    bad = [c.rsplit("@", 1)[1] for c in v["corrupt"] if c.startswith(key)]
    return {**d, "node": node.url, "corrupt_tiers": bad, "checksum_ok": not bad}


async def show(ctx: Context) -> int:
    a = ctx.args
    key = parse_key(a.key)
    decode = None
    if a.tokenizer:
        from kvstore.inspect.prompt import load_tokenizer

        decode = load_tokenizer(a.tokenizer).decode
    found = [r for r in await gather_nodes(ctx, lambda n: _show_node(n, key)) if r is not None]
    if not found:
        where = ", ".join(n.url for n in ctx.nodes)
        if ctx.out.as_json:
            ctx.out.json({"key": key, "found": False, "replicas": []})
        ctx.out.err.print(f"kvstore show: block {key} is not stored on any node ({where})", markup=False)
        return 1
    first = found[0]
    hdr = {k: first["header"].get(k) for k in ("parent", "dtype", "shape", "checksum", "version")}
    tokens = first["header"]["tokens"]
    text = decode(tokens, skip_special_tokens=False) if decode else None
    replicas = [
        {
            k: r[k]
            for k in (
                "node",
                "tiers",
                "checksum_ok",
                "corrupt_tiers",
                "pinned",
                "leases",
                "created",
                "last_access",
            )
        }
        for r in found
    ]
    doc = {
        "key": key,
        "found": True,
        "namespace": first["namespace"],
        "num_tokens": first["num_tokens"],
        "payload_len": first["payload_len"],
        "header": hdr,
        "kv": kv_layout(hdr["dtype"], list(hdr["shape"] or []), first["num_tokens"]),
        "tokens": tokens,
        "text": text,
        "replicas": replicas,
    }
    if ctx.out.as_json:
        ctx.out.json(doc)
        return 0
    _print_show(ctx, doc)
    return 0


def _kv_rows(kv: dict | None) -> list[list[str]]:
    if kv is None:
        return []
    shape = f"{kv['layers']} layers x K/V x {kv['kv_heads']} KV heads x head_dim {kv['head_dim']}"
    sc = kv["scales"]
    scales = (
        f"{sc['count']} {sc['dtype']} ({sc['per']}), {sc['bytes']} bytes in the payload" if sc else "none"
    )
    return [
        ["KV layout", f"{kv['layout']}: {shape}"],
        ["KV scales", scales],
        ["vs bf16", f"{kv['ratio_to_bf16']}x of {human_size(kv['bf16_bytes'])}"],
    ]


def _print_show(ctx: Context, doc: dict) -> None:
    h = doc["header"]
    fields = [
        ["key", doc["key"]],
        ["parent", h["parent"]],
        ["namespace", doc["namespace"]],
        ["tokens", str(doc["num_tokens"])],
        ["payload", f"{human_size(doc['payload_len'])} ({doc['payload_len']} bytes)"],
        ["dtype / shape", f"{h['dtype']} {h['shape']}"],
        *_kv_rows(doc["kv"]),
        ["checksum", f"xxh3_64 {h['checksum']}"],
        ["format version", str(h["version"])],
    ]
    ctx.out.table(None, ["FIELD", "VALUE"], fields)
    now = time.time()
    rows = [
        [
            node_label(r["node"]),
            ",".join(r["tiers"]),
            "[green]ok[/green]"
            if r["checksum_ok"]
            else "[red]CORRUPT " + ",".join(r["corrupt_tiers"]) + "[/red]",
            ago(r["created"], now),
            ago(max(r["last_access"], r["created"]), now),
            _state(r),
        ]
        for r in doc["replicas"]
    ]
    ctx.out.print("")
    ctx.out.table("replicas", ["NODE", "TIERS", "CHECKSUM (now)", "AGE", "ACCESSED", "STATE"], rows)
    ctx.out.print("")
    ctx.out.print(f"token ids: {doc['tokens']}", markup=False)
    if doc["text"] is not None:
        ctx.out.print(f"text: {doc['text']!r}", markup=False)
