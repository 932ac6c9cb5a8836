"""A PUT's blocks reserved and committed as one batch give what reserving them one at a time
gives: the same statuses (EXISTS, BUSY, NO_SPACE), the same tiers and slots, the same
evictions and counters; a PUT's own blocks never evict each other; a key twice in one batch
is BUSY the second time; without ``make_room`` nothing is evicted; another tenant's key is
BUSY, never EXISTS."""

from __future__ import annotations

import pytest
from storeutil import checked, make_blocks, tiers_of

from kvstore.keys import Namespace
from kvstore.node.leases import Reservation
from kvstore.node.store import NodeStore
from kvstore.results import Status

KiB, MiB = 1 << 10, 1 << 20


def _outcome(res: list) -> list:
    return [x if isinstance(x, Status) else (x.tier, x.offset, x.view.nbytes) for x in res]


async def _scenario(node: NodeStore, one_at_a_time: bool, make_room: bool) -> tuple[list, list, dict]:
    old = make_blocks(10, seed=1)  # 10 x 256 KiB in 4 MiB of DRAM: 6 free slots left
    for h, p in old:
        [pr] = await node.writer.put([(h, p)])
        assert pr.status is Status.STORED
    [other] = await node.writer.reserve([make_blocks(1, seed=3)[0][0]])  # another writer's key
    new = make_blocks(12, seed=2)
    big = make_blocks(1, nbytes=2 * MiB, seed=4)  # over the 1 MiB slab: a private buffer for disk
    hdrs = [h for h, _ in new[:5]] + [old[2][0], new[1][0], other.header, big[0][0]]
    hdrs += [h for h, _ in new[5:]]
    payload = {h.key: p for h, p in new + old + big}
    if one_at_a_time:
        res = [(await node.writer.reserve([h], make_room=make_room))[0] for h in hdrs]
    else:
        res = await node.writer.reserve(hdrs, make_room=make_room)
    outcome = _outcome(res)
    todo = [r for r in res if isinstance(r, Reservation)]
    for r in todo:
        r.view[:] = payload[r.header.key]
    done = await node.writer.commit(todo)
    assert all(d.status is Status.STORED for d in done), done
    node.state.abort([other])
    where = tiers_of(node, [h.key for h, _ in old + new + big])
    counters = {k: v for k, v in node.state.counters.items() if k.startswith(("put", "evictions", "bytes"))}
    node.check()
    return outcome, where, counters


@pytest.mark.parametrize("make_room", [True, False])
@pytest.mark.parametrize("mode", ["write-through", "write-back"])
async def test_a_batch_reserves_what_one_block_at_a_time_reserves(cfg_factory, tmp_path, make_room, mode):
    got = []
    for one in (True, False):
        cfg = cfg_factory(
            dram__capacity="4MiB",
            disk__capacity="64MiB",
            disk__path=str(tmp_path / f"disk-{one}"),
            disk__write_mode=mode,
            eviction__policy="lru",
        )
        async with checked(await NodeStore.open(cfg)) as node:
            got.append(await _scenario(node, one, make_room))
    (one_res, one_where, one_counters), (batch_res, batch_where, batch_counters) = got
    assert batch_res == one_res
    assert batch_where == one_where
    assert batch_counters == one_counters
    # what the scenario is made of happened: EXISTS, BUSY (twice in the batch, another
    # writer's), a private buffer, and room made (or, without make_room, refused)
    assert batch_res[5] is Status.EXISTS and batch_res[6] is Status.BUSY and batch_res[7] is Status.BUSY
    assert batch_res[8][0] is None
    assert batch_counters["put_exists"] == 1
    evicted = batch_counters.get("evictions_dram", 0)
    if make_room:
        assert evicted >= 5 and all(t == "dram" for t, *_ in [batch_res[i] for i in (0, 1, 2, 3, 4, 9, 10)])
    else:
        assert evicted == 0
        assert [x[0] for x in batch_res[9:]] == [None] * 7  # past the free room: to disk


async def test_a_batch_bigger_than_the_free_room_never_evicts_its_own_blocks(cfg_factory):
    async with checked(await NodeStore.open(cfg_factory(dram__capacity="4MiB", disk__enabled=False))) as node:
        await node.writer.put(make_blocks(12, seed=1))
        new = make_blocks(16, seed=2)  # the whole tier: every old block must go, none of these
        res = await node.writer.put(new)
        assert [r.status for r in res] == [Status.STORED] * 16
        assert tiers_of(node, [h.key for h, _ in new]) == ["dram"] * 16
        more = await node.writer.put(make_blocks(1, seed=3))  # the tier is full of unheld blocks
        assert more[0].status is Status.STORED


async def test_another_tenants_key_in_a_batch_is_busy_never_exists(node):
    theirs = make_blocks(2, ns=Namespace("their-model", "float16", 4), seed=1)
    await node.writer.put(theirs)
    mine = make_blocks(2, seed=2)
    await node.writer.put(mine[:1])
    mine_ns = mine[0][0].namespace.raw
    res = await node.writer.reserve(
        [theirs[0][0], mine[0][0], mine[1][0], theirs[1][0]], sees=lambda ns: ns == mine_ns
    )
    assert res[0] is Status.BUSY and res[1] is Status.EXISTS and res[3] is Status.BUSY
    assert isinstance(res[2], Reservation)
    node.state.abort([res[2]])


async def test_a_commit_that_fails_part_way_gives_every_slot_back(cfg_factory, tmp_path):
    """A commit whose tier refuses its batch (here: one key was indexed in DRAM meanwhile, by
    a path outside the writer) raises, and every reservation it had taken out is given back:
    none is left neither reserved (so never expiring) nor indexed (so never evicted). Before,
    the reservations after the refused key kept their slots for ever."""
    cfg = cfg_factory(dram__capacity="4MiB", disk__capacity="64MiB", disk__path=str(tmp_path / "disk"))
    async with checked(await NodeStore.open(cfg)) as node:
        dram = node.stack.by_name["dram"]
        blocks = make_blocks(4, seed=7)
        res = await node.writer.reserve([h for h, _ in blocks])
        assert all(isinstance(r, Reservation) for r in res)
        for r, (_, p) in zip(res, blocks):
            r.view[:] = p
        before = dram.used_bytes
        # the third block's key is indexed in DRAM behind the writer's back
        h2, p2 = blocks[2]
        header = h2.encode()
        slot = dram.reserve(header, h2.payload_len)
        dram.fill(slot, p2)
        dram.commit(h2.key.raw, slot, len(header), h2.payload_len)
        with pytest.raises(ValueError, match="already indexed"):
            await node.writer.commit(res)
        # only the block committed behind the writer's back holds a slot now
        assert dram.used_bytes == before - sum(r.view.nbytes for r in res) + h2.payload_len
        assert tiers_of(node, [h.key for h, _ in blocks]) == [None, None, "dram", None]
        assert not node.state.leases.reserved_keys
