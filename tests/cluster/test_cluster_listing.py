"""A node's listing is complete under churn (issue 33, finding 2): blocks deleted or evicted
while an operator pages through ``GET /v1/blocks`` (and ``kvstore ls``) never end the listing
early. Every block stored for the whole listing is listed; a short page is not the end."""

from __future__ import annotations

import asyncio
import random

import aiohttp
from storeutil import make_blocks

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.keys import Namespace

NS = Namespace("listing-model", "uint8", 4)
# DRAM far smaller than the data: most blocks live on disk only, so reading a header is a
# read on the disk's threads (the loop turns between blocks, and a delete can land there).
SMALL_DRAM = {"dram": {"capacity": "2MiB", "slab_size": "1MiB"}}


async def _store(client: NodeClient, blocks) -> None:
    for off in range(0, len(blocks), 200):
        res = await client.put(blocks[off : off + 200])
        assert all(r.status.ok for r in res), [r.status for r in res if not r.status.ok][:3]


async def page_all(admin: str, limit: int, **params: str) -> tuple[list[str], int]:
    """Follow ``next`` from the first page to the end: (keys listed, short pages that were not
    the last: a block went between the page's choice and its header read)."""
    keys: list[str] = []
    after = None
    short = 0
    async with aiohttp.ClientSession(admin) as s:
        while True:
            q = dict(params, limit=str(limit))
            if after:
                q["after"] = after
            async with s.get("/v1/blocks", params=q) as r:
                assert r.status == 200, await r.text()
                page = await r.json()
            keys += [b["key"] for b in page["blocks"]]
            after = page["next"]
            if after is None:
                return keys, short
            short += len(page["blocks"]) < limit


async def _churn(client: NodeClient, doomed: list, stop: asyncio.Event) -> int:
    """Delete ``doomed`` a few at a time, in random order, until done or ``stop``."""
    rnd = random.Random(7)
    order = list(doomed)
    rnd.shuffle(order)
    deleted = 0
    while order and not stop.is_set():
        batch, order = order[:3], order[3:]
        deleted += sum(await client.delete(batch))
        await asyncio.sleep(0)
    return deleted


async def test_listing_under_deletes_lists_every_block_that_stayed(start_daemon):
    d = start_daemon(**SMALL_DRAM)
    client = NodeClient(d.addr, ClientConfig(namespaces=(NS,)))
    try:
        stay = make_blocks(1500, 4096, seed=1, ns=NS)
        go = make_blocks(1500, 4096, seed=2, ns=NS)
        await _store(client, stay + go)
        want = {h.key.hex for h, _ in stay}
        listed, _ = await page_all(d.admin, 1000)
        assert want <= set(listed) and len(listed) == 3000, "a listing without churn is complete"

        stop = asyncio.Event()
        churn = asyncio.create_task(_churn(client, [h.key for h, _ in go], stop))
        rounds = []
        try:
            while not churn.done() and len(rounds) < 20:
                listed, short = await page_all(d.admin, 50)
                rounds.append((len(want - set(listed)), short))
        finally:
            stop.set()
            deleted = await churn
        assert deleted > 0 and rounds, "the churn ran beside at least one listing"
        missing = [m for m, _ in rounds]
        assert missing == [0] * len(rounds), (
            f"(blocks stored throughout but not listed, short pages): {rounds}"
        )
        assert sum(s for _, s in rounds) > 0, f"no block went while a page was read: {rounds}"
    finally:
        await client.close()


async def test_a_namespace_listing_follows_the_cursor_past_other_namespaces(start_daemon):
    """A page filtered by namespace may hold fewer blocks than asked (even none) and still not
    be the end: the cursor moves over the blocks it looked at."""
    other = Namespace("other-model", "uint8", 4)
    d = start_daemon(**SMALL_DRAM)
    client = NodeClient(d.addr, ClientConfig(namespaces=(NS, other)))
    try:
        mine = make_blocks(40, 1024, seed=3, ns=NS)
        theirs = make_blocks(2000, 1024, seed=4, ns=other)
        await _store(client, mine + theirs)
        listed, _ = await page_all(d.admin, 7, namespace=NS.id.hex)
        assert sorted(listed) == sorted(h.key.hex for h, _ in mine)
    finally:
        await client.close()


async def _ping_while(client: NodeClient, key, busy: asyncio.Task) -> int:
    """Data-port EXISTS round trips answered while ``busy`` runs (one at a time)."""
    answered = 0
    while not busy.done():
        (await client.lookup([key])).names()
        answered += not busy.done()
    return answered


async def test_the_data_port_answers_while_a_long_listing_runs(start_daemon):
    """Finding 3: a listing held the event loop while it looked at a page's blocks (header
    decodes for every candidate of a filtered page, row encoding), so the data port answered
    nothing meanwhile. A listing of a rare namespace on a node of 40,000 blocks (the node
    looks at every one of them and answers little): count the data-port round trips answered
    while it runs (no clock)."""
    other = Namespace("listing-other", "uint8", 4)
    d = start_daemon(use_disk=False, dram={"capacity": "256MiB", "slab_size": "4MiB"})
    writer = NodeClient(d.addr, ClientConfig(namespaces=(NS, other)))
    pinger = NodeClient(d.addr, ClientConfig(namespaces=(NS,)))
    try:
        await _store(writer, make_blocks(40_000, 16, seed=8, ns=other))
        rare = make_blocks(20, 16, seed=9, ns=NS)
        await _store(writer, rare)
        probe = rare[0][0].key
        (await pinger.lookup([probe])).names()  # connected before the listing starts
        listing = asyncio.create_task(page_all(d.admin, 10_000, namespace=NS.id.hex))
        answered = await _ping_while(pinger, probe, listing)
        listed, _ = await listing
        assert sorted(listed) == sorted(h.key.hex for h, _ in rare)
        # a loop held for the whole listing answers one or two (those queued behind it)
        assert answered >= 10, f"{answered} data-port answers during the listing"
    finally:
        await writer.close()
        await pinger.close()
