"""A read marks its blocks used deepest first (kvstore/node/leasing.py): of one GET's blocks
the chain's head is the most recently used, so on every node a chain read together leaves
from its tail, as a PUT's blocks do (kvstore/node/depth_order.py). On three nodes a node holds
a chain's blocks in runs, each run's parent elsewhere: each run's head is a leaf there, and
touched in key order it was the oldest of the GET, the node's first victim, cutting the chain
for the other nodes (docs/eviction-policy.md, "A GET touches deepest first"). The simulation
(bench/trace_sim.py ``SimNode.get``) touches the same way; tests/store/test_sim_matches_node.py
checks them together."""

from __future__ import annotations

import pytest
from storeutil import checked, make_blocks, tiers_of

from kvstore.keys import KeyBatch
from kvstore.node.store import NodeStore
from kvstore.results import Status

FILLERS = 30  # DRAM holds 32 blocks of 256 KiB


async def _store_a_split_chain(node: NodeStore) -> tuple[list, list]:
    """Blocks 0 and 2 of a chain (block 1 is on another node, as rendezvous placement spreads a
    chain: both are leaves here), then ``FILLERS`` one-block chains; DRAM is full. Returns
    ([block 0, block 2], the fillers)."""
    chain = make_blocks(3, seed=1)
    split = [chain[0], chain[2]]
    fillers = [make_blocks(1, seed=100 + i)[0] for i in range(FILLERS)]
    for blocks in ([split[0]], [split[1]], fillers):
        assert all(r.status is Status.STORED for r in await node.writer.put(blocks))
    return split, fillers


async def _get(node: NodeStore, blocks: list) -> None:
    got = await node.reader.read([h.key for h, _ in blocks], [bytearray(h.payload_len) for h, _ in blocks])
    assert [r.status for r in got] == [Status.HIT] * len(blocks)


async def _where_after_one_more_block(node: NodeStore, split: list) -> list[str | None]:
    """A new block needs room: where the two blocks are afterwards."""
    assert [r.status for r in await node.writer.put(make_blocks(1, seed=999))] == [Status.STORED]
    return tiers_of(node, [h.key for h, _ in split])


@pytest.mark.parametrize("policy", ["lru", "prefix-lru", "prefix-marginal"])
async def test_a_gets_deepest_block_goes_before_its_head(cfg_factory, policy):
    """One GET reads blocks 0 and 2, then the fillers are read, then a new block needs room:
    block 2 goes, block 0 stays."""
    async with checked(
        await NodeStore.open(cfg_factory(disk__enabled=False, eviction__policy=policy))
    ) as node:
        split, fillers = await _store_a_split_chain(node)
        await _get(node, split)
        await _get(node, fillers)
        assert await _where_after_one_more_block(node, split) == ["dram", None]


async def test_a_packed_get_touches_deepest_first_too(cfg_factory):
    """The daemon's streamed GET leases a batch as one packed lease: the same order."""
    async with checked(
        await NodeStore.open(cfg_factory(disk__enabled=False, eviction__policy="lru"))
    ) as node:
        split, fillers = await _store_a_split_chain(node)
        p = await node.leaser.lease_packed(KeyBatch.of([h.key for h, _ in split]))
        assert len(p.keys) == 2
        node.state.release([p])
        await _get(node, fillers)
        assert await _where_after_one_more_block(node, split) == ["dram", None]
