"""A put or delete cancelled while its disk write runs (a handler cancelled with its client):
the write thread finishes what it started, so the disk tier's index and byte counts must
follow it -- not stay as they were while LMDB changed under them (a block on disk the index
does not know, bytes never counted; or a key the index still names and NodeStore still
reports present, whose data is gone). Real LMDB in a tmp dir."""

from __future__ import annotations

import asyncio

from storeutil import checked, make_blocks, settle, tiers_of

from kvstore.node.store import NodeStore

MiB = 1 << 20


async def _cancelled_after(call, passes: int) -> None:
    """Run ``call`` (a coroutine) for ``passes`` passes of the event loop, cancel it, await it."""
    task = asyncio.create_task(call)
    for _ in range(passes):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_cancelled_puts_and_deletes_leave_the_disk_index_true(cfg_factory):
    async with checked(await NodeStore.open(cfg_factory(dram__capacity=0, disk__capacity="1GiB"))) as node:
        blocks = make_blocks(10, nbytes=16 * MiB)
        for i, (h, p) in enumerate(blocks):
            await _cancelled_after(node.writer.put([(h, p)]), i % 4 + 1)
            await settle(node)  # the writer thread ends what it started
            node.check()
            if tiers_of(node, [h.key]) == [None]:
                continue
            await _cancelled_after(node.delete([h.key]), i % 3 + 1)
            await settle(node)  # the writer thread ends what it started
            node.check()
        st = node.inspector.stats()["tiers"]["disk"]
        stored = tiers_of(node, [h.key for h, _ in blocks])
        assert st["blocks"] == sum(t is not None for t in stored)
        assert st["payload_bytes"] == 16 * MiB * st["blocks"]
