"""Writes that do not wait on the dead: a failed replica write goes to the next node in
rendezvous order within the same call, and ``put``'s report tells exactly what was stored,
under-replicated and dropped (separate counters for node write failures and lost blocks)."""

from __future__ import annotations

import pytest
from cluster.cluster_hosts import TENANT_NS
from cluster.static_cluster import dram_cluster
from storeutil import make_blocks

from kvstore.client.cluster import ClusterClient, ClusterConfig
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.keys import Namespace

NS = Namespace("cluster-test", "uint8", 4)
FAST = ClientConfig(namespaces=(NS,), op_timeout_s=2.0, connect_timeout_s=0.5, probe_interval_s=0.1)


async def test_cluster_put_counts_under_replicated_and_dropped_blocks(start_daemon):
    ds, c = await dram_cluster(start_daemon, 3, FAST, ClusterConfig(replicas=2, probe_interval_s=0.1))
    r = await c.put(make_blocks(10, 4096, seed=1, ns=NS), 2.0)
    assert (r.stored, r.dropped, r.under_replicated, r.node_failures) == (10, 0, 0, 0)
    assert r.copies == [2] * 10
    ds[0].kill9()
    ds[1].kill9()
    r = await c.put(make_blocks(10, 4096, seed=2, ns=NS), 2.0)
    assert (r.stored, r.dropped, r.under_replicated) == (10, 0, 10), r
    assert [x.status.ok for x in r.results] == [True] * 10
    ds[2].kill9()
    r = await c.put(make_blocks(10, 4096, seed=3, ns=NS), 2.0)
    assert (r.stored, r.dropped) == (0, 10) and not any(x.status.ok for x in r.results)
    k = c.counters
    assert k["blocks_stored_nowhere"] == 10 and k["blocks_under_replicated"] == 10
    assert k["node_write_failures"] >= 1 and "dropped_writes" not in k
    await c.close()


@pytest.mark.heavy
async def test_cluster_write_to_a_partitioned_owner_is_redirected_in_the_same_call(hosts):
    ds = [hosts.start_node() for _ in range(3)]
    cfg = hosts.client_cfg(op_timeout_s=5.0)
    # (write_floor_s=5.0 gives the old behaviour: the owner's write waits the whole deadline)
    c = ClusterClient.static([d.addr for d in ds], cfg, ClusterConfig(replicas=2, probe_interval_s=0.1))
    await c.start(5.0)
    victim = ds[0]
    hosts.net.partition(victim.host)
    blocks = make_blocks(24, 32 * 1024, seed=9, ns=TENANT_NS)
    r = await c.put(blocks, 5.0)  # the connector's default save deadline
    assert r.dropped == 0 and r.under_replicated == 0, r
    assert r.redirected > 0 and r.node_failures > 0
    live = [d for d in ds if d is not victim]
    for d in live:  # both survivors hold every block: two copies each
        n = NodeClient(d.addr, cfg)
        assert [t is not None for t in (await n.lookup([h.key for h, _ in blocks], 5.0)).names()] == [
            True
        ] * len(blocks)
        await n.close()
    assert c.counters["writes_redirected"] == r.redirected
    await c.close()
