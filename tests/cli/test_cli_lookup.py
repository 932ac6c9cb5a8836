"""``kvstore lookup``: the CLI's tokens, namespace and keys equal the engine's; a prompt whose
first blocks are cached partly hits (blocks put through the client, and blocks an engine saved
through the kvstore:// connector); a namespace mismatch is explained."""

from __future__ import annotations

import asyncio

import pytest
from storeutil import make_blocks

TEXT = "The quick brown fox jumps over the lazy dog; tierkv caches the KV of prompts like this one."


def _engine(model_dir: str):
    from engine.config import EngineConfig
    from engine.llm import LLMEngine

    return LLMEngine(model_dir, EngineConfig(num_pages=8))


def test_cli_tokens_namespace_and_keys_equal_the_engines(cli, cli_model, start_daemon):
    from kvstore.inspect.prompt import engine_namespace, prompt_tokens

    eng = _engine(cli_model)
    assert prompt_tokens(cli_model, TEXT, chat=False) == eng.tokenizer.encode(TEXT)
    chat = eng.tokenizer.apply_chat_template([{"role": "user", "content": TEXT}])
    assert prompt_tokens(cli_model, TEXT, chat=True) == chat
    ns = eng.namespace(16)
    assert engine_namespace(cli_model, "float32", 16, 1, 0, "") == ns
    assert engine_namespace(cli_model, "float32", 16, 1, 0, "acme") == ns.with_tenant("acme")
    d = start_daemon(use_disk=False)
    for extra, tokens in (([], eng.tokenizer.encode(TEXT)), (["--chat"], chat)):
        j = cli("lookup", "--model", cli_model, TEXT, *extra, "--node", d.admin, "--json").json()
        assert j["namespace"] == ns.id.hex and j["num_tokens"] == len(tokens)
        assert [b["key"] for b in j["blocks"]] == [k.hex for k in ns.block_keys(tokens)]


def _put_prefix(put_blocks, addr: str, ns, tokens: list[int], n_blocks: int) -> None:
    put_blocks(addr, make_blocks(n_blocks, 4096, ns=ns, tokens=tokens), ns)


def test_lookup_partial_hit_table_and_json(cli, cli_model, start_daemon, put_blocks, tmp_path):
    from kvstore.inspect.prompt import engine_namespace, prompt_tokens

    tokens = prompt_tokens(cli_model, TEXT, chat=False)  # 92 tokens: 5 full blocks + 12
    ns = engine_namespace(cli_model, "float32", 16, 1, 0, "")
    d = start_daemon()
    _put_prefix(put_blocks, d.addr, ns, tokens, 2)
    n = ["--node", d.admin]
    j = cli("lookup", "--model", cli_model, TEXT, *n, "--json").json()
    assert [b["hit"] for b in j["blocks"]] == [True, True, False, False, False]
    assert j["blocks"][0]["nodes"] == [{"node": d.admin, "tier": "dram", "tiers": ["dram", "disk"]}]
    assert j["blocks"][0]["tier"] == "dram" and j["blocks"][2]["tier"] is None
    assert (j["blocks"][1]["start"], j["blocks"][1]["end"]) == (16, 32)
    s = j["summary"]
    assert s["hit_tokens"] == 32 and s["total_tokens"] == len(tokens) and s["prefix_hit_blocks"] == 2
    assert s["first_miss"] == 2 and s["tail_tokens"] == len(tokens) % 16
    assert s["est_prefill_s"] == pytest.approx(32 / 2000) and s["est_load_s"] == pytest.approx(
        2 * (0.0005 + 4096 / 1e9)
    )
    assert "block 2 (tokens 32-47) is on no node" in s["reason"]

    r = cli("lookup", "--model", cli_model, TEXT, *n)
    assert r.code == 0
    rows = [line.split() for line in r.out.splitlines() if line.strip()[:1].isdigit()]
    assert [row[3] for row in rows] == ["hit", "hit", "miss", "miss", "miss"]
    assert f"hit 32/{len(tokens)} tokens" in r.out and "estimated load" in r.out and "why: block 2" in r.out

    # the same prompt from a file and as token ids
    f = tmp_path / "p.txt"
    f.write_text(TEXT)
    assert (
        cli("lookup", "--model", cli_model, "--file", f, *n, "--json").json()["summary"]["hit_tokens"] == 32
    )
    tj = tmp_path / "t.json"
    tj.write_text(str(tokens[:40]))
    j = cli("lookup", "--model", cli_model, "--tokens-json", tj, *n, "--json").json()
    assert (
        j["summary"]["hit_tokens"] == 32
        and j["summary"]["first_miss"] is None
        and j["summary"]["tail_tokens"] == 8
    )


def test_lookup_explains_a_namespace_mismatch(cli, cli_model, start_daemon, put_blocks):
    from kvstore.inspect.prompt import engine_namespace, prompt_tokens

    tokens = prompt_tokens(cli_model, TEXT, chat=False)
    d = start_daemon(use_disk=False)
    _put_prefix(put_blocks, d.addr, engine_namespace(cli_model, "float32", 16, 1, 0, ""), tokens, 3)
    j = cli("lookup", "--model", cli_model, TEXT, "--dtype", "bfloat16", "--node", d.admin, "--json").json()
    assert j["summary"]["hit_tokens"] == 0
    assert "no node holds any block of namespace" in j["summary"]["reason"]
    r = cli("lookup", "--model", cli_model, "hi", "--node", d.admin)
    assert r.code == 0 and "fewer than one block" in r.out
    assert cli("lookup", "--model", cli_model, TEXT, "--dtype", "int4", "--node", d.admin).code == 2
    r = cli("lookup", "--model", str(d.workdir), TEXT, "--node", d.admin)
    assert r.code == 2 and "tokenizer.json" in r.err


def test_lookup_sees_what_an_engine_saved_through_the_connector(cli, cli_model, start_daemon):
    from connutil import open_engine, run

    from kvstore.inspect.prompt import prompt_tokens

    d = start_daemon()
    first = TEXT[:70]  # its tokens are a prefix of TEXT's (byte-level tokenizer)
    tokens = prompt_tokens(cli_model, first, chat=False)
    assert prompt_tokens(cli_model, TEXT, chat=False)[: len(tokens)] == tokens

    async def store():
        async with open_engine(cli_model, f"kvstore://{d.addr}?lookup_deadline_s=5&policy=always") as a:
            await run(a, tokens)
            assert await a.connector.flush()

    asyncio.run(store())
    j = cli("lookup", "--model", cli_model, TEXT, "--node", d.admin, "--json").json()
    saved = len(tokens) // 16
    assert saved >= 2 and j["summary"]["prefix_hit_blocks"] == saved
    assert j["summary"]["hit_tokens"] == saved * 16 and j["summary"]["first_miss"] == saved


def test_lookup_over_three_nodes_names_the_node_of_each_block(cli, cli_model, start_daemon, put_blocks):
    from kvstore.inspect.prompt import engine_namespace, prompt_tokens

    tokens = prompt_tokens(cli_model, TEXT, chat=False)
    ns = engine_namespace(cli_model, "float32", 16, 1, 0, "")
    nodes = [start_daemon(use_disk=False) for _ in range(3)]
    _put_prefix(put_blocks, nodes[0].addr, ns, tokens, 1)  # block 0 on node 0
    _put_prefix(put_blocks, nodes[1].addr, ns, tokens, 2)  # blocks 0-1 on node 1
    _put_prefix(put_blocks, nodes[2].addr, ns, tokens, 3)  # blocks 0-2 on node 2
    argv = [x for d in nodes for x in ("--node", d.admin)]
    j = cli("lookup", "--model", cli_model, TEXT, *argv, "--json").json()
    held = [[h["node"] for h in b["nodes"]] for b in j["blocks"]]
    assert held == [[d.admin for d in nodes], [nodes[1].admin, nodes[2].admin], [nodes[2].admin], [], []]
    assert j["summary"]["hit_tokens"] == 48 and j["summary"]["first_miss"] == 3
    r = cli("lookup", "--model", cli_model, TEXT, *argv)
    assert nodes[2].admin.split("://")[1] in r.out and "hit 48/" in r.out


def test_lookup_derives_a_tenants_secret_salt_as_the_daemons_do(
    cli, cli_model, start_daemon, put_blocks, tmp_path
):
    """With ``auth.salt_secret_file`` a tenant's keys cannot be computed from its name
    (docs/security.md); the operator, who holds the secret, computes them with
    ``--salt-secret-file``. Without it the CLI computes the name-salted keys, which miss."""
    from kvstore.inspect.prompt import engine_namespace, prompt_tokens

    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("tenant-token-1 acme\noperator-token-1 *\n")
    secret = tmp_path / "salt-secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    op = tmp_path / "op-token"
    op.write_text("operator-token-1\n")
    d = start_daemon(auth={"token_file": str(tokens_file), "salt_secret_file": str(secret)})
    tokens = prompt_tokens(cli_model, TEXT, chat=False)
    base = engine_namespace(cli_model, "float32", 16, 1, 0, "")
    salted = engine_namespace(cli_model, "float32", 16, 1, 0, "acme", salt_secret_file=str(secret))
    assert salted != base.with_tenant("acme")
    _put_prefix(
        lambda addr, blocks, ns: put_blocks(addr, blocks, base, token="tenant-token-1"),
        d.addr,
        salted,
        tokens,
        2,
    )
    n = ["--node", d.admin, "--token-file", str(op), "--tenant", "acme"]
    j = cli("lookup", "--model", cli_model, TEXT, *n, "--salt-secret-file", str(secret), "--json").json()
    assert j["namespace"] == salted.id.hex and j["summary"]["hit_tokens"] == 32
    j = cli("lookup", "--model", cli_model, TEXT, *n, "--json").json()
    assert j["summary"]["hit_tokens"] == 0 and "--salt-secret-file" in j["summary"]["reason"]
    r = cli("lookup", "--model", cli_model, TEXT, *n, "--salt-secret-file", str(tmp_path / "none"))
    assert r.code == 2 and "--salt-secret-file" in r.err


def test_lookup_computes_an_fp8_engines_namespace_from_its_logged_layout(cli_model):
    from engine.config import EngineConfig
    from engine.llm import LLMEngine
    from kvstore.inspect.prompt import block_bytes, engine_namespace

    eng = LLMEngine(cli_model, EngineConfig(num_pages=8, kv_cache_dtype="fp8_e4m3"))
    ns = eng.namespace(16)
    assert ns.layout != "LKTHD"
    assert engine_namespace(cli_model, ns.kv_dtype, 16, 1, 0, "", layout=ns.layout) == ns
    assert engine_namespace(cli_model, ns.kv_dtype, 16, 1, 0, "") != ns
    # the payload an fp8 block carries: one byte a value plus a 4-byte scale per layer, K/V, head
    assert block_bytes(cli_model, ns.kv_dtype, 16, 1, ns.layout) == eng.kv.block_bytes(16 // eng.kv.page_size)


def test_cli_commands_reach_the_store_only_through_the_client_facade():
    """No `kvstore` command module imports a client module (node, cluster, etcd, ...) or the
    node store: what the CLI needs of them comes from `kvstore.client` (the facade)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    bad = {}
    for path in sorted((root / "kvstore" / "inspect").glob("*.py")):
        mods = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods.add(node.module)
            elif isinstance(node, ast.Import):
                mods |= {a.name for a in node.names}
        reach = {m for m in mods if m.startswith(("kvstore.client.", "kvstore.node"))}
        if reach:
            bad[path.name] = sorted(reach)
    assert not bad, f"CLI modules past the facade: {bad}"
    assert "kvstore.client" in (root / "kvstore/inspect/context.py").read_text()  # --cluster uses it
