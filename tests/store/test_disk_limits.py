"""The disk tier's index packs a header's length in 20 bits: a longer header (possible through
the in-process API, which takes any BlockHeader) must be refused like the memory tiers refuse
it, not stored with a length that overflows into the payload length -- that left the disk's
byte accounting wrong for good after the block was deleted, and the block was dropped
unreadable at the next open although it had been reported stored."""

from __future__ import annotations

from storeutil import checked, make_blocks, remade, tiers_of

from kvstore.node.store import NodeStore
from kvstore.node.tiers.disk import DiskTier
from kvstore.node.tiers.index import MAX_HEADER_LEN
from kvstore.results import Status

KiB = 1 << 10


async def test_a_header_too_long_for_the_index_is_refused(cfg_factory):
    async with checked(await NodeStore.open(cfg_factory(dram__capacity=0))) as node:
        [(h, p)] = make_blocks(1, nbytes=64 * KiB)
        tokens = list(range(MAX_HEADER_LEN // 4 + 1000))  # int32 ids: over MAX_HEADER_LEN bytes
        long = remade(h, p, tokens=tokens)
        assert len(long.encode()) > MAX_HEADER_LEN
        [pr] = await node.writer.put([(long, p)])
        assert pr.status is Status.NO_SPACE
        assert tiers_of(node, [h.key]) == [None]
        [pr] = await node.writer.put([(h, p)])  # an ordinary header still goes in
        assert pr.status is Status.STORED
        assert await node.delete([h.key]) == [True]
        st = node.inspector.stats()["tiers"]["disk"]
        assert st["used_bytes"] == 0 and st["payload_bytes"] == 0 and st["blocks"] == 0


async def test_a_key_twice_in_one_disk_put_is_stored_and_counted_once(tmp_path):
    disk = DiskTier(str(tmp_path / "disk"), 64 * 1024 * KiB, sync=False)
    try:
        [(h, p)] = make_blocks(1, nbytes=64 * KiB)
        item = (h.key.raw, h.encode(), p)
        assert await disk.put([item, item]) == [True, True]
        assert disk.used_bytes == len(p) + len(item[1]) and disk.payload_bytes == len(p)
        assert await disk.delete([h.key.raw]) == [True]
        assert disk.used_bytes == 0 and disk.payload_bytes == 0 and len(disk) == 0
        disk.check()
    finally:
        await disk.close()
