"""A node's listing pages and the slices they run in (kvstore/node/inspection.py,
kvstore/node/listing.py, issue 33 item 3): pages picked by numpy passes over the key order
still list every block once, keys that end in zero bytes included, a page cut where it
fills ends at that key, and a rest between slices lets every step of what waits on the loop
run before the next slice. Rows as JSON are the text ``json.dumps`` makes."""

from __future__ import annotations

import asyncio
import json
import socket
import time

from storeutil import make_blocks

from kvstore.daemon.admin_inspect import block_json, row_json
from kvstore.keys import BlockKey, Namespace
from kvstore.node.inspection import SCAN_MIN
from kvstore.node.listing import LoopSlices
from kvstore.results import BlockInfo

NS = Namespace("listing-pages", "uint8", 4)
RARE = Namespace("listing-pages-rare", "uint8", 4)


def _block(ns: Namespace, i: int):
    """Block ``i`` of ``ns``: one block below the namespace's root, its tokens made of ``i``."""
    return make_blocks(1, 16, ns=ns, tokens=[i & 0xFFFF, i >> 16, 7, 9], seed=i)[0]


def _zero_tailed(ns: Namespace, n: int) -> list:
    """``n`` blocks whose keys end in a zero byte (1 key in 256): numpy's ``S16`` items drop
    trailing zeros, so a key read back from the key order item by item would be cut short."""
    out, i = [], 0
    while len(out) < n:
        h, p = _block(ns, 1_000_000 + i)
        if h.key.raw[-1] == 0:
            out.append((h, p))
        i += 1
    return out


async def _follow(node, limit: int, **kw) -> tuple[list[bytes], int]:
    """Every page from the first to the one without a cursor: (keys listed, pages)."""
    keys: list[bytes] = []
    after, pages = None, 0
    while True:
        page = await node.inspector.page(after=after, limit=limit, **kw)
        pages += 1
        keys += [i.key.raw for i in page.blocks]
        if page.next is None:
            return keys, pages
        assert len(page.next.raw) == 16
        after = page.next


async def test_every_block_is_listed_once_in_key_order_zero_tailed_keys_included(node):
    blocks = [_block(NS, i) for i in range(300)] + _zero_tailed(NS, 3)
    for off in range(0, len(blocks), 100):
        res = await node.writer.put(blocks[off : off + 100])
        assert all(r.status.ok for r in res)
    want = sorted(h.key.raw for h, _ in blocks)
    for limit in (1, 7, 100, 1000):
        keys, pages = await _follow(node, limit)
        assert keys == want, f"limit {limit}"
        assert pages >= len(want) // limit, f"limit {limit}: {pages} pages"
    tailed = {h.key.raw for h, _ in blocks[-3:]}
    # a cursor that is a zero-tailed key starts the next page right after it
    for k in tailed:
        page = await node.inspector.page(after=BlockKey(k), limit=1)
        assert [i.key.raw for i in page.blocks] == [w for w in want if w > k][:1]


async def test_each_tiers_key_pairs_are_its_keys_after_puts_and_deletes(node):
    """The key snapshot reads each tier's probe table (numpy, no Python per key): it must be
    the tier's dict exactly, whatever changed since the table's last sync."""
    blocks = [_block(NS, i) for i in range(500)] + _zero_tailed(NS, 2)
    assert all(r.status.ok for r in await node.writer.put(blocks))
    assert all(await node.delete([h.key for h, _ in blocks[::3]]))
    for tier in node.inspector.tiers:
        raw = tier.key_pairs().astype("<u8").tobytes()
        assert sorted(raw[o : o + 16] for o in range(0, len(raw), 16)) == sorted(tier.keys()), tier.name
    keys, _ = await _follow(node, 100)
    assert keys == sorted(h.key.raw for i, (h, _) in enumerate(blocks) if i % 3)


async def test_a_rare_namespace_is_followed_past_pages_that_find_nothing(node):
    common = [_block(NS, i) for i in range(2 * SCAN_MIN + 100)]
    rare = [_block(RARE, i) for i in range(5)] + _zero_tailed(RARE, 2)
    for off in range(0, len(common), 1000):
        assert all(r.status.ok for r in await node.writer.put(common[off : off + 1000]))
    assert all(r.status.ok for r in await node.writer.put(rare))
    keys, pages = await _follow(node, 2, namespace=RARE.id)
    assert keys == sorted(h.key.raw for h, _ in rare)
    assert pages >= 3, "the node's keys take more than one page to look at"
    # deleted blocks are not listed, and do not end the listing
    gone = [h.key for h, _ in rare[:3]]
    assert all(await node.delete(gone))
    keys, _ = await _follow(node, 1, namespace=RARE.id)
    assert keys == sorted(h.key.raw for h, _ in rare[3:])


async def test_a_new_listing_sorts_the_keys_again_only_after_a_key_was_added(node):
    """A listing's first page takes a new key snapshot unless no tier added a key since the
    last one: an operator's listings in a loop sort nothing, and still see every write."""
    blocks = [_block(NS, i) for i in range(60)]
    assert all(r.status.ok for r in await node.writer.put(blocks[:40]))
    order = node.inspector.order
    keys, _ = await _follow(node, 100)
    assert keys == sorted(h.key.raw for h, _ in blocks[:40])
    builds = order.builds
    keys, _ = await _follow(node, 7)
    assert keys == sorted(h.key.raw for h, _ in blocks[:40])
    assert order.builds == builds, "nothing was added: the same snapshot serves"
    gone = [h.key for h, _ in blocks[:5]]
    assert all(await node.delete(gone))
    keys, _ = await _follow(node, 100)
    assert keys == sorted(h.key.raw for h, _ in blocks[5:40]), "a deleted block is skipped"
    assert order.builds == builds
    # new keys and a deleted one written again: the next listing reads the keys again
    assert all(r.status.ok for r in await node.writer.put(blocks[40:] + blocks[:1]))
    keys, _ = await _follow(node, 100)
    assert keys == sorted(h.key.raw for h, _ in blocks[:1] + blocks[5:])
    assert order.builds == builds + 1


async def test_a_rest_runs_every_step_of_a_request_that_arrived_during_the_slice():
    """A request on the loop takes several turns (its socket's read callback, then each step
    scheduled by the one before: decode, reply): a rest lets all of them run before the next
    slice. A plain ``sleep(0)`` resumes the slice first: its wake-up is queued before the
    turn's socket events."""
    loop = asyncio.get_running_loop()
    ran: list[str] = []

    def step(n: int) -> None:
        end = time.perf_counter() + 0.001  # a step that does work (the rest sees the loop busy)
        while time.perf_counter() < end:
            pass
        ran.append(f"step {n}")
        if n < 3:
            loop.call_soon(step, n + 1)

    ours, peer = socket.socketpair()
    ours.setblocking(False)

    def readable() -> None:
        ours.recv(16)
        step(1)

    loop.add_reader(ours.fileno(), readable)
    try:
        slices = LoopSlices(slice_s=0.0, max_rest_s=60.0)
        peer.send(b"x")  # a request arrives while a slice runs
        await slices.tick()
        ran.append("next slice")
    finally:
        loop.remove_reader(ours.fileno())
        ours.close()
        peer.close()
    assert ran == ["step 1", "step 2", "step 3", "next slice"]
    assert slices.rests == 1


def test_a_row_is_the_text_json_dumps_makes():
    key, ns = BlockKey(bytes(range(16))), BlockKey(bytes(16))
    cases = [
        BlockInfo(key, ns, ("dram", "disk"), 256, 4, 1765000000.123456, 1765000001.0, 0, False),
        BlockInfo(key, ns, ("disk",), 1 << 40, 1, 0.0, 0.0, 3, True),
        BlockInfo(key, ns, ("hbm", "dram", "disk"), 0, 0, float("inf"), float("nan"), 1, False),
        BlockInfo(key, ns, ("tape",), 2, 2, -1e-300, 1e300, 0, True),
    ]
    for info in cases:
        assert row_json(info) == json.dumps(block_json(info))
