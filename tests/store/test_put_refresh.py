"""A PUT of a block the node already holds (EXISTS) refreshes it as a read does, for the
tenant that may see it; another tenant's PUT of it (BUSY) changes nothing.

Why: on three nodes a chain's blocks live on different nodes, and one node evicting its block
cuts the chain for the others; the next request's PUT writes the cut block again and sends the
blocks below it to their owners, who already hold them. Counted as a use, those blocks stay
with the chain they belong to again (docs/eviction-policy.md, "Three nodes: one placement is
one draw", its paragraph "The PUT refresh": what it moved on the traces). Block counts only,
no timing."""

from __future__ import annotations

import pytest
from storeutil import checked, make_blocks, tiers_of

from kvstore.keys import Namespace
from kvstore.node.store import NodeStore
from kvstore.node.tiers.order import POLICIES
from kvstore.results import Status

KiB = 1 << 10
BLOCK = 256 * KiB  # 8 MiB of DRAM (the test config) holds 32 of them


def _singles(n: int, seed0: int, ns: Namespace | None = None):
    """``n`` one-block chains: each a root block, so every one is a leaf of its own."""
    return [make_blocks(1, nbytes=BLOCK, seed=seed0 + i, ns=ns)[0] for i in range(n)]


async def _stored(node: NodeStore, blocks) -> list[bool]:
    tiers = tiers_of(node, [h.key for h, _ in blocks])
    assert len(tiers) == len(blocks), tiers
    return [t is not None for t in tiers]


@pytest.mark.parametrize("policy", POLICIES)
async def test_a_put_of_a_stored_block_keeps_it_like_a_read(cfg_factory, policy):
    """32 blocks fill DRAM; block 0 is PUT again (EXISTS), then one more block comes: the
    oldest other block (1) goes, not 0. Before: 0, the oldest, went."""
    async with checked(
        await NodeStore.open(cfg_factory(disk__enabled=False, eviction__policy=policy))
    ) as node:
        old = _singles(32, 100)
        for b in old:
            assert [r.status for r in await node.writer.put([b])] == [Status.STORED]
        assert [r.status for r in await node.writer.put([old[0]])] == [Status.EXISTS]
        assert [r.status for r in await node.writer.put(_singles(1, 500))] == [Status.STORED]
        held = await _stored(node, old)
        assert held[0] and not held[1] and sum(held) == 31, held


async def test_another_tenants_put_refreshes_nothing(cfg_factory):
    """The same fill, but block 0 is PUT again by a tenant that may not see it (BUSY): block 0,
    the oldest, still goes first. Another tenant cannot keep a block alive, nor tell it is
    there."""
    async with checked(
        await NodeStore.open(cfg_factory(disk__enabled=False, eviction__policy="lru"))
    ) as node:
        mine_ns = Namespace("mine", "float16", 4)
        old = _singles(32, 100, ns=mine_ns)
        for b in old:
            assert [r.status for r in await node.writer.put([b])] == [Status.STORED]
        mine = mine_ns.id.raw
        h, _ = old[0]
        got = await node.writer.reserve([h], sees=lambda ns: ns != mine)
        assert got == [Status.BUSY]
        assert [r.status for r in await node.writer.put(_singles(1, 500, ns=mine_ns))] == [Status.STORED]
        held = await _stored(node, old)
        assert not held[0] and held[1] and sum(held) == 31, held
