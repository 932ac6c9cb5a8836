"""A reservation that waits for room (write-back: making room writes dirty blocks to disk)
while the same key is written, leased and deleted by others: the key is then held and
hidden, so the waiting writer gets BUSY (as it would have before waiting), never a slot
whose commit finds the key still indexed."""

from __future__ import annotations

import asyncio

from storeutil import checked, make_blocks, remade

from kvstore.node.store import NodeStore
from kvstore.results import Status

KiB, MiB = 1 << 10, 1 << 20


async def test_a_reservation_waiting_for_room_sees_the_key_deleted_while_held(cfg_factory):
    cfg = cfg_factory(dram__capacity="4MiB", dram__slab_size="1MiB", disk__write_mode="write-back")
    async with checked(await NodeStore.open(cfg)) as node:
        big = make_blocks(3, nbytes=1 * MiB, seed=1)  # dirty, one slab each
        await node.writer.put(big)
        # + a 64 KiB class slab, newer than the big blocks (one PUT would index it first: it
        # is a run of its own, and a PUT's last run goes in first, kvstore/node/depth_order.py)
        await node.writer.put(make_blocks(1, nbytes=64 * KiB, seed=2))
        [(h, p)] = make_blocks(1, nbytes=1 * MiB, seed=3)
        small = b"s" * (64 * KiB)
        h_small = remade(h, small)
        waiting = asyncio.create_task(node.writer.reserve([h]))  # evicts a dirty block: a disk write
        while not any(node.state.leases.held(b.key.raw) for b, _ in big):
            await asyncio.sleep(0)
        # meanwhile the key is written (a free 64 KiB slot: no wait), leased and deleted
        [pr] = await node.writer.put([(h_small, small)])
        assert pr.status is Status.STORED and pr.tier == "dram"
        [lease] = await node.leaser.lease([h.key])
        assert await node.delete([h.key]) == [True]
        [res] = await waiting
        if not isinstance(res, Status):  # a slot: its commit must not fail
            res.view[:] = p
            [pr] = await node.writer.commit([res])
            assert pr.status is Status.STORED
        else:
            assert res is Status.BUSY
        node.state.release([lease])
