"""``kvstore ls``, ``show``, ``pin``/``unpin`` and ``evict`` against a real daemon: tables,
JSON, exit statuses."""

from __future__ import annotations

import pytest
from storeutil import make_blocks

from kvstore.block import make_header
from kvstore.keys import Namespace

NS = Namespace("cli-test-model", "float16", 4)
OTHER = Namespace("cli-other-model", "float16", 4)


@pytest.fixture
def stored(start_daemon, put_blocks):
    """A daemon holding 5 blocks of NS and 2 of OTHER (4 KiB payloads)."""
    d = start_daemon()
    blocks = make_blocks(5, 4096, ns=NS)
    put_blocks(d.addr, blocks, NS)
    put_blocks(d.addr, make_blocks(2, 4096, ns=OTHER, seed=1), OTHER)
    d.blocks = blocks
    return d


def test_ls_table_and_json(cli, stored):
    r = cli("ls", "--node", stored.admin)
    assert r.code == 0, r.err
    for h, _ in stored.blocks:
        assert h.key.hex in r.out
    assert "dram,disk" in r.out and "4.0KiB" in r.out and "7 block(s) on 1 node(s)" in r.out
    assert "\x1b[" not in r.out  # no colours on a pipe
    j = cli("ls", "--node", stored.admin, "--json").json()
    assert j["count"] == 7 and j["truncated"] is False
    b = next(b for b in j["blocks"] if b["key"] == stored.blocks[0][0].key.hex)
    assert b["namespace"] == NS.id.hex and b["num_tokens"] == 4 and b["payload_len"] == 4096
    assert b["tiers"] == ["dram", "disk"] and b["node"] == stored.admin and not b["pinned"]
    assert b["leases"] == 0 and b["created"] > 0
    assert [x["key"] for x in j["blocks"]] == sorted(x["key"] for x in j["blocks"])

    j = cli("ls", "--node", stored.admin, "--json", "--namespace", OTHER.id.hex).json()
    assert j["count"] == 2 and {b["namespace"] for b in j["blocks"]} == {OTHER.id.hex}
    j = cli("ls", "--node", stored.admin, "--json", "--limit", "3", "--tier", "disk").json()
    assert j["count"] == 3 and j["truncated"] is True
    r = cli("ls", "--node", stored.admin, "--limit", "3")
    assert "raise --limit" in r.out


def test_show_table_json_and_absent(cli, stored):
    h = stored.blocks[2][0]
    r = cli("show", h.key.hex, "--node", stored.admin)
    assert r.code == 0, r.err
    assert h.parent.hex in r.out and NS.id.hex in r.out and f"{h.checksum:016x}" in r.out
    assert "ok" in r.out and str(h.tokens) in r.out
    j = cli("show", h.key.hex, "--node", stored.admin, "--json").json()
    assert j["found"] is True and j["tokens"] == h.tokens and j["text"] is None
    assert j["header"]["parent"] == h.parent.hex and j["header"]["shape"] == [4096]
    assert j["replicas"] == [
        {
            "node": stored.admin,
            "tiers": ["dram", "disk"],
            "checksum_ok": True,
            "corrupt_tiers": [],
            "pinned": False,
            "leases": 0,
            "created": j["replicas"][0]["created"],
            "last_access": j["replicas"][0]["last_access"],
        }
    ]
    missing = "ab" * 16
    r = cli("show", missing, "--node", stored.admin)
    assert r.code == 1 and missing in r.err and stored.admin in r.err
    r = cli("show", missing, "--node", stored.admin, "--json")
    assert r.code == 1 and r.json() == {"key": missing, "found": False, "replicas": []}
    r = cli("show", "not-a-key", "--node", stored.admin)
    assert r.code == 2 and "KEY 'not-a-key'" in r.err


def test_show_decodes_text_with_tokenizer(cli, start_daemon, cli_model, put_blocks):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{cli_model}/tokenizer.json")
    ids = tok.encode("hello tierkv", add_special_tokens=False).ids[:8]
    ns = Namespace("cli-text", "uint8", len(ids))
    payload = bytes(64)
    h = make_header(
        key=ns.block_keys(ids)[0],
        parent=ns.id,
        namespace=ns.id,
        tokens=ids,
        dtype="uint8",
        shape=[64],
        payload=payload,
    )
    d = start_daemon(use_disk=False)
    put_blocks(d.addr, [(h, payload)], ns)
    j = cli("show", h.key.hex, "--node", d.admin, "--tokenizer", cli_model, "--json").json()
    assert j["tokens"] == ids and j["text"] == tok.decode(ids, skip_special_tokens=False)
    r = cli("show", h.key.hex, "--node", d.admin, "--tokenizer", cli_model)
    assert f"text: {tok.decode(ids, skip_special_tokens=False)!r}" in r.out
    assert j["replicas"][0]["tiers"] == ["dram"]


def test_pin_unpin_evict(cli, stored):
    k0, k1 = stored.blocks[0][0].key.hex, stored.blocks[1][0].key.hex
    n = ["--node", stored.admin]
    r = cli("pin", k0, *n)
    assert r.code == 0 and "pinned" in r.out
    assert cli("pin", k0, *n, "--json").json() == {
        "key": k0,
        "pinned": True,
        "nodes": [{"node": stored.admin, "done": True}],
    }
    ls = cli("ls", *n)
    assert any(k0 in line and "pinned" in line for line in ls.out.splitlines())
    assert cli("show", k0, *n, "--json").json()["replicas"][0]["pinned"] is True
    assert cli("unpin", k0, *n).code == 0
    assert cli("unpin", k0, *n).code == 1  # no longer pinned anywhere
    assert cli("pin", "cd" * 16, *n).code == 1

    j = cli("evict", k1, *n, "--json").json()
    assert j == {
        "key": k1,
        "namespace": None,
        "deleted": 1,
        "nodes": [{"node": stored.admin, "deleted": 1, "error": None}],
        "unreachable": [],
    }
    assert cli("show", k1, *n).code == 1
    r = cli("evict", k1, *n)
    assert r.code == 1 and "not stored on any node" in r.err
    r = cli("evict", "--namespace", NS.id.hex, *n)
    assert r.code == 0 and "4 block(s) deleted" in r.out
    left = cli("ls", *n, "--json").json()
    assert {b["namespace"] for b in left["blocks"]} == {OTHER.id.hex} and left["count"] == 2
    assert cli("evict", *n).code == 2 and cli("evict", k0, "--namespace", NS.id.hex, *n).code == 2


def test_ls_over_three_nodes(cli, start_daemon, put_blocks):
    nodes = [start_daemon(use_disk=False) for _ in range(3)]
    blocks = make_blocks(6, 1024, ns=NS)
    for i, d in enumerate(nodes):
        put_blocks(d.addr, blocks[2 * i : 2 * i + 2], NS)
    put_blocks(nodes[0].addr, blocks[2:3], NS)  # a second replica of block 2
    argv = [x for d in nodes for x in ("--node", d.admin)]
    j = cli("ls", *argv, "--json").json()
    assert j["count"] == 7
    by_key = {}
    for b in j["blocks"]:
        by_key.setdefault(b["key"], []).append(b["node"])
    assert by_key[blocks[2][0].key.hex] == sorted([nodes[0].admin, nodes[1].admin])
    s = cli("show", blocks[2][0].key.hex, *argv, "--json").json()
    assert sorted(r["node"] for r in s["replicas"]) == sorted([nodes[0].admin, nodes[1].admin])
    r = cli("ls", *argv)
    assert "7 block(s) on 3 node(s)" in r.out
