"""Eviction policies on a real node (``[eviction] policy``): prefix awareness (a chain is
evicted from its tail; a block whose parent went goes first), scan resistance, demotion in
the same order, and the invariants every policy keeps: leased, pinned and in-flight blocks
stay put. Block counts only, no timing."""

from __future__ import annotations

import pytest
from storeutil import checked, make_blocks, tiers_of

from kvstore.config import ConfigError
from kvstore.keys import Namespace
from kvstore.node.store import NodeStore
from kvstore.node.tiers.order import POLICIES
from kvstore.results import Status

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 256 * KiB  # 8 MiB of DRAM (the test config) holds 32 of them
PREFIX_POLICIES = [p for p in POLICIES if p != "lru"]


def _dram_only(cfg_factory, policy: str, **kw):
    return cfg_factory(disk__enabled=False, eviction__policy=policy, **kw)


async def _put_in_batches(node: NodeStore, blocks, batch: int = 4) -> None:
    for i in range(0, len(blocks), batch):
        res = await node.writer.put(blocks[i : i + batch])
        assert len(res) == len(blocks[i : i + batch]) and all(r.status is Status.STORED for r in res), res


async def _stored(node: NodeStore, blocks) -> list[bool]:
    tiers = tiers_of(node, [h.key for h, _ in blocks])
    assert len(tiers) == len(blocks), tiers  # one answer per key: all() over them means something
    return [t is not None for t in tiers]


def _is_prefix(flags: list[bool]) -> bool:
    n = flags.index(False) if False in flags else len(flags)
    return not any(flags[n:])


@pytest.mark.parametrize("policy", POLICIES)
async def test_a_chain_is_evicted_from_its_tail(cfg_factory, policy):
    """Chain A (20 blocks), then chain B (20): 8 must go. Prefix-aware policies keep a prefix
    of A; per-block LRU drops A's head and keeps a tail that can never hit."""
    async with checked(await NodeStore.open(_dram_only(cfg_factory, policy))) as node:
        a = make_blocks(20, nbytes=BLOCK, seed=1)
        b = make_blocks(20, nbytes=BLOCK, seed=2)
        await _put_in_batches(node, a)
        await _put_in_batches(node, b)
        held_a, held_b = await _stored(node, a), await _stored(node, b)
        assert sum(held_a) + sum(held_b) == 32
        if policy == "lru":
            assert not held_a[0] and held_a[-1], "per-block LRU drops the head first"
        else:
            assert _is_prefix(held_a) and sum(held_a) == 12, held_a
            assert all(held_b)


@pytest.mark.parametrize("policy", PREFIX_POLICIES)
async def test_a_block_whose_parent_was_evicted_goes_first(cfg_factory, policy):
    """A chain longer than the tier: its tail keeps evicting its own parent, so each new
    tail block is an orphan here. The next write evicts the orphan, not the chain's prefix."""
    async with checked(await NodeStore.open(_dram_only(cfg_factory, policy))) as node:
        a = make_blocks(40, nbytes=BLOCK, seed=3)
        await _put_in_batches(node, a, batch=1)
        held = await _stored(node, a)
        assert held[-1] and not held[-2], "the last block was stored after its parent went"
        assert _is_prefix(held[:-1]) and sum(held) == 32
        [other] = make_blocks(1, nbytes=BLOCK, seed=4)
        await _put_in_batches(node, [other])
        assert await _stored(node, a) == [True] * 31 + [False] * 9, "the orphan goes first"
        assert node.inspector.stats()["tiers"]["dram"]["orphans_stored"] >= 1


@pytest.mark.parametrize("policy", ["prefix-2q", "prefix-arc", "prefix-marginal"])
async def test_a_scan_does_not_flush_a_prefix_read_again(cfg_factory, policy):
    """A 6-block prefix read back twice, then a one-off scan of 60 blocks never read: the
    scan-resistant policies keep the prefix; per-block LRU (checked alongside) loses it."""
    for pol, kept in ((policy, True), ("lru", False)):
        async with checked(await NodeStore.open(_dram_only(cfg_factory, pol))) as node:
            hot = make_blocks(6, nbytes=BLOCK, seed=5)
            await _put_in_batches(node, hot)
            bufs = [bytearray(BLOCK) for _ in hot]
            for _ in range(2):
                got = await node.reader.read([h.key for h, _ in hot], bufs)
                assert len(got) == len(hot) and all(g.status is Status.HIT for g in got)
            for seed in range(60):  # one-block prompts, each its own chain
                await _put_in_batches(node, make_blocks(1, nbytes=BLOCK, seed=1000 + seed))
            assert all(await _stored(node, hot)) is kept, pol


@pytest.mark.parametrize("policy", PREFIX_POLICIES)
async def test_demotion_to_disk_takes_the_same_order(cfg_factory, policy):
    """DRAM (32 blocks) over a disk, write-back so that eviction is what moves blocks down:
    DRAM keeps a prefix of A; the tail it let go is on disk, nothing is lost."""
    cfg = cfg_factory(eviction__policy=policy, disk__write_mode="write-back")
    async with checked(await NodeStore.open(cfg)) as node:
        a = make_blocks(20, nbytes=BLOCK, seed=6)
        b = make_blocks(20, nbytes=BLOCK, seed=7)
        await _put_in_batches(node, a)
        await _put_in_batches(node, b)
        tiers = tiers_of(node, [h.key for h, _ in a])
        in_dram = [t == "dram" for t in tiers]
        assert _is_prefix(in_dram) and sum(in_dram) == 12, tiers
        assert len(tiers) == len(a) and all(t == "disk" for t in tiers[12:]), tiers
        assert node.state.counters["demotions"] == 8


@pytest.mark.parametrize("policy", PREFIX_POLICIES)
async def test_the_disk_does_not_take_a_block_for_an_orphan_whose_parent_is_in_dram(cfg_factory, policy):
    """Write-through: chain A (10 blocks) is read from DRAM (which leaves its disk copies
    cold), and 12 other blocks push A's tail off a disk of 16. A's next block, written
    through, has its parent in DRAM: it can still hit, so the disk must not store it as an
    orphan (first to go); only the node's top tier knows a parent is gone."""
    cfg = cfg_factory(eviction__policy=policy, disk__capacity=int(16.5 * BLOCK))
    async with checked(await NodeStore.open(cfg)) as node:
        a = make_blocks(11, nbytes=BLOCK, seed=12)
        await _put_in_batches(node, a[:10])
        got = await node.reader.read([h.key for h, _ in a[:10]], [bytearray(BLOCK) for _ in range(10)])
        assert all(g.status is Status.HIT for g in got)
        for seed in range(12):
            await _put_in_batches(node, make_blocks(1, nbytes=BLOCK, seed=6000 + seed))
        disk = node.inspector.stats()["tiers"]["disk"]
        assert disk["blocks"] <= 16 and (tiers_of(node, [a[9][0].key])) == ["dram"], disk
        await _put_in_batches(node, a[10:])
        assert node.inspector.stats()["tiers"]["disk"]["orphans_stored"] == 0
        assert node.inspector.stats()["tiers"]["dram"]["orphans_stored"] == 0


@pytest.mark.parametrize("policy", POLICIES)
async def test_leased_and_pinned_blocks_are_never_evicted(cfg_factory, policy):
    """A leased leaf and a pinned leaf (each the first victim of any policy) stay, whole,
    while three times the tier is written after them."""
    async with checked(await NodeStore.open(_dram_only(cfg_factory, policy))) as node:
        leased, pinned = make_blocks(1, nbytes=BLOCK, seed=8), make_blocks(1, nbytes=BLOCK, seed=9)
        await _put_in_batches(node, leased + pinned)
        [lease] = await node.leaser.lease([leased[0][0].key], ttl_s=300)
        assert node.state.pin([pinned[0][0].key]) == [True]
        for seed in range(96):
            await _put_in_batches(node, make_blocks(1, nbytes=BLOCK, seed=2000 + seed))
        assert await _stored(node, leased + pinned) == [True, True]
        assert bytes(lease.view) == leased[0][1]
        node.state.release([lease])


@pytest.mark.parametrize("policy", POLICIES)
async def test_a_block_in_flight_stays_past_its_lease_ttl(cfg_factory, policy):
    """A lease whose bytes are being sent (begin_transfer) cannot expire, so its slot is not
    evicted or reused however much is written, until end_transfer."""
    import asyncio

    async with checked(await NodeStore.open(_dram_only(cfg_factory, policy))) as node:
        blk = make_blocks(1, nbytes=BLOCK, seed=10)
        await _put_in_batches(node, blk)
        [lease] = await node.leaser.lease([blk[0][0].key], ttl_s=0.05)
        assert node.state.begin_transfer([lease]) == [True]
        await asyncio.sleep(0.1)  # past the TTL: only the transfer keeps it
        for seed in range(96):
            await _put_in_batches(node, make_blocks(1, nbytes=BLOCK, seed=3000 + seed))
        assert bytes(lease.view) == blk[0][1], "the slot was reused under a transfer"
        assert await _stored(node, blk) == [True]
        node.state.end_transfer([lease])
        node.state.release([lease])


@pytest.mark.parametrize("share", [0.0, 0.25])
async def test_one_tenants_scan_keeps_off_another_tenants_share(cfg_factory, share):
    """Tenant A holds 6 blocks (under a quarter of the tier) and reads them; tenant B (another
    namespace: another salt) writes 100 one-off blocks. With shares A keeps all 6; without,
    B's scan flushes them."""
    base = Namespace("test-model", "float16", 4)
    ns_a, ns_b = base.with_tenant("tenant-a"), base.with_tenant("tenant-b")
    async with checked(
        await NodeStore.open(_dram_only(cfg_factory, "lru", eviction__tenant_share=share))
    ) as node:
        a = make_blocks(6, nbytes=BLOCK, seed=11, ns=ns_a)
        await _put_in_batches(node, a)
        for seed in range(100):
            await _put_in_batches(node, make_blocks(1, nbytes=BLOCK, seed=4000 + seed, ns=ns_b))
        assert all(await _stored(node, a)) is (share > 0)
        dram = node.inspector.stats()["tiers"]["dram"]
        assert (dram["share_refusals"] > 0) is (share > 0)


async def test_a_newcomer_takes_room_from_tenants_richer_than_itself(cfg_factory):
    """Shares never lock a tier: with every namespace under its share, a new tenant still
    gets room (from those that hold more than it does)."""
    base = Namespace("test-model", "float16", 4)
    async with checked(
        await NodeStore.open(_dram_only(cfg_factory, "lru", eviction__tenant_share=0.5))
    ) as node:
        for t in range(4):  # four tenants of 8 blocks: each a quarter, under the 0.5 share
            await _put_in_batches(
                node, make_blocks(8, nbytes=BLOCK, seed=5000 + t, ns=base.with_tenant(f"t{t}"))
            )
        new = make_blocks(4, nbytes=BLOCK, seed=5100, ns=base.with_tenant("newcomer"))
        await _put_in_batches(node, new)
        assert all(await _stored(node, new))


def test_an_unknown_policy_is_refused_by_name(cfg_factory):
    with pytest.raises(ConfigError, match="eviction.policy"):
        cfg_factory(eviction__policy="mru")
    with pytest.raises(ConfigError, match="eviction.tenant_share"):
        cfg_factory(eviction__tenant_share=1.5)
