"""Cluster lookups (kvstore/client/lookup.py): the cached rendezvous orders equal placement's,
stay bounded and follow the view; miss hints save the second round trip of a partly cached
prompt looked up again without changing any answer; a node's share of a long prompt goes
out as parallel requests of at most MAX_BATCH keys. Real daemons on loopback."""

from __future__ import annotations

import asyncio
import random

import pytest
from cluster.static_cluster import dram_cluster
from storeutil import make_blocks, write_all

from kvstore.client.cluster import ClusterClient, ClusterConfig
from kvstore.client.config import ClientConfig
from kvstore.client.lookup import MissHints
from kvstore.client.node import NodeClient
from kvstore.client.placement import Node, RankCache, rank
from kvstore.keys import BlockKey, KeyBatch, Namespace
from kvstore.protocol import MAX_BATCH
from kvstore.results import Status

NS = Namespace("lookup-test", "uint8", 4)
FAST = ClientConfig(namespaces=(NS,), op_timeout_s=2.0, connect_timeout_s=1.0, probe_interval_s=0.1)
# no latency ejections: the view (and so each key's owners) stays the same on a busy host
CFG = ClusterConfig(replicas=2, lookahead=1, probe_interval_s=0.1, outlier_factor=1e6)


def raws(n: int, seed: int) -> list[bytes]:
    rnd = random.Random(seed)
    return [rnd.randbytes(16) for _ in range(n)]


@pytest.mark.parametrize("zones", [False, True])
def test_cluster_rank_cache_orders_are_placements(zones):
    rnd = random.Random(3)
    view = [
        Node(f"10.0.0.{i}:7000", rnd.uniform(0.5, 4.0), rnd.choice("ab") if zones else "") for i in range(6)
    ]
    keys = raws(3000, 4)
    rc = RankCache(1000)
    rc.reset(view, 3)
    for part in (keys[:500], keys, keys[100:700]):  # misses, hits, old-generation hits
        codes = rc.codes(part)
        assert [rc.orders[c] for c in codes] == [tuple(n.id for n in rank(k, view, 3)) for k in part]
        assert len(rc) <= 1000
    assert rc.order(keys[7]) == tuple(n.id for n in rank(keys[7], view, 3))
    rc.reset(view[1:], 3)  # a node left: every order is recomputed over the new view
    assert len(rc) == 0
    assert rc.order(keys[7]) == tuple(n.id for n in rank(keys[7], view[1:], 3))
    with pytest.raises(ValueError, match="max_entries"):
        RankCache(1)


def test_cluster_miss_hints_are_bounded_and_forget_found_keys():
    h = MissHints(4)
    ks = raws(6, 5)
    h.note(ks, [0, 1, 2], [])
    assert h.among(ks).tolist() == [0, 1, 2]
    h.note(ks, [], [1])  # an owner holds it again
    assert h.among(ks).tolist() == [0, 2]
    h.note(ks, [3, 4, 5], [])  # past the bound: starts over
    assert len(h) <= 4 and h.among(ks).tolist() == [3, 4, 5]


async def test_cluster_hinted_lookup_takes_one_round_and_answers_the_same(start_daemon):
    ds, c = await dram_cluster(start_daemon, 3, FAST, CFG, 5.0)
    blocks = make_blocks(24, 1024, seed=61, ns=NS)
    await write_all(c, blocks[:12], 5.0)
    view = [c._weights[a] for a in sorted(d.addr for d in ds)]
    (h, p) = blocks[12]  # on its third-ranked node only (its owners changed)
    n = NodeClient(rank(h.key.raw, view, 2)[2].id, FAST)
    assert (await n.put([(h, p)]))[0].status is Status.STORED
    await n.close()
    keys = [b.key for b, _ in blocks]
    want = ["dram"] * 13 + [None] * 11

    assert (await c.lookup(keys, 5.0)).names() == want  # owners first, then the third nodes
    assert c.counters["lookup_second_rounds"] == 1
    asked = c.counters["lookup_keys_asked"]
    assert (await c.lookup(keys, 5.0)).names() == want  # the 12 misses hinted: asked in round 1
    assert c.counters["lookup_second_rounds"] == 1
    assert c.counters["lookup_keys_asked"] - asked == 2 * 24 + 12  # the same keys asked
    assert (await c.lookup(keys, 5.0)).hit_blocks == 13

    # stored on their owners now: found there, dropped from the hints, still one round
    await write_all(c, blocks[13:], 5.0)
    assert (await c.lookup(keys, 5.0)).names() == ["dram"] * 24
    assert len(c._lookups.hints) == 1  # the block its owners do not hold
    assert (await c.lookup(keys, 5.0)).names() == ["dram"] * 24
    assert c.counters["lookup_second_rounds"] == 1
    await c.close()


async def test_cluster_long_lookup_splits_each_nodes_keys(start_daemon):
    """More than MAX_BATCH keys for a node go out as even parallel requests; answers in order."""
    ds, c = await dram_cluster(start_daemon, 3, FAST, CFG, 5.0)
    blocks = make_blocks(8, 1024, seed=62, ns=NS)
    await write_all(c, blocks, 5.0)
    keys = [BlockKey(r) for r in raws(2 * MAX_BATCH, 7)]
    where = sorted(random.Random(8).sample(range(len(keys)), len(blocks)))
    for i, (h, _) in zip(where, blocks):
        keys[i] = h.key
    got = (await c.lookup(keys, 10.0)).names()
    assert [i for i, t in enumerate(got) if t is not None] == where
    assert all(got[i] == "dram" for i in where)
    per_node = {d.addr: c.nodes[d.addr].counters["exists_keys"] for d in ds}
    assert max(per_node.values()) > MAX_BATCH  # some node got more than one request's worth
    await c.close()


async def test_cluster_lookups_keep_their_view_and_ranking_while_it_changes(start_daemon):
    """Issue #23: the view changes (members leave and come back) many times while lookups
    are in their rounds. Each lookup keeps the view and ranking it started with: none raises
    (before: IndexError in the second round, its codes indexing a cache another call had
    rebuilt, or KeyError for a node gone since), and every answer is right."""
    ds = [start_daemon(use_disk=False) for _ in range(4)]
    addrs = sorted(d.addr for d in ds)
    c = ClusterClient.static(addrs, FAST, CFG)
    await c.start(5.0)
    blocks = make_blocks(48, 256, seed=71, ns=NS)
    for a in addrs:  # on every node: whatever view a lookup started with, its owners hold them
        n = NodeClient(a, FAST)
        assert [r.status for r in await n.put(blocks)] == [Status.STORED] * len(blocks)
        await n.close()
    present = [h.key for h, _ in blocks]
    members = list(c.membership.members)
    assert len(members) == 4
    rnd = random.Random(72)
    changes = 0
    running = True

    async def churn():
        nonlocal changes
        while running:
            # the membership source announcing a change, as etcd's watch does
            c.membership._set(rnd.sample(members, rnd.choice([2, 3, 4])))
            changes += 1
            await asyncio.sleep(rnd.choice([0, 0, 0.001, 0.003]))

    async def lookups(seed: int) -> int:
        r = random.Random(seed)
        done = 0
        for _ in range(25):
            absent = [BlockKey(r.randbytes(16)) for _ in range(40)]  # fresh: a second round each time
            keys = present + absent
            order = list(range(len(keys)))
            r.shuffle(order)
            got = (await c.lookup([keys[i] for i in order], 5.0)).names()
            want = ["dram" if i < len(present) else None for i in order]
            assert got == want
            done += 1
        return done

    flipper = asyncio.ensure_future(churn())
    try:
        counts = await asyncio.gather(*(lookups(s) for s in range(6)))
    finally:
        running = False
        await flipper
    assert counts == [25] * 6
    assert changes >= 50, changes
    assert c.counters["lookup_second_rounds"] >= 30  # views of 2 nodes have no second round
    await c.close()


def test_a_ranking_outlives_a_cache_reset():
    """The nodes a lookup asks come from the ranking it started with, after any reset."""
    view = [Node(f"10.0.0.{i}:7000") for i in range(4)]
    keys = KeyBatch(b"".join(raws(500, 9)))
    rc = RankCache(1 << 12)
    rc.reset(view, 2)
    ranking = rc.ranking(keys)
    rc.reset(view[:2], 2)
    rc.ranking(keys[:50])  # another call fills the new tables
    for lo, hi in ((0, 2), (2, 3)):
        groups = ranking.groups(None, lo, hi)
        want: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            for node in rank(k.raw, view, 2)[lo:hi]:
                want.setdefault(node.id, []).append(i)
        assert {a: g.tolist() for a, g in groups.items()} == want
        assert sum(len(g) for g in want.values()) == 500 * (hi - lo)
