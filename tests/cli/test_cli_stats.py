"""``kvstore stats``: per node and tier, table and JSON, after writes and reads."""

from __future__ import annotations

import asyncio

from storeutil import make_blocks

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.keys import Namespace

NS = Namespace("cli-stats-model", "float16", 4)


def _read(addr: str, keys, nbytes: int) -> None:
    async def go():
        c = NodeClient(addr, ClientConfig(namespaces=(NS,)))
        try:
            await get_into(c, keys, [bytearray(nbytes) for _ in keys])
        finally:
            await c.close()

    asyncio.run(go())


def test_stats_table_and_json(cli, start_daemon, put_blocks):
    d = start_daemon()
    blocks = make_blocks(3, 4096, ns=NS)
    put_blocks(d.addr, blocks, NS)
    other = make_blocks(1, 4096, ns=NS, seed=9)[0][0].key  # never stored: a miss
    _read(d.addr, [blocks[0][0].key, blocks[1][0].key, other], 4096)
    j = cli("stats", "--node", d.admin, "--json").json()
    (s,) = j["nodes"]
    assert s["node"] == d.admin and s["hits"] == 2 and s["misses"] == 1
    assert s["hit_ratio"] == round(2 / 3, 4)
    assert s["bytes_in"] == 3 * 4096 and s["bytes_out"] == 2 * 4096
    assert set(s["tiers"]) == {"dram", "disk"}
    dram = s["tiers"]["dram"]
    assert dram["blocks"] == 3 and dram["capacity_bytes"] == 64 << 20 and dram["used_bytes"] >= 3 * 4096
    assert dram["hits"] == 2 and dram["hit_ratio"] == round(2 / 3, 4)
    # waste: what the tier holds that no payload fills (docs/storage.md)
    assert dram["waste_bytes"] == s["raw"]["tiers"]["dram"]["waste_bytes"] >= 0
    assert s["tiers"]["disk"]["checksum_failures"] == 0 and s["evictions"] == 0
    assert s["raw"]["tiers"]["disk"]["blocks"] == 3

    r = cli("stats", "--node", d.admin)
    assert r.code == 0
    lines = r.out.splitlines()
    assert lines[0].split() == [
        "NODE", "TIER", "CAPACITY", "USED", "USE%", "WASTE", "BLOCKS", "HIT", "RATIO", "EVICTIONS", "CSUM", "FAIL",
        "IN", "OUT",
    ]  # fmt: skip
    dram_line = next(line for line in lines if " dram " in line)
    assert "64.0MiB" in dram_line and "66.7%" in dram_line
    all_line = next(line for line in lines if " all " in line)
    assert "66.7% of 3" in all_line and "12.0KiB" in all_line and "8.0KiB" in all_line
