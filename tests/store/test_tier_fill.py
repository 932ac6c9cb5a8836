"""Tiers that use what they are given: a DRAM tier under a mix of block sizes fills (slabs
move between size classes), and an LMDB map that fills up evicts instead of failing writes.

Fill is measured in bytes of payload held / capacity, with no timing: deterministic."""

from __future__ import annotations

import os
import random

from storeutil import checked, make_blocks

from kvstore.node.store import NodeStore
from kvstore.node.tiers.disk import DiskTier
from kvstore.results import Status

KiB, MiB = 1 << 10, 1 << 20

# The soak's mix scaled down 8x: slabs of 4 MiB, 8 of them, blocks of 8 KiB .. 512 KiB (the
# issue measured 32 MiB slabs, 8 of them, blocks of 64 KiB .. 4 MiB). Each phase is a set of
# models (one block size each) in use at once; the set changes from phase to phase.
PHASES = [
    [8 * KiB, 32 * KiB, 128 * KiB, 512 * KiB],
    [12 * KiB, 48 * KiB, 192 * KiB],
    [16 * KiB, 64 * KiB, 256 * KiB, 384 * KiB, 512 * KiB],
]


def _mixed_blocks(nbytes: int, seed: int, sizes: list[int]):
    """Blocks of the given sizes in random order, ``nbytes`` of payload in all."""
    rnd = random.Random(seed)
    out, total, i = [], 0, 0
    while total < nbytes:
        size = rnd.choice(sizes)
        out += make_blocks(1, nbytes=size, seed=seed * 100_000 + i)
        total, i = total + size, i + 1
    return out


async def test_dram_fills_under_mixed_block_sizes(cfg_factory):
    async with checked(
        await NodeStore.open(cfg_factory(dram__capacity="32MiB", dram__slab_size="4MiB", disk__enabled=False))
    ) as node:
        dram = node.dram
        fills = []
        for phase, sizes in enumerate(PHASES):  # each phase writes 2x the capacity
            for h, p in _mixed_blocks(64 * MiB, phase + 1, sizes):
                [r] = await node.writer.put([(h, p)])
                assert r.status is Status.STORED, r
            node.check()
            fills.append(dram.payload_bytes / dram.capacity_bytes)
        assert min(fills) >= 0.9, fills
        assert dram.slab_moves > 0, "the mix changed: slabs must have moved between classes"
        st = node.inspector.stats()["tiers"]["dram"]
        assert st["waste_bytes"] == st["used_bytes"] - st["payload_bytes"] + st["free_slot_bytes"]
        assert st["used_bytes"] <= st["capacity_bytes"]


async def test_full_lmdb_map_evicts_and_keeps_accepting_writes(tmp_path):
    # capacity says there is room; the map (the file's bound) runs out first
    path = str(tmp_path / "disk")
    disk = DiskTier(path, 256 * MiB, map_size=8 * MiB, sync=False)
    try:
        blocks = make_blocks(40, nbytes=512 * KiB)
        stored = []
        for h, p in blocks:
            [ok] = await disk.put([(h.key.raw, h.encode(), p)])
            stored.append(ok)
            assert os.path.getsize(f"{path}/data.mdb") <= 8 * MiB
        assert len(stored) == len(blocks) and all(stored), stored
        assert disk.write_errors == 0
        assert disk.stats()["map_full_evictions"] > 0
        # the newest blocks are there and intact; the oldest made room
        h, p = blocks[-1]
        buf = bytearray(len(p))
        [(st, _)] = await disk.get_into([h.key.raw], [buf])
        assert st is Status.HIT and bytes(buf) == p
        assert blocks[0][0].key.raw not in disk
        disk.check()
    finally:
        await disk.close()


async def test_spans_with_held_slots_never_move(cfg_factory):
    # 4 MiB of 1 MiB slabs = 32 pages of 128 KiB; a 64 KiB class span is one page of 2 slots
    async with checked(
        await NodeStore.open(
            # per-block LRU, so that the small chain's spans are the oldest (a prefix-aware order
            # keeps its parents, and no span could move)
            cfg_factory(
                dram__capacity="4MiB", dram__slab_size="1MiB", disk__enabled=False, eviction__policy="lru"
            )
        )
    ) as node:
        small = make_blocks(7, nbytes=64 * KiB, seed=1)  # the reservation below shares a span
        await node.writer.put(small)
        [lease] = await node.leaser.lease([small[0][0].key])
        assert lease is not None and lease.tier == "dram"
        [moving] = await node.leaser.lease([small[1][0].key])
        assert node.state.begin_transfer([moving]) == [True]
        (rh, rp), *_ = make_blocks(1, nbytes=64 * KiB, seed=2)
        [res] = await node.writer.reserve([rh])
        assert not isinstance(res, Status)
        # a flood of another class: every other span must move to it
        big = make_blocks(60, nbytes=128 * KiB, seed=3)
        for b in big:
            await node.writer.put([b])
        assert node.dram.slab_moves > 0
        assert bytes(lease.view) == small[0][1], "a leased slot was reused"
        assert bytes(moving.view) == small[1][1], "a slot under transfer was reused"
        res.view[:] = rp
        [c] = await node.writer.commit([res])
        assert c.status is Status.STORED
        node.state.end_transfer([moving])
        node.state.release([lease, moving])
        node.check()
        # every block DRAM holds reads back as committed
        held = [b for b in [*small, (rh, rp), *big] if b[0].key.raw in node.dram]
        assert small[0][0].key.raw in node.dram and (rh.key.raw in node.dram)
        got, bufs = await _read(node, held)
        assert [g.status for g in got] == [Status.HIT] * len(held)
        assert all(bytes(buf) == p for buf, (_, p) in zip(bufs, held))


async def _read(node, blocks):
    bufs = [bytearray(h.payload_len) for h, _ in blocks]
    return await node.reader.read([h.key for h, _ in blocks], bufs), bufs


async def test_lmdb_file_stays_bounded_under_mixed_size_churn(tmp_path):
    # blocks of several sizes written and evicted many times over: freed page runs fragment,
    # and the file may grow only up to the map
    path = str(tmp_path / "disk")
    disk = DiskTier(path, 12 * MiB, map_size=16 * MiB, sync=False)
    rnd = random.Random(5)
    try:
        sizes = [64 * KiB, 96 * KiB, 256 * KiB, 384 * KiB, 1 * MiB]
        written = 0
        for i in range(300):
            [(h, p)] = make_blocks(1, nbytes=rnd.choice(sizes), seed=10_000 + i)
            [ok] = await disk.put([(h.key.raw, h.encode(), p)])
            assert ok, f"write {i} refused: {disk.stats()}"
            written += len(p)
            assert os.path.getsize(f"{path}/data.mdb") <= 16 * MiB
        assert written > 5 * 16 * MiB  # the churn went through the map several times
        assert disk.write_errors == 0
        assert disk.used_bytes <= disk.capacity_bytes
        disk.check()
    finally:
        await disk.close()
