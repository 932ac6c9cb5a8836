"""The node's state has one owner (issue 21): NodeState's check() fails on each broken
invariant it states; the node's one copying read is lease -> copy -> release (nothing stays
held after it, a disk hit says tier disk); a packed lease (the
streamed GET's, issue 18) holds a batch as one: one release ends it, it is never expired in
transfer, a block deleted under it is freed at its release, another tenant's keys and reads
past the disk budget are left out of it."""

from __future__ import annotations

import asyncio

import pytest
from storeutil import checked, make_blocks, on_disk_only, tiers_of

from kvstore.keys import KeyBatch
from kvstore.node.store import NodeStore
from kvstore.results import Status


def _batch(blocks) -> KeyBatch:
    return KeyBatch.of([h.key for h, _ in blocks])


async def test_check_fails_on_each_broken_invariant(node):
    blocks = make_blocks(2)
    await node.writer.put(blocks)
    st, k = node.state, blocks[0][0].key.raw
    node.check()
    st.doomed.add(k)  # doomed but not held: its last release never comes
    with pytest.raises(AssertionError, match="doomed"):
        st.check()
    st.doomed.discard(k)
    st.pinned.add(b"\x01" * 16)  # pinned but not stored
    with pytest.raises(AssertionError, match="pinned"):
        st.check()
    st.pinned.clear()
    [lease] = await node.leaser.lease([blocks[0][0].key])
    st.leases.holds[k] -= 1  # a lease without its hold
    with pytest.raises(AssertionError):
        st.check()
    st.leases.holds[k] += 1
    st.release([lease])
    st.leases.moving[12345] += 1  # a transfer mark on nothing live
    with pytest.raises(AssertionError, match="transfer"):
        st.check()
    del st.leases.moving[12345]
    node.check()


async def test_the_copying_read_is_lease_copy_release(cfg_factory):
    blocks = make_blocks(3)
    async with checked(await on_disk_only(cfg_factory(disk__sync=True), blocks)) as node:
        bufs = [bytearray(h.payload_len) for h, _ in blocks]
        got = await node.reader.read([h.key for h, _ in blocks], bufs)
        assert [g.status for g in got] == [Status.HIT] * 3
        assert [g.tier for g in got] == ["disk"] * 3, "a disk hit says disk, wherever it moved"
        assert [bytes(b) for b in bufs] == [p for _, p in blocks]
        assert not node.state.leases.leases and not node.state.leases.holds, "nothing stays held"
        got = await node.reader.read([h.key for h, _ in blocks], bufs)
        assert [g.tier for g in got] == ["dram"] * 3, "promoted by the first read"
        small = await node.reader.read([blocks[0][0].key], [bytearray(10)])
        assert small[0].status is Status.BUF_TOO_SMALL


async def test_a_packed_lease_holds_the_batch_and_ends_as_one(node):
    blocks = make_blocks(4)
    await node.writer.put(blocks)
    absent = make_blocks(1, seed=9)
    p = await node.leaser.lease_packed(_batch([*blocks[:2], *absent, *blocks[2:]]))
    assert p.at == [0, 1, 3, 4], "the absent key is not in it"
    assert [bytes(v) for v in p.views] == [b for _, b in blocks]
    assert p.headers == [h.encode() for h, _ in blocks], "the stored headers, as stored"
    lt = node.state.leases
    assert len(lt.leases) == 1 and all(lt.held(h.key.raw) for h, _ in blocks)
    assert node.inspector.stats()["node"]["hit_tokens_dram"] == 4 * blocks[0][0].num_tokens
    node.check()
    node.state.release([p])
    node.state.release([p])  # idempotent
    assert not lt.leases and not lt.holds
    node.check()


async def test_a_packed_lease_in_transfer_never_expires(cfg_factory):
    async with checked(await NodeStore.open(cfg_factory(node__lease_ttl_s=0.05))) as node:
        blocks = make_blocks(2)
        await node.writer.put(blocks)
        p = await node.leaser.lease_packed(_batch(blocks))
        assert node.state.begin_transfer([p]) == [True]
        await asyncio.sleep(0.1)
        node.state.sweep()
        assert node.state.is_live(p), "expired under its transfer"
        node.state.end_transfer([p])
        await asyncio.sleep(0.1)
        node.state.sweep()
        assert not node.state.is_live(p) and not node.state.leases.holds
        assert node.inspector.stats()["node"]["leases_expired"] == 1
        assert node.state.begin_transfer([p]) == [False], "a lapsed lease is never moved"


async def test_a_block_deleted_under_a_packed_lease_is_freed_at_its_release(node):
    blocks = make_blocks(2)
    await node.writer.put(blocks)
    p = await node.leaser.lease_packed(_batch(blocks))
    assert await node.delete([blocks[0][0].key]) == [True]
    assert tiers_of(node, [blocks[0][0].key]) == [None], "hidden at once"
    assert bytes(p.views[0]) == blocks[0][1], "its bytes stay put while leased"
    assert blocks[0][0].key.raw in node.dram
    node.check()
    node.state.release([p])
    assert blocks[0][0].key.raw not in node.dram and not node.state.doomed
    node.check()


async def test_a_packed_lease_leaves_out_other_tenants_and_reads_past_the_budget(cfg_factory):
    cfg = cfg_factory(dram__capacity=0, disk__sync=True)
    async with checked(await NodeStore.open(cfg)) as node:
        blocks = make_blocks(3)
        await node.writer.put(blocks)
        mine = blocks[0][0].namespace.raw
        p = await node.leaser.lease_packed(_batch(blocks), sees=lambda ns: ns != mine)
        assert p.at == [] and not node.state.leases.holds
        assert node.inspector.stats()["node"].get("get_hit", 0) == 0, "no disk read for them"
        node.state.release([p])
        budget = blocks[0][0].payload_len * 2
        p = await node.leaser.lease_packed(_batch(blocks), max_read_bytes=budget)
        assert p.at == [0, 1] and [bytes(v) for v in p.views] == [b for _, b in blocks[:2]]
        assert node.inspector.stats()["node"]["lease_over_bound"] == 1
        node.check()
        node.state.release([p])
        assert not node.state.leases.holds


async def test_a_packed_lease_cancelled_during_a_disk_read_holds_nothing(cfg_factory):
    blocks = make_blocks(2)
    async with checked(await on_disk_only(cfg_factory(disk__sync=True), blocks)) as node:
        [fresh] = make_blocks(1, seed=7)
        await node.writer.put([fresh])  # in DRAM: held first, then the disk reads
        task = asyncio.create_task(node.leaser.lease_packed(_batch([fresh, *blocks])))
        while not node.state.leases.holds and not task.done():
            await asyncio.sleep(0)
        assert not task.done(), "it holds the DRAM block while the disk is read"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()
        await asyncio.sleep(0.1)  # the disk read it left ends
        assert not node.state.leases.leases and not node.state.leases.holds, "held until its TTL"
