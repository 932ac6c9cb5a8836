"""Leases that end must take all their holds with them, however they end.

A held block is never evicted, and one deleted while held stays hidden until its last hold
goes: a hold left behind by a lease that ended keeps the block in memory for good (a
deleted one doomed for good). Two ways a lease could end and leave holds behind: a packed
lease that lapses (and is swept) while one of its disk blocks is read, then takes memory
blocks after a disk read that failed; and a read cancelled during a later key's disk read,
after its memory keys were leased. Real NodeStore over real DRAM and LMDB tiers."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from storeutil import checked, make_blocks, on_disk_only, settle, tiers_of

from kvstore.client.local import LocalClient
from kvstore.keys import KeyBatch
from kvstore.node.store import NodeStore
from kvstore.results import Status

MiB = 1 << 20


@contextlib.asynccontextmanager
async def _disk_then_dram(cfg_factory, corrupt: bool):
    """A node with block ``a`` on disk only (its payload corrupt when ``corrupt``) and block
    ``b`` in DRAM: ``(node, a, b)``, the node checked and closed as ``storeutil.checked``'s."""
    cfg = cfg_factory(
        dram__capacity="32MiB", dram__slab_size="16MiB", disk__capacity="256MiB", disk__sync=True
    )
    [a] = make_blocks(1, nbytes=8 * MiB, seed=11)
    [b] = make_blocks(1, nbytes=64 * 1024, seed=12)
    async with checked(await on_disk_only(cfg, [a], flip=a[1][:4096] if corrupt else None)) as node:
        await node.writer.put([b])
        assert tiers_of(node, [a[0].key, b[0].key]) == ["disk", "dram"]
        yield node, a, b


async def _sweeping_until(node: NodeStore, task: asyncio.Future) -> None:
    """Another caller's sweeps, on every turn of the loop until ``task`` is done."""
    while not task.done():
        node.state.sweep()
        await asyncio.sleep(0)


async def test_a_packed_lease_swept_during_a_failed_disk_read_takes_no_holds(cfg_factory):
    async with _disk_then_dram(cfg_factory, corrupt=True) as (node, a, b):
        task = asyncio.ensure_future(node.leaser.lease_packed(KeyBatch.of([a[0].key, b[0].key]), ttl_s=1e-9))
        await _sweeping_until(node, task)
        p = task.result()
        assert not node.state.is_live(p), "the lease lapsed and was swept during the disk read"
        node.state.release([p])  # what its holder does on finding it not live
        assert not node.state.leases.held(b[0].key.raw), "a swept packed lease left a hold on a DRAM block"
        await node.delete([b[0].key])
        assert b[0].key.raw not in node.state.doomed, "the deleted block stays doomed for good"


@pytest.mark.parametrize("how", ["cancel", "wait_for"])
async def test_a_read_cancelled_during_a_disk_read_releases_its_memory_leases(cfg_factory, how):
    async with _disk_then_dram(cfg_factory, corrupt=False) as (node, a, b):
        keys = [b[0].key, a[0].key]  # the DRAM block first, leased before the disk read starts
        bufs = [bytearray(len(b[1])), bytearray(len(a[1]))]
        if how == "cancel":
            task = asyncio.ensure_future(node.reader.read(keys, bufs))
            while not node.state.leases.held(b[0].key.raw):
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(node.reader.read(keys, bufs), 1e-4)
        assert not node.state.leases.held(b[0].key.raw), "a cancelled read left its DRAM lease held"
        assert node.state.leases.leases == {}, "a cancelled read left leases in the table"
        await settle(node)  # the abandoned disk read is over


async def test_a_lease_cancelled_during_a_disk_read_releases_its_memory_leases(cfg_factory):
    async with _disk_then_dram(cfg_factory, corrupt=False) as (node, a, b):
        task = asyncio.ensure_future(node.leaser.lease([b[0].key, a[0].key], ttl_s=3600))
        while not node.state.leases.held(b[0].key.raw):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not node.state.leases.held(b[0].key.raw), "a cancelled lease call left its DRAM lease held"
        await settle(node)


async def test_check_finds_a_hold_no_lease_or_copy_accounts_for(node):
    blocks = make_blocks(1)
    await node.writer.put(blocks)
    k = blocks[0][0].key.raw
    [lease] = await node.leaser.lease([blocks[0][0].key])
    node.check()
    node.state.leases.holds[k] += 1  # a hold left behind: nothing would ever drop it
    with pytest.raises(AssertionError, match="holds for 1 live leases and 0 copies"):
        node.check()
    node.state.leases.holds[k] -= 1
    node.state.release([lease])
    node.check()
    assert not node.state.leases.held(k)


async def test_a_local_client_read_past_its_deadline_holds_nothing(tmp_path):
    client = LocalClient(str(tmp_path), dram_capacity=128 * MiB, disk_capacity=256 * MiB, disk_sync=True)
    [a] = make_blocks(1, nbytes=8 * MiB, seed=11)
    [b] = make_blocks(1, nbytes=64 * 1024, seed=12)
    node = await NodeStore.open(client.store_cfg)
    await node.writer.put([a])
    await node.close()
    await client.start()  # DRAM empty: ``a`` is on disk only
    try:
        node = client.node
        await node.writer.put([b])
        bufs = [bytearray(len(b[1])), bytearray(len(a[1]))]
        r = await client.read([b[0].key, a[0].key], bufs, deadline_s=1e-4)  # past it in the disk read
        assert [x.status for x in r.results] == [Status.ERROR, Status.ERROR]
        r.release()
        assert not node.state.leases.held(b[0].key.raw), "a read past its deadline left its DRAM lease held"
        await settle(node)
        node.check()
    finally:
        await client.close()
