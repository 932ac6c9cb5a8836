"""A lease carries its block's header bytes as the node stores them, so a daemon reply
forwards them without decoding and encoding again (issue 14), for memory and disk copies."""

from __future__ import annotations

from storeutil import make_blocks

from kvstore.block import BlockHeader
from kvstore.node.store import NodeStore


async def test_leases_carry_the_stored_header_bytes(cfg_factory):
    node = await NodeStore.open(cfg_factory(dram__capacity="4MiB", dram__slab_size="1MiB"))
    blocks = make_blocks(3, nbytes=4096, seed=11)
    await node.writer.put(blocks)
    leases = await node.leaser.lease([h.key for h, _ in blocks])
    for lease, (h, p) in zip(leases, blocks):
        assert lease.tier == "dram"
        assert lease.raw_header == h.encode() and BlockHeader.decode(lease.raw_header) == lease.header
        assert bytes(lease.view) == p
    node.state.release(leases)
    await node.close()


async def test_disk_only_leases_carry_the_header_bytes_too(cfg_factory):
    node = await NodeStore.open(cfg_factory(dram__capacity=0))
    blocks = make_blocks(2, nbytes=4096, seed=12)
    await node.writer.put(blocks)
    leases = await node.leaser.lease([h.key for h, _ in blocks])
    for lease, (h, p) in zip(leases, blocks):
        assert lease.tier == "disk" and lease.raw_header == h.encode() and bytes(lease.view) == p
    node.state.release(leases)
    await node.close()
