"""Memory accounted where it is spent (issue 34, finding 5), against a real daemon: every
block a tier indexes is charged at least ~1.1 KiB of the node's RAM budget
(``node.index_memory``), whatever its payload, and a tier past the budget evicts or refuses
as at capacity. Before: 4-byte blocks were charged 157 B of disk capacity and cost ~1,080 B
of heap each, so a disk tier of tiny blocks could take ~6x its size in RAM."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.node.tiers.ram import BLOCK_BYTES
from kvstore.results import Status

TOK_A, TOK_B, TOK_OP = "tok-tenant-a1", "tok-tenant-b1", "tok-operator1"
BUDGET = 2 << 20


def client(d, ns, token) -> NodeClient:
    return NodeClient(
        d.addr, ClientConfig(token=token, namespaces=(ns,), op_timeout_s=60, probe_interval_s=60)
    )


def stats(d, tmp_path) -> dict:
    (tmp_path / "op.txt").write_text(TOK_OP + "\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "stats",
            "--node",
            d.admin,
            "--token-file",
            str(tmp_path / "op.txt"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["nodes"][0]


@pytest.mark.parametrize("dram", ["0", "8MiB"])
async def test_tiny_blocks_cannot_make_the_index_outgrow_its_budget(
    authed_daemon, ns, blocks_of, dram, tmp_path
):
    """Beta writes 4,000 blocks of 4 bytes (a 256 MiB disk would take ~1.5M of them); the
    node's RAM budget of 2 MiB holds under 1,800: the tiers evict beta's own oldest blocks,
    keep alpha's (under its share), and ``kvstore stats`` shows the budget and its use."""
    d = authed_daemon(
        {TOK_A: "alpha", TOK_B: "beta", TOK_OP: "*"},
        node={"index_memory": BUDGET},
        dram={"capacity": dram, "slab_size": "1MiB"},
    )
    a, b = client(d, ns, TOK_A), client(d, ns, TOK_B)
    mine = blocks_of(ns.with_tenant("alpha"), 20, 4, seed=1)
    assert [r.status for r in await a.put(mine)] == [Status.STORED] * 20
    tiny = blocks_of(ns.with_tenant("beta"), 4000, 4, seed=2)
    for i in range(0, len(tiny), 500):
        await b.put(tiny[i : i + 500])
    held = [t for t in (await b.lookup([h.key for h, _ in tiny])).names() if t is not None]
    assert 0 < len(held) < BUDGET // BLOCK_BYTES, len(held)
    assert None not in (await a.lookup([h.key for h, _ in mine])).names()  # alpha's share kept
    s = stats(d, tmp_path)
    raw_tiers = s["raw"]["tiers"]
    budget = {t["ram_budget_bytes"] for t in raw_tiers.values()}
    used = {t["ram_used_bytes"] for t in raw_tiers.values()}
    assert budget == {BUDGET}, raw_tiers
    assert max(used) <= BUDGET and sum(t["ram_bytes"] for t in raw_tiers.values()) == max(used)
    assert all("ram_bytes" in t for t in s["tiers"].values()), s["tiers"]
    await a.close()
    await b.close()
