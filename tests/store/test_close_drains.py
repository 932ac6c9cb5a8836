"""Closing a node right after callers were cancelled mid-disk-write: the work they left
finishing (a disk write, the delete that follows a write raced by a delete, the index
updates after LMDB's) ends before the tiers close -- not afterwards, against a closed LMDB
environment and a shut-down writer thread, where it failed (logged) and left LMDB holding
what the node had already given up (a deleted block back after the reopen) or lacking what
it went on to write. Real tiers (mmap DRAM, LMDB in a tmp dir); the node is reopened on
the same directory and read back."""

from __future__ import annotations

import asyncio
import logging
import time

from storeutil import checked, make_blocks, tiers_of

from kvstore.node.store import NodeStore
from kvstore.node.tiers.tasks import Finishing, to_the_end
from kvstore.results import Status

MiB = 1 << 20


async def _cancel_when_held(tasks: list[asyncio.Task], node: NodeStore, keys: list[bytes]) -> None:
    """Cancel ``tasks`` once every key is held: each write is committed and bound for disk."""
    while not all(node.state.leases.held(k) for k in keys) and not all(t.done() for t in tasks):
        await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _close_and_reopen(node: NodeStore, cfg, caplog) -> NodeStore:
    """Close ``node`` at once, reopen its directory, and fail on anything logged as failed
    meanwhile (late work ends within the wait: it used to fail right after the close)."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        await node.close()
        again = await NodeStore.open(cfg)
        await asyncio.sleep(0.5)  # what the old node left running would end (and log) by now
    bad = [
        r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or "unfinished" in r.getMessage()
    ]
    assert not bad, f"logged after close: {bad}"
    again.check()  # the rebuilt index agrees with LMDB
    return again


async def _reads_back(node: NodeStore, blocks) -> list[bool]:
    bufs = [bytearray(h.payload_len) for h, _ in blocks]
    res = await node.reader.read([h.key for h, _ in blocks], bufs)
    return [r.status is Status.HIT and bytes(b) == p for r, b, (_, p) in zip(res, bufs, blocks)]


async def test_close_waits_for_cancelled_puts_to_disk(cfg_factory, caplog):
    cfg = cfg_factory(dram__capacity=0, disk__capacity="1GiB")
    node = await NodeStore.open(cfg)
    blocks = make_blocks(3, nbytes=32 * MiB, seed=3)
    # one put writes while the others wait for the disk's writer: all cancelled, all finish
    puts = [asyncio.create_task(node.writer.put([b])) for b in blocks]
    await _cancel_when_held(puts, node, [h.key.raw for h, _ in blocks])
    async with checked(await _close_and_reopen(node, cfg, caplog)) as again:
        st = again.inspector.stats()["tiers"]["disk"]
        assert st["blocks"] == 3 and st["payload_bytes"] == 3 * 32 * MiB
        assert await _reads_back(again, blocks) == [True] * 3


async def test_close_waits_for_the_deletes_that_follow_cancelled_write_throughs(cfg_factory, caplog):
    cfg = cfg_factory(dram__capacity="256MiB", dram__slab_size="32MiB", disk__capacity="1GiB")
    node = await NodeStore.open(cfg)
    kept, *gone = make_blocks(4, nbytes=16 * MiB, seed=4)
    assert [r.status for r in await node.writer.put([kept])] == [Status.STORED]
    puts = [asyncio.create_task(node.writer.put([b])) for b in gone]
    await _cancel_when_held(puts, node, [h.key.raw for h, _ in gone])
    # deleted while their disk writes run: hidden now, each disk copy dropped once written
    assert await node.delete([h.key for h, _ in gone]) == [True] * 3
    async with checked(await _close_and_reopen(node, cfg, caplog)) as again:
        found = tiers_of(again, [h.key for h, _ in [kept, *gone]])
        assert found == ["disk", None, None, None], "a deleted block is back"
        assert await _reads_back(again, [kept]) == [True]


async def test_close_waits_for_a_cancelled_delete_and_the_puts_behind_it(cfg_factory, caplog):
    cfg = cfg_factory(dram__capacity=0, disk__capacity="1GiB")
    node = await NodeStore.open(cfg)
    old, *new = make_blocks(4, nbytes=32 * MiB, seed=5)
    await node.writer.put([old])
    delete = asyncio.create_task(node.delete([old[0].key]))
    puts = [asyncio.create_task(node.writer.put([b])) for b in new]
    await _cancel_when_held(puts, node, [h.key.raw for h, _ in new])
    delete.cancel()
    await asyncio.gather(delete, return_exceptions=True)
    async with checked(await _close_and_reopen(node, cfg, caplog)) as again:
        assert tiers_of(again, [old[0].key]) == [None]
        assert await _reads_back(again, new) == [True] * 3


async def test_the_wait_is_bounded_and_counts_what_is_left():
    finishing, go = Finishing(), asyncio.Event()
    caller = asyncio.create_task(to_the_end(go.wait(), finishing))
    await asyncio.sleep(0)
    caller.cancel()
    await asyncio.gather(caller, return_exceptions=True)
    t0 = time.monotonic()
    assert await finishing.drain(0.2) == 1, "the cancelled caller's work is still running"
    assert time.monotonic() - t0 < 2
    go.set()
    assert await finishing.drain(2.0) == 0 and len(finishing) == 0
