"""Eviction on a real daemon's ``/metrics`` and in ``kvstore stats``' summary: hit tokens,
evictions by reason, admission refusals (tenant shares), orphaned bytes and bytes per
namespace, per tier."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from scraping import scrape
from storeutil import make_blocks

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.inspect.cmd_stats import summarize
from kvstore.keys import Namespace

NS = Namespace("eviction-metrics-model", "float16", 4)
BLOCK = 64 * 1024


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_eviction_counters_on_metrics_and_stats(start_daemon):
    # 1 MiB of DRAM in slabs of 64 KiB: 16 blocks; no disk, so evictions drop blocks
    d = start_daemon(use_disk=False, dram={"capacity": "1MiB", "slab_size": "64KiB"})
    chain = make_blocks(13, nbytes=BLOCK, ns=NS, seed=3)  # 12 stored first, the 13th at the end
    singles = [make_blocks(1, nbytes=BLOCK, ns=NS, seed=100 + i)[0] for i in range(12)]

    async def go():
        c = NodeClient(d.addr, ClientConfig(namespaces=(NS,)))
        try:
            for i in range(0, 12, 4):
                await c.put(chain[i : i + 4])
            got = await get_into(c, [h.key for h, _ in chain[:3]], [bytearray(BLOCK) for _ in range(3)])
            assert len(got) == 3 and all(g.status.ok for g in got), got
            for i in range(0, 12, 4):  # 12 one-block prompts: 8 blocks must go, the chain's tail
                await c.put(singles[i : i + 4])
            # the chain's 13th block: its parent was evicted here, so it is an orphan
            await c.put(chain[12:])
        finally:
            await c.close()

    asyncio.run(go())
    m = scrape(d.admin)
    assert m.value("tierkv_hit_tokens_total", tier="dram") == 3 * NS.block_tokens
    assert m.value("tierkv_tier_evictions_by_reason_total", tier="dram", reason="write") == 9
    assert m.value("tierkv_admission_rejections_total", tier="dram", why="share") == 0
    orphan = m.value("tierkv_tier_orphan_bytes", tier="dram")
    assert BLOCK < orphan < 2 * BLOCK, orphan
    ns_bytes = m.value("tierkv_tier_namespace_bytes", tier="dram", namespace=NS.id.hex)
    assert ns_bytes >= 16 * BLOCK

    s = summarize(d.admin, json.loads(_get(d.admin + "/v1/stats")))
    dram = s["tiers"]["dram"]
    assert dram["policy"] == "prefix-marginal" and dram["hit_tokens"] == 3 * NS.block_tokens
    assert dram["share_refusals"] == 0 and dram["orphan_bytes"] == orphan
    assert dram["namespaces"] == {NS.id.hex: ns_bytes}
    assert dram["evictions"] == 9 and dram["blocks"] == 16
