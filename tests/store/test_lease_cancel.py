"""A lease of a disk-only block reads it straight into a reserved DRAM slot on a disk reader
thread. When the lease is cancelled (a client gone, a handler cancelled) while that thread
is copying, the slot must not be given back before the copy ends: a new block reserved into
the same slot would get the old block's bytes written over its own (its commit fails the
checksum, or -- committed first -- a later DRAM hit returns the old block's bytes). Real
tiers; DRAM has room for exactly one more block, so a new reservation in DRAM takes the very
slot the cancelled lease reserved; a tiny GIL switch interval lets the main thread run
between the reader thread's start and its copy, as a busy machine does."""

from __future__ import annotations

import asyncio

from storeutil import make_blocks

from kvstore.node.store import NodeStore
from kvstore.results import Status

KiB = 1 << 10


async def test_a_cancelled_lease_does_not_free_its_slot_under_the_disk_read(cfg_factory, busy_gil):
    cfg = cfg_factory(dram__capacity="512KiB", dram__slab_size="256KiB", disk__capacity="256MiB")
    olds = make_blocks(200, nbytes=256 * KiB, seed=1)
    news = make_blocks(200, nbytes=256 * KiB, seed=2)
    node = await NodeStore.open(cfg)
    await node.writer.put(olds)
    await node.close()
    node = await NodeStore.open(cfg)  # DRAM empty: the old blocks are on disk only
    overwritten = []
    try:
        filler = make_blocks(1, nbytes=256 * KiB, seed=3)
        await node.writer.put(filler)
        node.state.pin([filler[0][0].key])  # DRAM's one other slot stays taken
        for (old, _), (new, new_p) in zip(olds, news):
            lease = asyncio.create_task(node.leaser.lease([old.key]))
            used = node.dram.used_bytes
            while node.dram.used_bytes == used and not lease.done():
                await asyncio.sleep(0)  # until the slot is reserved: the read into it is under way
            lease.cancel()
            await asyncio.gather(lease, return_exceptions=True)
            [res] = await node.writer.reserve([new])
            assert not isinstance(res, Status), res
            res.view[:] = new_p
            [pr] = await node.writer.commit([res])
            await asyncio.sleep(0.02)  # whatever the old read still had to copy is copied
            buf = bytearray(len(new_p))
            [got] = await node.reader.read([new.key], [buf])
            if pr.status is not Status.STORED or got.status is not Status.HIT or buf != new_p:
                overwritten.append((pr.status, got.status, got.tier))
            await node.delete([new.key])
        assert overwritten == [], "a new block's slot was written by a cancelled lease's read"
        node.check()
    finally:
        await asyncio.sleep(0.1)
        await node.close()
