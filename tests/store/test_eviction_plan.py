"""A disk put plans all its victims in one pass over the eviction order: a chain on probation
(written, never read) must go whole, tail first, before blocks read again -- the order counts
each victim of the pass as gone, so the chain's parent follows its children -- and a victim the
tier refuses (held) keeps its whole prefix. A block the tier above demotes is no ghost hit.
Real LMDB in a temporary directory, block counts only, no timing."""

from __future__ import annotations

import pytest
from storeutil import checked, make_blocks

from kvstore.node.tiers.disk import DiskTier
from kvstore.node.tiers.order import POLICIES, make_order

KiB, MiB = 1 << 10, 1 << 20
PREFIX_POLICIES = [p for p in POLICIES if p != "lru"]


def _triples(blocks):
    return [(h.key.raw, h.encode(), p) for h, p in blocks]


async def _disk_of(tmp_path, policy: str, blocks: int, block_bytes: int, protected=lambda k: False):
    order = make_order(policy, marks_orphans=False)  # below the top tier, as the node builds it
    return DiskTier(
        str(tmp_path / "disk"),
        blocks * block_bytes + 64,
        map_size=64 * MiB,
        sync=False,
        order=order,
        protected=protected,
    )


async def _setup(disk: DiskTier):
    """Four one-block chains (hot), a chain of 8 never read (cold), then the hot ones read:
    12 blocks, the disk full."""
    hot = [make_blocks(1, nbytes=16 * KiB, seed=100 + i) for i in range(4)]
    cold = make_blocks(8, nbytes=16 * KiB, seed=7)
    for b in hot:
        assert await disk.put(_triples(b)) == [True]
    assert await disk.put(_triples(cold)) == [True] * 8
    for b in hot:
        got = await disk.get_into([b[0][0].key.raw], [bytearray(16 * KiB)])
        assert len(got) == 1 and got[0][0].ok
    return [b[0] for b in hot], cold


def _block_bytes() -> int:
    h, p = make_blocks(1, nbytes=16 * KiB, seed=1)[0]
    return len(h.encode()) + len(p)


@pytest.mark.parametrize("policy", POLICIES)
async def test_one_put_evicts_a_cold_chain_whole_before_blocks_read_again(tmp_path, policy):
    """Before the plan counted its victims as gone, the prefix orders yielded the cold chain's
    tail only (its one leaf), then the hot blocks: a put of 8 evicted 7 hot-or-cold blocks
    in the wrong order and kept an unreadable chain."""
    async with checked(await _disk_of(tmp_path, policy, 12, _block_bytes())) as disk:
        hot, cold = await _setup(disk)
        new = make_blocks(8, nbytes=16 * KiB, seed=8)
        assert await disk.put(_triples(new)) == [True] * 8
        assert [h.key.raw in disk for h, _ in hot] == [True] * 4, "a block read again went first"
        assert [h.key.raw in disk for h, _ in cold] == [False] * 8


@pytest.mark.parametrize("policy", PREFIX_POLICIES)
async def test_a_held_victim_keeps_its_whole_prefix(tmp_path, policy):
    """The cold chain's tail is held: none of its ancestors may go in the same plan (a parent
    never before its stored children); the put takes what else there is and stores less."""
    held: set[bytes] = set()
    async with checked(
        await _disk_of(tmp_path, policy, 12, _block_bytes(), protected=lambda k: k in held)
    ) as disk:
        hot, cold = await _setup(disk)
        held.add(cold[-1][0].key.raw)
        new = make_blocks(8, nbytes=16 * KiB, seed=9)
        stored = await disk.put(_triples(new))
        assert len(stored) == 8 and sum(stored) == 4, stored  # the four hot blocks made room
        assert [h.key.raw in disk for h, _ in cold] == [True] * 8
        assert [h.key.raw in disk for h, _ in hot] == [False] * 4


@pytest.mark.parametrize("policy", ["prefix-2q", "prefix-arc", "prefix-marginal"])
def test_a_demoted_block_is_not_a_ghost_hit(policy):
    """A key this tier evicted comes back: from a client's write it is a ghost hit (it skips
    probation); from the tier above (a demotion) it is not, and its ghost is forgotten."""
    order = make_order(policy, marks_orphans=False)
    for i in range(4):
        order.add(bytes([i]), None)
    order.discard(b"\x00")
    order.add(b"\x00", None, demoted=True)
    assert order.stats()["ghost_hits"] == 0
    assert b"\x00" in order._on_probation
    order.discard(b"\x01")
    order.add(b"\x01", None)
    assert order.stats()["ghost_hits"] == 1
    assert b"\x01" not in order._on_probation
