"""A delete racing a read, a write-through or a demotion of the same block: once delete has
returned, the block is gone from every tier -- no read's promotion brings its old bytes back
into memory, no disk write that was in flight leaves a copy behind. Real tiers (mmap DRAM,
LMDB in a tmp dir); the races are made likely with large payloads and repeated."""

from __future__ import annotations

import asyncio

from storeutil import checked, make_blocks, on_disk_only, settle, tiers_of

from kvstore.node.store import NodeStore
from kvstore.results import Status

MiB = 1 << 20


def _big_cfg(cfg_factory, **kw):
    # 8 MiB blocks: a disk read copies and checksums long enough for a delete to overtake it
    base = dict(dram__capacity="64MiB", dram__slab_size="8MiB", disk__capacity="256MiB", disk__sync=True)
    base.update(kw)
    return cfg_factory(**base)


async def test_a_get_racing_a_delete_does_not_promote_the_block_back(cfg_factory):
    cfg = _big_cfg(cfg_factory)
    blocks = make_blocks(8, nbytes=8 * MiB)
    async with checked(await on_disk_only(cfg, blocks)) as node:
        for h, p in blocks:
            buf = bytearray(len(p))
            get = asyncio.create_task(node.reader.read([h.key], [buf]))
            await asyncio.sleep(0)  # the read is under way
            assert await node.delete([h.key]) == [True]
            [r] = await get
            if r.status is Status.HIT:  # read before the delete: the bytes, but not kept
                assert bytes(buf) == p
            assert tiers_of(node, [h.key]) == [None], "a deleted block came back"
        assert node.inspector.stats()["tiers"]["dram"]["blocks"] == 0


async def test_a_get_racing_delete_and_rewrite_leaves_the_writer_its_key(cfg_factory):
    """Delete, then a new two-phase write of the key while an older read is still under way:
    the read's promotion must not slip the old copy in under the writer's reservation (its
    commit would find the key taken)."""
    cfg = _big_cfg(cfg_factory)
    blocks = make_blocks(8, nbytes=8 * MiB)
    async with checked(await on_disk_only(cfg, blocks)) as node:
        for h, p in blocks:
            get = asyncio.create_task(node.reader.read([h.key], [bytearray(len(p))]))
            await asyncio.sleep(0)
            assert await node.delete([h.key]) == [True]
            [res] = await node.writer.reserve([h])
            assert not isinstance(res, Status), f"the deleted key is not free to write: {res}"
            res.view[:] = p
            await get
            [pr] = await node.writer.commit([res])
            assert pr.status is Status.STORED


async def test_a_write_through_racing_a_delete_leaves_no_disk_copy(cfg_factory):
    cfg = _big_cfg(cfg_factory)
    async with checked(await NodeStore.open(cfg)) as node:
        for h, p in make_blocks(4, nbytes=8 * MiB, seed=3):
            put = asyncio.create_task(node.writer.put([(h, p)]))
            while tiers_of(node, [h.key]) == [None]:  # committed to DRAM, disk write under way
                await asyncio.sleep(0)
            assert await node.delete([h.key]) == [True]
            [pr] = await put
            assert pr.status is Status.STORED
            assert tiers_of(node, [h.key]) == [None], "the disk write brought it back"
        node.check()
        assert node.inspector.stats()["tiers"]["disk"]["blocks"] == 0


async def test_a_demotion_to_disk_racing_a_delete_leaves_no_disk_copy(cfg_factory):
    """Write-back: a dirty block is copied to disk when evicted; deleted during that copy, the
    copy must not outlive the delete."""
    # per-block LRU: the chain's oldest block is the one copied down (prefix-aware: its tail)
    cfg = _big_cfg(cfg_factory, dram__capacity="16MiB", disk__write_mode="write-back", eviction__policy="lru")
    async with checked(await NodeStore.open(cfg)) as node:
        blocks = make_blocks(6, nbytes=8 * MiB, seed=4)
        await node.writer.put(blocks[:2])  # DRAM full, nothing on disk
        for (old, _), new in zip(blocks, blocks[2:]):
            put = asyncio.create_task(node.writer.put([new]))
            while not node.state.leases.held(old.key.raw):  # the eviction is copying it down
                await asyncio.sleep(0)
            assert await node.delete([old.key]) == [True]
            await put
            assert tiers_of(node, [old.key]) == [None], "the demotion brought it back"


async def test_a_write_back_block_deleted_while_leased_is_not_flushed_at_close(cfg_factory):
    cfg = cfg_factory(disk__write_mode="write-back", disk__sync=True)
    node = await NodeStore.open(cfg)
    blocks = make_blocks(2)
    await node.writer.put(blocks)
    key = blocks[0][0].key
    [lease] = await node.leaser.lease([key])
    assert await node.delete([key]) == [True]
    await node.close()  # the lease is still out: the block is deleted but still in DRAM
    async with checked(await NodeStore.open(cfg)) as node:
        assert tiers_of(node, [key, blocks[1][0].key]) == [None, "disk"], "a deleted block was flushed"


async def test_a_pin_racing_a_delete_does_not_outlive_it(cfg_factory):
    cfg = _big_cfg(cfg_factory)
    blocks = make_blocks(2, nbytes=1 * MiB, seed=5)
    async with checked(await on_disk_only(cfg, blocks)) as node:
        for h, _ in blocks:
            delete = asyncio.create_task(node.delete([h.key]))
            await asyncio.sleep(0)  # the disk delete is under way: the key is still indexed
            node.state.pin([h.key])  # pinned before the delete ends: the delete unpins it
            assert await delete == [True]
            assert tiers_of(node, [h.key]) == [None]
            node.check()  # no pin on a block that is gone
        assert node.inspector.stats()["node"]["pinned"] == 0


async def test_a_cancelled_delete_still_undoes_what_raced_it(cfg_factory):
    """Cancelled while its disk delete runs (which goes on): the delete still unpins what was
    pinned meanwhile and drops what a racing read promoted meanwhile."""
    cfg = _big_cfg(cfg_factory)
    blocks = make_blocks(4, nbytes=8 * MiB, seed=6)
    async with checked(await on_disk_only(cfg, blocks)) as node:
        for h, p in blocks:
            get = asyncio.create_task(node.reader.read([h.key], [bytearray(len(p))]))
            await asyncio.sleep(0)
            delete = asyncio.create_task(node.delete([h.key]))
            await asyncio.sleep(0)  # the disk delete is under way: the key is still indexed
            node.state.pin([h.key])
            delete.cancel()
            await asyncio.gather(get, delete, return_exceptions=True)
            await settle(node)  # the disk delete goes on after the cancel: await its end
            assert tiers_of(node, [h.key]) == [None], "a deleted block came back"
            node.check()  # no pin on a block that is gone
