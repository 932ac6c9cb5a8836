"""A write-through put (or a write-back eviction) cancelled while its disk write runs: the
block's slot is held until the disk thread has read it -- not released with the cancelled
caller, which let a delete free the slot under the thread, found no disk copy yet, and left
the deleted block to land on disk after it. Real tiers (mmap DRAM, LMDB in a tmp dir)."""

from __future__ import annotations

import asyncio

from storeutil import checked, make_blocks, settle, tiers_of

from kvstore.node.store import NodeStore

MiB = 1 << 20


async def _cancel_when_held(task: asyncio.Task, node: NodeStore, key: bytes) -> None:
    while not node.state.leases.held(key) and not task.done():
        await asyncio.sleep(0)  # the disk write (with its hold) is under way
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_cancelled_write_through_keeps_its_hold_until_the_disk_write_ends(cfg_factory):
    cfg = cfg_factory(dram__capacity="64MiB", dram__slab_size="16MiB", disk__capacity="1GiB")
    async with checked(await NodeStore.open(cfg)) as node:
        for h, p in make_blocks(6, nbytes=16 * MiB, seed=1):
            put = asyncio.create_task(node.writer.put([(h, p)]))
            await _cancel_when_held(put, node, h.key.raw)
            assert await node.delete([h.key]) == [True]
            await settle(node)  # the disk write ends
            assert tiers_of(node, [h.key]) == [None], "the deleted block landed on disk"
        node.check()
        assert node.inspector.stats()["tiers"]["disk"]["blocks"] == 0


async def test_a_cancelled_write_back_eviction_keeps_its_hold_until_the_disk_write_ends(cfg_factory):
    cfg = cfg_factory(
        dram__capacity="32MiB", dram__slab_size="16MiB", disk__capacity="1GiB", disk__write_mode="write-back"
    )
    async with checked(await NodeStore.open(cfg)) as node:
        blocks = make_blocks(8, nbytes=16 * MiB, seed=2)
        await node.writer.put(blocks[:2])  # DRAM full of dirty blocks
        for (old, _), new in zip(blocks, blocks[2:]):
            put = asyncio.create_task(node.writer.put([new]))  # evicts ``old``: a disk write
            await _cancel_when_held(put, node, old.key.raw)
            assert await node.delete([old.key]) == [True]
            await settle(node)  # the disk write ends
            assert tiers_of(node, [old.key]) == [None], "the deleted block landed on disk"
            await node.writer.put([new])  # the cancelled put did not store it
