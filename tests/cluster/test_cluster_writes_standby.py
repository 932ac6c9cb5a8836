"""Writes when the healthy view is short of ``replicas`` (issue 23): a node out only for
being slow (connection up) is the next ranked node, so the write keeps its copies; a node
that is down is not, and the report says the write is under-replicated."""

from __future__ import annotations

from cluster.static_cluster import dram_cluster
from storeutil import make_blocks

from kvstore.client.cluster import ClusterConfig
from kvstore.client.config import ClientConfig
from kvstore.keys import Namespace

NS = Namespace("writes-standby", "uint8", 4)
FAST = ClientConfig(namespaces=(NS,), op_timeout_s=2.0, connect_timeout_s=0.5, probe_interval_s=0.1)


async def test_a_write_goes_to_a_node_out_for_slowness_when_the_view_is_short(start_daemon):
    ds, c = await dram_cluster(start_daemon, 2, FAST, ClusterConfig(replicas=2, eject_base_s=60))
    c.health.eject(ds[0].addr, "outlier")  # slow, not broken: its connection is up
    assert c.live_addrs() == [ds[1].addr]
    r = await c.put(make_blocks(6, 4096, seed=1, ns=NS), 2.0)
    assert r.copies == [2] * 6 and r.under_replicated == 0, r
    assert c.counters["puts_to_standby_nodes"] == 1
    ds[0].kill9()  # now a failure: no copy can go there
    r = await c.put(make_blocks(6, 4096, seed=2, ns=NS), 2.0)
    assert r.copies == [1] * 6 and r.under_replicated == 6 and r.dropped == 0, r
    assert c.counters["blocks_under_replicated"] == 6
    assert c.counters["puts_under_replicated"] == 1
    await c.close()
