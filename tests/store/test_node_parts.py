"""The node's parts over real tiers (mmap DRAM, LMDB in a tmp dir), each through its own
contract: the Evictor never moves held or pinned blocks and drops only clean ones when told
to; the disk tier's own eviction spares what the node protects; a leased disk block moves up
into DRAM read straight into its slot, never resurrecting a block deleted meanwhile; verify
finds a bad DRAM copy through the tier protocol."""

from __future__ import annotations

import asyncio

from storeutil import checked, make_blocks, on_disk_only, tiers_of

from kvstore.node.eviction import Evictor
from kvstore.node.state import NodeState
from kvstore.node.tiers.arena import HostArena
from kvstore.node.tiers.disk import DiskTier
from kvstore.node.tiers.memory import MemoryTier
from kvstore.node.tiers.stack import TierStack
from kvstore.node.tombstones import Tombstones
from kvstore.results import Status

KiB, MiB = 1 << 10, 1 << 20


async def _filled_dram(n: int):
    """A 2 MiB DRAM tier (1 MiB slabs) holding ``n`` 256 KiB blocks, oldest first."""
    tier = MemoryTier("dram", HostArena(2 * MiB, "false"), 1 * MiB)
    blocks = make_blocks(n)
    for h, p in blocks:
        assert await tier.put([(h.key.raw, h.encode(), p)]) == [True]
    return tier, blocks


def _evictor(tier, disk=None):
    tiers = TierStack([tier], disk)
    state = NodeState(tiers, 30.0, Tombstones())
    parts = dict(
        leases=state.leases,
        pinned=state.pinned,
        dirty=state.dirty,
        doomed=state.doomed,
        counters=state.counters,
    )
    return Evictor(tiers, state), parts


async def test_evictor_spares_held_and_pinned_blocks():
    tier, blocks = await _filled_dram(8)  # full: 8 x 256 KiB
    ev, parts = _evictor(tier)
    oldest, second = blocks[0][0].key.raw, blocks[1][0].key.raw
    parts["leases"].hold(oldest)
    parts["pinned"].add(second)
    h = make_blocks(1, seed=5)[0][0]
    assert await ev.make_room(tier, h.payload_len, len(h.encode()))
    assert oldest in tier and second in tier, "held and pinned blocks stay"
    assert blocks[2][0].key.raw not in tier, "the oldest unprotected block went"
    assert parts["counters"]["evictions_dram"] == 1 and parts["counters"]["dropped"] == 1
    # everything protected: no room, nothing moved
    for hh, _ in blocks:
        parts["pinned"].add(hh.key.raw)
    tier.reserve(h.encode(), h.payload_len)  # take the freed slot
    assert not await ev.make_room(tier, h.payload_len, len(h.encode()))
    assert len(tier) == 7
    tier.check()


async def test_evictor_without_io_drops_only_blocks_the_disk_holds(tmp_path):
    tier, blocks = await _filled_dram(8)
    disk = DiskTier(str(tmp_path / "disk"), 64 * MiB, sync=False)
    try:
        on_disk = blocks[3]
        await disk.put([(on_disk[0].key.raw, on_disk[0].encode(), on_disk[1])])
        ev, parts = _evictor(tier, disk)
        h = make_blocks(1, seed=5)[0][0]
        assert ev.room_without_io(tier, h.payload_len, len(h.encode()))
        assert on_disk[0].key.raw not in tier and len(tier) == 7, "only the clean block went"
        assert len(disk) == 1, "no write"
        # a dirty copy is not clean, whatever the disk holds
        parts["dirty"].add(blocks[4][0].key.raw)
        await disk.put([(blocks[4][0].key.raw, blocks[4][0].encode(), blocks[4][1])])
        tier.reserve(h.encode(), h.payload_len)
        assert not ev.room_without_io(tier, h.payload_len, len(h.encode()))
        assert blocks[4][0].key.raw in tier
    finally:
        await disk.close()


async def test_disk_eviction_spares_protected_keys(tmp_path):
    disk = DiskTier(str(tmp_path / "disk"), 1 * MiB + 8 * KiB, sync=False)
    try:
        blocks = make_blocks(6, nbytes=256 * KiB)
        keep = blocks[0][0].key.raw
        disk.protect(lambda k: k == keep)
        for h, p in blocks:
            assert await disk.put([(h.key.raw, h.encode(), p)]) == [True]
        assert keep in disk, "the protected oldest block survived"
        assert blocks[1][0].key.raw not in disk, "the next oldest made room"
        assert disk.used_bytes <= disk.capacity_bytes
        disk.check()
    finally:
        await disk.close()


async def test_leased_disk_block_moves_into_its_dram_slot(cfg_factory):
    blocks = make_blocks(2)
    async with checked(await on_disk_only(cfg_factory(disk__sync=True), blocks)) as node:
        assert tiers_of(node, [blocks[0][0].key]) == ["disk"]
        [lease] = await node.leaser.lease([blocks[0][0].key])
        assert lease.tier == "dram" and lease.offset is not None, "leased from its new DRAM slot"
        assert bytes(lease.view) == blocks[0][1]
        st = node.inspector.stats()["node"]
        assert st["promotions"] == 1 and st["hits_disk"] == 1 and st["get_hit"] == 1
        assert tiers_of(node, [blocks[0][0].key]) == ["dram"]
        node.state.release([lease])


async def test_a_block_deleted_while_its_lease_reads_disk_is_not_resurrected(cfg_factory):
    blocks = make_blocks(6)
    async with checked(await on_disk_only(cfg_factory(disk__sync=True), blocks)) as node:
        for h, p in blocks:
            lease, deleted = await asyncio.gather(node.leaser.lease([h.key]), node.delete([h.key]))
            assert deleted == [True]
            if lease[0] is not None:  # read before the delete: the bytes, but not kept
                assert bytes(lease[0].view) == p
                node.state.release(lease)
            assert tiers_of(node, [h.key]) == [None], "a deleted block came back"
        node.check()
        assert node.inspector.stats()["tiers"]["dram"]["blocks"] == 0


async def test_verify_finds_and_repairs_a_bad_dram_copy(node):
    blocks = make_blocks(3)
    await node.writer.put(blocks)
    key = blocks[1][0].key
    node.dram.payload_host(key.raw)[7] ^= 0xFF  # flip a byte of the copy in place
    rep = await node.inspector.verify()
    assert rep["corrupt"] == [f"{key.hex}@dram"] and rep["checked"] == 6  # dram + disk copies
    rep = await node.inspector.verify([key], repair=True)
    assert rep["dropped"] == 1
    assert tiers_of(node, [key]) == ["disk"], "the disk copy is intact and stays"
    got = await node.reader.read([key], [bytearray(blocks[1][0].payload_len)])
    assert got[0].status is Status.HIT
