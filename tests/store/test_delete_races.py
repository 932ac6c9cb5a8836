"""A delete racing a read, a write-through or a demotion of the same block: once delete has
returned, the block is gone from every tier -- no read's promotion brings its old bytes back
into memory, no disk write that was in flight leaves a copy behind. Real tiers (mmap DRAM,
LMDB in a tmp dir); the races are made likely with large payloads and repeated."""

from __future__ import annotations

import asyncio

from storeutil import make_blocks

from kvstore.node.store import NodeStore
from kvstore.results import Status

MiB = 1 << 20


def _big_cfg(cfg_factory, **kw):
    # 8 MiB blocks: a disk read copies and checksums long enough for a delete to overtake it
    base = dict(dram__capacity="64MiB", dram__slab_size="8MiB", disk__capacity="256MiB", disk__sync=True)
    base.update(kw)
    return cfg_factory(**base)


async def _on_disk_only(cfg, blocks) -> NodeStore:
    node = await NodeStore.open(cfg)
    await node.put(blocks)
    await node.close()
    node = await NodeStore.open(cfg)  # DRAM starts empty: every block is on disk only
    assert await node.contains([h.key for h, _ in blocks]) == ["disk"] * len(blocks)
    return node


async def test_a_get_racing_a_delete_does_not_promote_the_block_back(cfg_factory):
    cfg = _big_cfg(cfg_factory)
    blocks = make_blocks(8, nbytes=8 * MiB)
    node = await _on_disk_only(cfg, blocks)
    try:
        for h, p in blocks:
            buf = bytearray(len(p))
            get = asyncio.create_task(node.get_into([h.key], [buf]))
            await asyncio.sleep(0)  # the read is under way
            assert await node.delete([h.key]) == [True]
            [r] = await get
            if r.status is Status.HIT:  # read before the delete: the bytes, but not kept
                assert bytes(buf) == p
            assert await node.contains([h.key]) == [None], "a deleted block came back"
        assert node.stats()["tiers"]["dram"]["blocks"] == 0
        node.check()
    finally:
        await node.close()


async def test_a_get_racing_delete_and_rewrite_leaves_the_writer_its_key(cfg_factory):
    """Delete, then a new two-phase write of the key while an older read is still under way:
    the read's promotion must not slip the old copy in under the writer's reservation (its
    commit would find the key taken)."""
    cfg = _big_cfg(cfg_factory)
    blocks = make_blocks(8, nbytes=8 * MiB)
    node = await _on_disk_only(cfg, blocks)
    try:
        for h, p in blocks:
            get = asyncio.create_task(node.get_into([h.key], [bytearray(len(p))]))
            await asyncio.sleep(0)
            assert await node.delete([h.key]) == [True]
            [res] = await node.reserve([h])
            assert not isinstance(res, Status), f"the deleted key is not free to write: {res}"
            res.view[:] = p
            await get
            [pr] = await node.commit([res])
            assert pr.status is Status.STORED
        node.check()
    finally:
        await node.close()
