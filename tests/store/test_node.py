"""The node store over real tiers (mmap DRAM + LMDB in a tmp dir): placement, LRU eviction
down the stack, capacity, leases, pins, write modes, corruption, restart."""

from __future__ import annotations

import asyncio

import pytest
from storeutil import checked, make_blocks, on_disk_only, remade, tiers_of

from kvstore.node.store import NodeStore
from kvstore.results import Expect, Status

KiB, MiB = 1 << 10, 1 << 20


def _bufs(blocks):
    return [bytearray(h.payload_len) for h, _ in blocks]


def _keys(blocks):
    return [h.key for h, _ in blocks]


async def _read_all(node, blocks, expect=True):
    bufs = _bufs(blocks)
    exp = [Expect(h.parent, h.token_bytes) for h, _ in blocks] if expect else None
    res = await node.reader.read(_keys(blocks), bufs, exp)
    return res, bufs


async def test_roundtrip_and_exists(node):
    blocks = make_blocks(6)
    res = await node.writer.put(blocks)
    assert [r.status for r in res] == [Status.STORED] * 6
    assert all(r.tier == "dram" for r in res)
    assert [r.status for r in await node.writer.put(blocks[:2])] == [Status.EXISTS] * 2
    got, bufs = await _read_all(node, blocks)
    assert [g.status for g in got] == [Status.HIT] * 6
    assert all(bytes(b) == p for b, (_, p) in zip(bufs, blocks))
    assert tiers_of(node, _keys(blocks)) == ["dram"] * 6


async def test_invalid_payload_is_refused(node):
    ((h, p),) = make_blocks(1)
    bad = bytearray(p)
    bad[5] ^= 1
    assert (await node.writer.put([(h, bad)]))[0].status is Status.INVALID
    assert (await node.writer.put([(h, p[:-1])]))[0].status is Status.INVALID
    assert tiers_of(node, [h.key]) == [None]


async def test_mismatch_and_small_buffer(node):
    blocks = make_blocks(2)
    await node.writer.put(blocks)
    (h0, _), (h1, _) = blocks
    res = await node.reader.read([h1.key], [bytearray(h1.payload_len)], [Expect(parent=h1.key)])
    assert res[0].status is Status.MISMATCH, "wrong parent must be a miss"
    res = await node.reader.read([h1.key], [bytearray(h1.payload_len)], [Expect(token_bytes=h0.token_bytes)])
    assert res[0].status is Status.MISMATCH, "wrong tokens must be a miss"
    res = await node.reader.read([h1.key], [bytearray(10)])
    assert res[0].status is Status.BUF_TOO_SMALL


async def test_lru_eviction_moves_down_then_drops(cfg_factory):
    # 4 MiB DRAM of 1 MiB slabs holds 16 blocks of 256 KiB (headers beside the index); disk ~24
    # per-block LRU (a chain's head goes first); prefix-aware orders: test_eviction_policy.py
    async with checked(
        await NodeStore.open(
            cfg_factory(dram__capacity="4MiB", disk__capacity="6MiB", eviction__policy="lru")
        )
    ) as node:
        blocks = make_blocks(40)
        for h, p in blocks:  # one at a time: a clear LRU order
            assert (await node.writer.put([(h, p)]))[0].status is Status.STORED
        where = tiers_of(node, _keys(blocks))
        assert where[-1] == "dram" and where[0] is None, where
        # LRU order: dropped < disk < dram, never interleaved
        rank = {None: 0, "disk": 1, "dram": 2}
        assert [rank[w] for w in where] == sorted(rank[w] for w in where)
        st = node.inspector.stats()["tiers"]
        assert st["dram"]["used_bytes"] <= st["dram"]["capacity_bytes"]
        assert st["disk"]["used_bytes"] <= st["disk"]["capacity_bytes"]
        assert st["disk"]["evictions"] > 0
        # touching an old DRAM block protects it from the next evictions
        oldest_dram = where.index("dram")
        await node.reader.read([blocks[oldest_dram][0].key], [bytearray(256 * KiB)])
        await node.writer.put(make_blocks(3, seed=9))
        assert (tiers_of(node, [blocks[oldest_dram][0].key]))[0] == "dram"


async def test_lease_blocks_eviction_and_overwrite(cfg_factory):
    async with checked(await NodeStore.open(cfg_factory(dram__capacity="2MiB", disk__enabled=False))) as node:
        blocks = make_blocks(4)
        await node.writer.put(blocks)  # 256 KiB payloads: 4 fill the payload slab, headers take the other
        leases = await node.leaser.lease([blocks[0][0].key])
        view = leases[0].view
        before = bytes(view)
        assert leases[0].tier == "dram" and leases[0].offset is not None
        # a storm of new blocks cannot evict the leased one
        for h, p in make_blocks(10, seed=3):
            await node.writer.put([(h, p)])
        assert (tiers_of(node, [blocks[0][0].key]))[0] == "dram"
        assert bytes(view) == before == blocks[0][1]
        # deleting it hides it at once but frees the slot only at release
        assert await node.delete([blocks[0][0].key]) == [True]
        assert tiers_of(node, [blocks[0][0].key]) == [None]
        assert bytes(view) == before
        node.state.release(leases)
        node.check()
        assert node.inspector.stats()["node"]["leases_active"] == 0


async def test_all_pinned_means_no_space(cfg_factory):
    # per-block LRU: unpinned, the chain's head may go (a prefix-aware order keeps a parent)
    async with checked(
        await NodeStore.open(cfg_factory(dram__capacity="2MiB", disk__enabled=False, eviction__policy="lru"))
    ) as node:
        blocks = make_blocks(8)  # 2 MiB of 256 KiB payloads (headers live beside the index)
        await node.writer.put(blocks)
        assert node.state.pin(_keys(blocks)) == [True] * 8
        res = await node.writer.put(make_blocks(1, seed=5))
        assert res[0].status is Status.NO_SPACE
        assert tiers_of(node, _keys(blocks)) == ["dram"] * 8
        node.state.unpin(_keys(blocks[:1]))
        res = await node.writer.put(make_blocks(1, seed=5))
        assert res[0].status is Status.STORED
        assert tiers_of(node, _keys(blocks)) == [None] + ["dram"] * 7


async def test_lease_expires(cfg_factory):
    async with checked(await NodeStore.open(cfg_factory(node__lease_ttl_s=0.05))) as node:
        blocks = make_blocks(1)
        await node.writer.put(blocks)
        await node.leaser.lease(_keys(blocks))
        assert node.state.leases.held(blocks[0][0].key.raw)
        await asyncio.sleep(0.1)
        await node.leaser.lease([])  # any call sweeps
        assert not node.state.leases.held(blocks[0][0].key.raw)
        assert node.inspector.stats()["node"]["leases_expired"] == 1


async def test_two_phase_write(node):
    ((h, p),) = make_blocks(1)
    [r] = await node.writer.reserve([h])
    assert tiers_of(node, [h.key]) == [None], "a reservation is invisible"
    assert (await node.writer.reserve([h]))[0] is Status.BUSY
    r.view[:] = p
    [res] = await node.writer.commit([r])
    assert res.status is Status.STORED and res.durable is False  # sync off in the fixture
    assert (await node.writer.commit([r]))[0].status is Status.INVALID, "a second commit is refused"
    # a reservation whose bytes do not match its checksum is refused and freed
    ((h2, p2),) = make_blocks(1, seed=7)
    [r2] = await node.writer.reserve([h2])
    r2.view[:] = bytes(len(p2))
    assert (await node.writer.commit([r2]))[0].status is Status.INVALID
    assert tiers_of(node, [h2.key]) == [None]
    # abort gives the slot back
    [r3] = await node.writer.reserve([h2])
    node.state.abort([r3])
    node.state.abort([r3])
    assert node.inspector.stats()["node"]["reservations_active"] == 0


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
async def test_restart_keeps_blocks(cfg_factory, mode):
    cfg = cfg_factory(disk__write_mode=mode, disk__sync=True)
    node = await NodeStore.open(cfg)
    blocks = make_blocks(8)
    res = await node.writer.put(blocks)
    assert [r.durable for r in res] == [mode == "write-through"] * len(blocks)
    await node.close()  # write-back flushes here
    async with checked(await NodeStore.open(cfg)) as node:
        assert tiers_of(node, _keys(blocks)) == ["disk"] * 8
        got, bufs = await _read_all(node, blocks)
        assert [g.status for g in got] == [Status.HIT] * 8
        assert all(bytes(b) == p for b, (_, p) in zip(bufs, blocks))
        assert tiers_of(node, _keys(blocks)) == ["dram"] * 8, "disk hits are promoted"


async def test_write_back_reaches_disk_on_eviction(cfg_factory):
    async with checked(
        await NodeStore.open(cfg_factory(dram__capacity="2MiB", disk__write_mode="write-back"))
    ) as node:
        blocks = make_blocks(14)  # DRAM holds 8
        for b in blocks:
            await node.writer.put([b])
        assert len(node.disk) >= 6  # evicted blocks were written down, not lost
        assert node.inspector.stats()["node"].get("dropped", 0) == 0
        got, bufs = await _read_all(node, blocks)
        assert [g.status for g in got] == [Status.HIT] * len(blocks)
        assert all(bytes(b) == p for b, (_, p) in zip(bufs, blocks))


async def test_corrupt_disk_block_is_a_miss_and_dropped(cfg_factory):
    blocks = make_blocks(3, nbytes=64 * KiB)
    async with checked(
        await on_disk_only(cfg_factory(dram__capacity=0, disk__sync=True), blocks, flip=blocks[1][1][:4096])
    ) as node:
        got, bufs = await _read_all(node, blocks)
        assert [g.status for g in got] == [Status.HIT, Status.CORRUPT, Status.HIT]
        assert tiers_of(node, _keys(blocks)) == ["disk", None, "disk"], "bad copy dropped"
        assert node.inspector.stats()["node"]["checksum_failures"] == 1
        assert node.inspector.stats()["tiers"]["disk"]["checksum_failures"] == 1


async def test_verify_and_repair(cfg_factory):
    blocks = make_blocks(4, nbytes=64 * KiB)
    async with checked(
        await on_disk_only(cfg_factory(dram__capacity=0, disk__sync=True), blocks, flip=blocks[2][1][:4096])
    ) as node:
        rep = await node.inspector.verify()
        assert (
            rep["checked"] == 4 and rep["corrupt"] == [f"{blocks[2][0].key.hex}@disk"] and rep["dropped"] == 0
        )
        assert (tiers_of(node, [blocks[2][0].key]))[0] == "disk", "verify alone changes nothing"
        rep = await node.inspector.verify(repair=True)
        assert rep["dropped"] == 1
        assert (tiers_of(node, [blocks[2][0].key]))[0] is None


async def test_listing_and_describe(node):
    a = make_blocks(3)
    from kvstore.keys import Namespace

    other = Namespace("other-model", "float16", 4)
    b = make_blocks(2, ns=other, seed=4)
    await node.writer.put(a + b)
    whole = await node.inspector.page()
    listed = whole.blocks
    assert whole.next is None
    assert len(listed) == 5 and [i.key.raw for i in listed] == sorted(i.key.raw for i in listed)
    only = (await node.inspector.page(namespace=other.id)).blocks
    assert {i.key for i in only} == {h.key for h, _ in b}
    page1 = await node.inspector.page(limit=2)
    assert page1.next == page1.blocks[-1].key  # the cursor is the key that filled the page
    page2 = await node.inspector.page(after=page1.next, limit=10)
    assert [i.key for i in page1.blocks + page2.blocks] == [i.key for i in listed] and page2.next is None
    h, info = await node.inspector.describe(a[0][0].key)
    assert h == a[0][0] and info.tiers == ("dram", "disk") and info.num_tokens == 4
    with pytest.raises(ValueError, match="tier 'tape'"):
        await node.inspector.page(tier="tape")


async def test_blocks_bigger_than_a_slab_go_to_disk(node):
    big = 2 * MiB  # slab is 1 MiB in the fixture
    ((h, p),) = make_blocks(1, nbytes=big)
    res = await node.writer.put([(h, p)])
    assert res[0].status is Status.STORED and res[0].tier == "disk"
    got = await node.reader.read([h.key], [bytearray(big)])
    assert got[0].status is Status.HIT


async def test_concurrent_writers_and_readers(node):
    blocks = make_blocks(60, nbytes=64 * KiB)

    async def writer(part):
        for b in part:
            r = await node.writer.put([b])
            assert r[0].status in (Status.STORED, Status.EXISTS)

    await asyncio.gather(*(writer(blocks[i::4]) for i in range(4)), writer(blocks))
    got, bufs = await _read_all(node, blocks)
    assert [g.status for g in got] == [Status.HIT] * len(blocks)
    assert all(bytes(b) == p for b, (_, p) in zip(bufs, blocks))


async def test_header_of_other_block_under_key_is_mismatch(node):
    """A stale or colliding entry: the key is stored, but for other tokens."""
    ((h, p),) = make_blocks(1)
    forged = remade(h, p, tokens=[9, 9, 9, 9])
    await node.writer.put([(forged, p)])
    res = await node.reader.read([h.key], [bytearray(len(p))], [Expect(h.parent, h.token_bytes)])
    assert res[0].status is Status.MISMATCH
