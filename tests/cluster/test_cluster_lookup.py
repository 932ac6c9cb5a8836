"""Cluster lookups (kvstore/client/lookup.py): the cached rendezvous orders equal placement's,
stay bounded and follow the view; miss hints save the second round trip of a partly cached
prompt looked up again without changing any answer; a node's share of a long prompt goes
out as parallel requests of at most MAX_BATCH keys. Real daemons on loopback."""

from __future__ import annotations

import random

import pytest
from storeutil import make_blocks

from kvstore.client.cluster import ClusterClient, ClusterConfig
from kvstore.client.lookup import MissHints
from kvstore.client.node import ClientConfig, NodeClient
from kvstore.client.placement import Node, RankCache, rank
from kvstore.keys import BlockKey, Namespace
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
    assert h.among(ks) == [0, 1, 2]
    h.note(ks, [], [1])  # an owner holds it again
    assert h.among(ks) == [0, 2]
    h.note(ks, [3, 4, 5], [])  # past the bound: starts over
    assert len(h) <= 4 and h.among(ks) == [3, 4, 5]


async def test_cluster_hinted_lookup_takes_one_round_and_answers_the_same(start_daemon):
    ds = [start_daemon(use_disk=False) for _ in range(3)]
    addrs = [d.addr for d in ds]
    c = ClusterClient.static(addrs, FAST, CFG)
    await c.start(5.0)
    blocks = make_blocks(24, 1024, seed=61, ns=NS)
    assert [r.status.ok for r in await c.put(blocks[:12], 5.0)] == [True] * len(blocks[:12])
    view = [c._weights[a] for a in sorted(addrs)]
    (h, p) = blocks[12]  # on its third-ranked node only (its owners changed)
    n = NodeClient(rank(h.key.raw, view, 2)[2].id, FAST)
    assert (await n.put([(h, p)]))[0].status is Status.STORED
    await n.close()
    keys = [b.key for b, _ in blocks]
    want = ["dram"] * 13 + [None] * 11

    assert await c.exists(keys, 5.0) == want  # owners first, then the third nodes
    assert c.counters["lookup_second_rounds"] == 1
    asked = c.counters["lookup_keys_asked"]
    assert await c.exists(keys, 5.0) == want  # the 12 misses hinted: asked in round 1
    assert c.counters["lookup_second_rounds"] == 1
    assert c.counters["lookup_keys_asked"] - asked == 2 * 24 + 12  # the same keys asked
    assert await c.lookup_prefix(keys, 5.0) == 13

    # stored on their owners now: found there, dropped from the hints, still one round
    assert [r.status.ok for r in await c.put(blocks[13:], 5.0)] == [True] * len(blocks[13:])
    assert await c.exists(keys, 5.0) == ["dram"] * 24
    assert len(c._lookups.hints) == 1  # the block its owners do not hold
    assert await c.exists(keys, 5.0) == ["dram"] * 24
    assert c.counters["lookup_second_rounds"] == 1
    await c.close()


async def test_cluster_long_lookup_splits_each_nodes_keys(start_daemon):
    """More than MAX_BATCH keys for a node go out as even parallel requests; answers in order."""
    ds = [start_daemon(use_disk=False) for _ in range(3)]
    addrs = [d.addr for d in ds]
    c = ClusterClient.static(addrs, FAST, CFG)
    await c.start(5.0)
    blocks = make_blocks(8, 1024, seed=62, ns=NS)
    assert [r.status.ok for r in await c.put(blocks, 5.0)] == [True] * len(blocks)
    keys = [BlockKey(r) for r in raws(2 * MAX_BATCH, 7)]
    where = sorted(random.Random(8).sample(range(len(keys)), len(blocks)))
    for i, (h, _) in zip(where, blocks):
        keys[i] = h.key
    got = await c.exists(keys, 10.0)
    assert [i for i, t in enumerate(got) if t is not None] == where
    assert all(got[i] == "dram" for i in where)
    per_node = {a: c.nodes[a].counters["exists_keys"] for a in addrs}
    assert max(per_node.values()) > MAX_BATCH  # some node got more than one request's worth
    await c.close()
